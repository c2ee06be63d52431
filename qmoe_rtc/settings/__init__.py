"""Settings: every knob of qmoe_rtc, declared in :mod:`.knob_table` (the :class:`~.knob_table.Knob` type and
:data:`~.knob_table.KNOBS`, operational ``QMOE_RTC_*`` variables and ``QMOE_RTC_TUNE`` items) and read in
:mod:`.knobs` (typed, lazily, with :func:`~.knobs.scope` / :func:`~.knobs.apply` overrides)::

    from qmoe_rtc.settings import knobs
    with knobs.scope(cache_dir=tmp_path, strict=True):
        ...

Nothing here imports another part of the package but :mod:`qmoe_rtc.errors` (the layering test checks
it): every layer reads its knobs from here. Importing the package does no work.
"""
