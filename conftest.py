"""Collection rules for the whole tree (the test fixtures live in tests/conftest.py).

The SGLang integration's engine modules import SGLang when imported (their classes subclass SGLang's allocator
base), so ``--doctest-modules`` can import them only where SGLang is installed (the SGLang peer venv); elsewhere
they are not collected. The package itself, ``umalloc.integrations.sglang``, imports without SGLang and is.
"""

from __future__ import annotations

import importlib.util

#: modules of umalloc.integrations.sglang that import SGLang at import time
SGLANG_MODULES = ["umalloc/integrations/sglang/classes.py", "umalloc/integrations/sglang/swa.py",
                  "umalloc/integrations/sglang/unified.py"]

collect_ignore = [] if importlib.util.find_spec("sglang") is not None else SGLANG_MODULES
