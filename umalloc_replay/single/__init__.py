"""The single-rank replay: one prefill arena and one decode arena, in process or with the prefill side in a
second process (:mod:`~umalloc_replay.single.run` drives it)."""
