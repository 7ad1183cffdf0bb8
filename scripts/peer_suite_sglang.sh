#!/usr/bin/env bash
# umalloc behind SGLang's KV allocators (umalloc.integrations.sglang), checked against SGLang's own classes:
#
#   1. a separate venv in .peer/sglang-venv (never .venv) with CPU torch 2.13.0 and the imports of
#      tests/peer/sglang-requirements.txt (under constraints.txt), then the SGLang wheel installed --no-deps
#      (downloaded once into .peer/cache); torchvision is an import-only stand-in (tests/peer/sglang_cpu_shims.py);
#   2. umalloc from this checkout, and nothing else of it, on the venv's path (a symlink in .peer/path);
#   3. one pytest process over tests/integrations/test_integration_sglang.py (SGLang's import costs ~20 s of CPU,
#      paid once): the differential runs print "<class> page_size=<ps>: N sequences identical, 0 differ" and fail
#      on any difference; then install(), the version check and the behavioural differences; then the short
#      soak (tests/integrations/test_sglang_soak.py: "soak <class> page_size=<ps>: ... leaked 0 ...").
# Idempotent: the venv is rebuilt only when the requirements change.
# Usage: bash scripts/peer_suite_sglang.sh   (extra arguments go to pytest; UMALLOC_SGLANG_SEQUENCES sets the count)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
SGLANG_VERSION=0.5.23
PEER=$ROOT/.peer
VENV=$PEER/sglang-venv
CACHE=$PEER/cache
REQ=tests/peer/sglang-requirements.txt
PY=${PYTHON:-python3}
t0=$SECONDS
mkdir -p "$CACHE"
pip_q() {  # this machine's pip config names local package folders that may be absent: drop those warnings only
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" \
    2> >(grep -v -e "is ignored: it is neither a file nor a directory" \
                 -e "dependency resolver does not currently" -e "which is incompatible" >&2)
}

# ---- 1. the venv
stamp=$VENV/.umalloc-peer-installed
want=$( (echo "$SGLANG_VERSION"; cat "$REQ" constraints.txt) | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[sglang-peer] building $VENV (torch pinned by constraints.txt)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pip_q -c constraints.txt -r "$REQ"
  echo "[sglang-peer] requirements installed at $((SECONDS - t0)) s"
  shopt -s nullglob
  wheels=("$CACHE"/sglang-"$SGLANG_VERSION"-*.whl)
  if [ ${#wheels[@]} -eq 0 ]; then
    "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: \
      -d "$CACHE" "sglang==$SGLANG_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)
    wheels=("$CACHE"/sglang-"$SGLANG_VERSION"-*.whl)
  fi
  shopt -u nullglob
  pip_q --no-deps "${wheels[0]}" || true   # --no-deps: pip's conflict report about the skipped pins is expected
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
assert torch.version.cuda is None, f"not a CPU torch: {torch.__version__}"
bad = [d.metadata["Name"] for d in md.distributions()
       if d.metadata["Name"].lower().startswith(("nvidia-", "cuda-", "torchvision"))]
assert not bad, f"GPU packages pulled in: {bad}"
assert md.version("sglang") == "0.5.23", md.version("sglang")
PY
  echo "$want" > "$stamp"
fi
# ---- 2. umalloc (and umalloc_replay, for the capacity model's tests) from this checkout on the peer venv's path
mkdir -p "$PEER/path"
ln -sfn "$ROOT/umalloc" "$PEER/path/umalloc"
ln -sfn "$ROOT/umalloc_replay" "$PEER/path/umalloc_replay"  # the capacity model its tests check against the engine
echo "[sglang-peer] set-up done in $((SECONDS - t0)) s"

# ---- 3. the tests
t1=$SECONDS
status=0
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PEER/path" "$VENV/bin/python" -m pytest -q -s \
  -p no:cacheprovider -o addopts="" -W ignore tests/integrations/test_integration_sglang.py tests/integrations/test_sglang_soak.py \
  tests/integrations/test_sglang_capacity_model.py "$@" \
  > "$PEER/pytest-sglang.log" 2>&1 || status=1
grep -E "sequences identical|^seed=|^soak " "$PEER/pytest-sglang.log" | sort -u || true
[ $status -eq 0 ] || tail -n 40 "$PEER/pytest-sglang.log"
echo "[sglang-peer] test_integration_sglang.py, test_sglang_soak.py: $(tail -n 1 "$PEER/pytest-sglang.log") ($((SECONDS - t1)) s)"
echo "[sglang-peer] done in $((SECONDS - t0)) s"
exit $status
