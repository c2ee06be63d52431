"""What the command line runs besides the benchmark (:mod:`qmoe_rtc.bench`) and the checkpoint converter
(:mod:`qmoe_rtc.checkpoints.cli`): ``python -m qmoe_rtc warm`` (:mod:`.warm`, precompile a model's kernel
modules into the cache) and ``python -m qmoe_rtc stress`` (:mod:`.stress`, the contention check, with its GPU
worker processes in :mod:`.stress_gpu`), and the argument types every command shares (:mod:`.args`).

``python -m qmoe_rtc`` (:mod:`qmoe_rtc.__main__`) dispatches to them. They sit on top of the package, beside the
benchmark: nothing below them imports them (the layering test checks it); the benchmark's and the checkpoint
converter's commands share :mod:`.args`. Importing the package does no work.
"""
