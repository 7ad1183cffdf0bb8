"""The multi-rank transfer replay: one process per TP / DCP rank on each side (:mod:`~umalloc_replay.multirank.ranks`
orchestrates it)."""
