#!/usr/bin/env bash
# Set up everything, then run the whole test suite (unit, property, conformance, real NIXL/Mooncake, replay).
# Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
# The quick checks fail first: lint and import order, then the typed face (mypy strict on umalloc/__init__.py,
# the integrations and tests/typing/readme_snippets.py, which uses the docs' examples and a transfer plan).
.venv/bin/ruff check umalloc umalloc_replay tests benchmarks scripts
.venv/bin/mypy --strict --follow-imports=silent umalloc/__init__.py umalloc/integrations tests/typing/readme_snippets.py
.venv/bin/mypy --follow-imports=silent umalloc/allocator umalloc_replay   # the allocator's services and the app
# tests/integrations/test_transformers_*.py (the transformers equality matrix, parity with stock, real weights) run
# in their own venv in CI
# (scripts/peer_suite_transformers.sh); now that .venv has transformers too it is left out here, not run twice.
exec .venv/bin/python -m pytest --ignore-glob='tests/integrations/test_transformers_*.py' "$@"
