#!/usr/bin/env bash
# Set up everything, then run the whole test suite (unit, property, conformance, real NIXL/Mooncake, replay).
# Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
exec .venv/bin/python -m pytest "$@"
