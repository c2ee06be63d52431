"""What the test folders share (``from support.<module> import ...``: pyproject.toml puts tests/ on the tests'
sys.path). Each module says what it holds; tests/README.md says where tests go."""
