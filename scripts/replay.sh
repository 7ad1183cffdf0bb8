#!/usr/bin/env bash
# Set up everything, then run the main job: `umalloc replay` on the shipped Mooncake trace with the embedded
# default (local) backend. Extra arguments go to `umalloc replay`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
exec .venv/bin/umalloc replay "$@"
