#!/usr/bin/env bash
# umalloc inside Hugging Face transformers' continuous batching: the equality matrix of
# tests/integrations/test_transformers_cb.py (per model and scenario, umalloc generate_batch tokens identical to
# stock generate_batch and to per-prompt generate()), run in a separate venv where transformers is installed.
#
#   1. a venv in .peer/transformers-venv (never .venv) with CPU torch 2.13.0 (constraints.txt), transformers
#      $TF_VERSION from PyPI and umalloc's own runtime deps (numpy, numba, typer, rich) plus pytest;
#   2. umalloc from this checkout, and nothing else of it, on the venv's path (a symlink in .peer/path);
#   3. pytest over the matrix; every (model, scenario) prints one line, then "N identical, M differ".
# Fails on any difference or any failing test. Idempotent: wheels cached in .peer/cache, the venv rebuilt only when
# the pins change.   Usage: bash scripts/peer_suite_transformers.sh   (extra arguments go to pytest)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
TF_VERSION=5.23.0
PEER=$ROOT/.peer
VENV=$PEER/transformers-venv
CACHE=$PEER/cache
PY=${PYTHON:-python3}
REQS=("transformers==$TF_VERSION" "numpy" "numba" "typer" "rich" "pytest")
t0=$SECONDS
mkdir -p "$CACHE"
pip_q() {  # this machine's pip config names local package folders that may be absent: drop those warnings only
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile --cache-dir "$CACHE/pip" "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# ---- 1. the venv
stamp=$VENV/.umalloc-peer-installed
want=$( (printf '%s\n' "${REQS[@]}"; cat constraints.txt) | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[transformers-peer] building $VENV (torch pinned by constraints.txt)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pip_q -c constraints.txt torch==2.13.0 "${REQS[@]}"
  echo "$want" > "$stamp"
fi
got=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('transformers'))")
[ "$got" = "$TF_VERSION" ] || { echo "[transformers-peer] transformers $got installed, want $TF_VERSION" >&2; exit 1; }
# ---- 2. umalloc from this checkout on the path
mkdir -p "$PEER/path"
ln -sfn "$ROOT/umalloc" "$PEER/path/umalloc"
echo "[transformers-peer] set-up done in $((SECONDS - t0)) s (transformers $got)"

# ---- 3. the matrix
report=$PEER/transformers-matrix.txt
: > "$report"
t1=$SECONDS
status=0
UMALLOC_TF_REPORT=$report HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error \
  PYTHONPATH="$PEER/path" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" \
  -W ignore::pytest.PytestConfigWarning tests/integrations/test_transformers_cb.py \
  tests/integrations/test_transformers_parity.py "$@" \
  > "$PEER/pytest-transformers.log" 2>&1 || status=1
sort "$report" | sed 's/^/[transformers-peer] /'
same=$(grep -c " identical " "$report" || true)
differ=$(grep -c " DIFFER " "$report" || true)
echo "[transformers-peer] $same identical, $differ differ"
echo "[transformers-peer] pytest: $(tail -n 1 "$PEER/pytest-transformers.log") ($((SECONDS - t1)) s, log .peer/pytest-transformers.log)"
if [ "$status" -ne 0 ] || [ "$differ" -ne 0 ] || [ "$same" -eq 0 ]; then
  grep -E "^(FAILED|ERROR)" "$PEER/pytest-transformers.log" | head -n 20 || true
  status=1
fi
echo "[transformers-peer] done in $((SECONDS - t0)) s"
exit $status
