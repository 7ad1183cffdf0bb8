"""The main job, ``umalloc replay``: a real request trace through a prefill arena and a decode arena.

Modules: :mod:`~umalloc.replay.trace` (trace parsers), :mod:`~umalloc.replay.kvfill` (deterministic KV
pattern fill and verify), :mod:`~umalloc.replay.workload` (request lifecycle, footprints, block table),
:mod:`~umalloc.replay.prefill` (the prefill side in process, sequence allocation),
:mod:`~umalloc.replay.remote` (the prefill side in a second process), :mod:`~umalloc.replay.report` (JSON report
schema and the final table), :mod:`~umalloc.replay.plot` (occupancy plot), :mod:`~umalloc.replay.layouts`
(dynamic / static / padded decode layouts and their byte accounting), :mod:`~umalloc.replay.fit` (the up-front
fit check), :mod:`~umalloc.replay.preflight` (argument, path and memory checks), :mod:`~umalloc.replay.signals`
(Ctrl-C and the second process), :mod:`~umalloc.replay.kvfill_kernels` (compiled pattern loops),
:mod:`~umalloc.replay.run` (the driver and its scheduler). The multi-rank transfer replay (one process per TP /
DCP rank on each side, ``--prefill-tp`` / ``--decode-tp`` / ``--prefill-dcp`` / ``--decode-dcp`` /
``--prefill-page-size``): :mod:`~umalloc.replay.ranks` (orchestration), :mod:`~umalloc.replay.rankside` (what
each rank runs), :mod:`~umalloc.replay.headpattern` (the pattern by global head and logical position),
:mod:`~umalloc.replay.ranks_report` (its report and table). The console script is :mod:`umalloc.cli`.
"""

#: ``umalloc replay`` with no arguments replays this many requests of the packaged trace ...
DEFAULT_REQUESTS = 96
#: ... with every token count divided by this (about two minutes on a 2-core CPU machine).
DEFAULT_TOKEN_SCALE = 8
