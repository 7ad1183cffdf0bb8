"""pytest collection of this package: the pool module imports vLLM, so its doctests are collected only where
vLLM is installed (the vLLM peer venv of ``scripts/peer_suite_vllm.sh``)."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["pool.py"]
