"""Set-up shared by the engine integration tests, run before any of their modules is imported.

vLLM resolves its platform once, at the first import that needs it, and finds no device on a CPU-only machine
unless ``VLLM_TARGET_DEVICE`` says ``cpu``; the scheduler and block-pool code these tests drive never touches a
device. Every module here that imports vLLM therefore sees the variable set before its first vLLM import.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("vllm") is not None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
