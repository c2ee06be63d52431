"""The benchmark: ``python -m qmoe_rtc bench <subcommand>`` (:mod:`qmoe_rtc.bench.cli` lists them).

Import what you need from the submodule that defines it: :mod:`~qmoe_rtc.bench.run` (the timing run),
:mod:`~qmoe_rtc.bench.report` (shapes, arguments, floors, the table; GPU-free),
:mod:`~qmoe_rtc.bench.layers` (the benchmark's layers), :mod:`~qmoe_rtc.bench.targets` (the issues'
speed targets), :mod:`~qmoe_rtc.bench.torch_ref` (the PyTorch baseline), and one module per other
subcommand (ab, crossover, host, soak, peers, reference; :mod:`~qmoe_rtc.bench.power`, the GPU's power and clock for
``ab --power``). Importing the package does no work.
"""
