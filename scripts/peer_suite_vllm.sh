#!/usr/bin/env bash
# vLLM's own KV-cache-manager and scheduler-level tests, run against vLLM's BlockPool and against umalloc's
# (umalloc.integrations.vllm), for each supported vLLM release (0.33.0 and 0.34.0), each run compared with that
# release's committed expectation file (tests/peer/vllm_expected.txt, tests/peer/vllm_expected_0.34.txt).
#
# For each release:
#   1. a separate venv (.peer/vllm-venv for 0.33.0, .peer/vllm-0.34.0-venv for 0.34.0; never .venv) with CPU
#      torch 2.13.0 and the imports of tests/peer/vllm-requirements.txt (under constraints.txt), then the vLLM
#      wheel installed --no-deps;
#   2. the vLLM sdist from PyPI (only its tests/ extracted, so its vllm/ sources never shadow the wheel);
#   3. pytest --noconftest over the KV-manager and the scheduler-level test files of tests/v1/core twice: stock,
#      and with -p vllm_plugin --umalloc-pool; VLLM_TARGET_DEVICE=cpu, and an offline HF_HOME holding the
#      config.json of the model the scheduler tests name, written from its published architecture numbers
#      (tests/peer/vllm_model_snapshot.py; nothing comes from a hub: HF_HUB_OFFLINE=1);
#   4. each run's outcomes against the release's expectation file: any failure not listed, or a listed test that
#      passes, fails this script;
#   5. umalloc's own tests of the integration (tests/integrations/test_integration_vllm.py) in the same venv.
# Idempotent: downloads are cached in .peer/cache, a venv is rebuilt only when the requirements change.
# Usage: bash scripts/peer_suite_vllm.sh      (extra arguments go to every pytest run of vLLM's tests)
#   PEER_VLLM_VERSIONS="0.34.0" limits the releases; PEER_VLLM_SCHEDULER=0 skips the scheduler-level files.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VERSIONS=(${PEER_VLLM_VERSIONS:-0.33.0 0.34.0})
PEER=$ROOT/.peer
CACHE=$PEER/cache
REQ=tests/peer/vllm-requirements.txt
FILES=(test_single_type_kv_cache_manager test_prefix_caching test_kv_cache_utils test_kv_sharing
       test_kv_cache_metrics test_mamba_align_chunk_split test_contiguous_kv_packing)
# the scheduler-level files (the e2e files start a real engine and are not run)
SCHED_FILES=(test_scheduler test_async_scheduler test_deferred_block_free test_swa_inflight_window_free
             test_priority_preemption_bug test_priority_scheduler_random test_worker_slot_overflow
             test_prefix_replay test_output test_encoder_cache_manager test_kv_cache_planning
             test_kv_cache_config_builder test_repetition_detection)
[ "${PEER_VLLM_SCHEDULER:-1}" = 0 ] && SCHED_FILES=()
# a subprocess test with a wall-clock timeout: its outcome depends on the machine's load, not on the pool
DESELECT=tests/v1/core/test_kv_cache_planning.py::test_is_kv_cache_spec_uniform
PY=${PYTHON:-python3}
t0=$SECONDS
mkdir -p "$CACHE"
status=0
# umalloc (and umalloc_replay, for the capacity model's tests) from this checkout on the peer venvs' path
mkdir -p "$PEER/path"
ln -sfn "$ROOT/umalloc" "$PEER/path/umalloc"
ln -sfn "$ROOT/umalloc_replay" "$PEER/path/umalloc_replay"  # the capacity model its tests check against the engine

# one release: VLLM_VERSION VENV EXPECTED TAG (TAG names its logs and outcome files under .peer)
suite() {
  local VLLM_VERSION=$1 VENV=$2 EXPECTED=$3 TAG=$4 tv=$SECONDS
  shift 4
  local SRC=$PEER/vllm-$VLLM_VERSION
  pip_q() {  # this machine's pip config names local package folders that may be absent: drop those warnings only
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile "$@" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  }

  # ---- 1. the venv
  local stamp=$VENV/.umalloc-peer-installed want
  want=$( (echo "$VLLM_VERSION"; cat "$REQ" constraints.txt) | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[vllm-peer $VLLM_VERSION] building $VENV (torch pinned by constraints.txt)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    pip_q -c constraints.txt -r "$REQ"
    echo "[vllm-peer $VLLM_VERSION] requirements installed at $((SECONDS - tv)) s"
    shopt -s nullglob
    local wheels=("$CACHE"/vllm-"$VLLM_VERSION"-*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
      "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: \
        -d "$CACHE" "vllm==$VLLM_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)
      wheels=("$CACHE"/vllm-"$VLLM_VERSION"-*.whl)
    fi
    shopt -u nullglob
    pip_q --no-deps "${wheels[0]}"
    echo "$want" > "$stamp"
  fi

  # ---- 2. the sdist's tests (the download builds the sdist's metadata: needs the venv's CPU torch, no isolation)
  local sdist=$CACHE/vllm-$VLLM_VERSION.tar.gz
  if [ ! -f "$sdist" ]; then
    echo "[vllm-peer $VLLM_VERSION] downloading the vLLM $VLLM_VERSION sdist"
    VLLM_VERSION_OVERRIDE=$VLLM_VERSION VLLM_TARGET_DEVICE=empty "$VENV/bin/python" -m pip download -q \
      --disable-pip-version-check --no-deps --no-binary vllm --no-build-isolation -d "$CACHE" "vllm==$VLLM_VERSION" \
      2> >(grep -v "is ignored: it is neither" >&2)
  fi
  if [ ! -f "$SRC/.extracted" ]; then
    rm -rf "$SRC"
    mkdir -p "$SRC"
    tar -xzf "$sdist" -C "$SRC" --strip-components=1 "vllm-$VLLM_VERSION/tests"
    printf '[pytest]\n' > "$SRC/pytest.ini"   # the runs name it (-c): this repo's pyproject.toml must not apply
    touch "$SRC/.extracted"
  fi
  # the model configs the scheduler tests name, in an offline Hugging Face cache of this folder's own
  "$VENV/bin/python" tests/peer/vllm_model_snapshot.py "$PEER/hf"
  echo "[vllm-peer $VLLM_VERSION] set-up done in $((SECONDS - tv)) s"

  # ---- 3. + 4. the two runs
  local tests=() f
  for f in "${FILES[@]}" "${SCHED_FILES[@]}"; do tests+=("tests/v1/core/$f.py"); done
  run_pytest() {  # one run (stock | umalloc); the two run at once, one per core
    local run=$1 t1=$SECONDS extra=()
    shift
    [ "$run" = umalloc ] && extra=(--umalloc-pool)
    (cd "$SRC" && HF_HOME="$PEER/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_TARGET_DEVICE=cpu \
       PYTHONPATH="$PEER/path:$ROOT/tests/peer" \
       "$VENV/bin/python" -m pytest -c pytest.ini --rootdir . --noconftest -q -p no:cacheprovider -p vllm_plugin \
       "${extra[@]}" -W ignore::pytest.PytestUnknownMarkWarning --outcomes-json="$PEER/outcomes-$TAG$run.json" \
       "${tests[@]}" --deselect "$DESELECT" "$@" \
       > "$PEER/pytest-$TAG$run.log" 2>&1) || true
    echo "[vllm-peer $VLLM_VERSION] $run: pytest finished in $((SECONDS - t1)) s (log .peer/pytest-$TAG$run.log)"
  }
  local t1=$SECONDS run
  rm -f "$PEER/outcomes-${TAG}stock.json" "$PEER/outcomes-${TAG}umalloc.json"
  run_pytest stock "$@" &
  run_pytest umalloc "$@" &
  wait
  echo "[vllm-peer $VLLM_VERSION] both runs (${#FILES[@]} KV-manager + ${#SCHED_FILES[@]} scheduler-level files)" \
       "in $((SECONDS - t1)) s"
  for run in stock umalloc; do
    if [ ! -s "$PEER/outcomes-$TAG$run.json" ]; then
      tail -n 30 "$PEER/pytest-$TAG$run.log"
      echo "[vllm-peer $VLLM_VERSION] $run: pytest wrote no outcomes" >&2
      status=1
      continue
    fi
    "$VENV/bin/python" tests/peer/vllm_expectations.py "$EXPECTED" "$run" "$PEER/outcomes-$TAG$run.json" || status=1
  done

  # ---- 5. umalloc's own tests of the integration (the scheduler soak on 0.33, whose platform layer runs on CPU)
  t1=$SECONDS
  local own=(tests/integrations/test_integration_vllm.py tests/integrations/test_vllm_capacity_model.py)
  [ "$VLLM_VERSION" = 0.33.0 ] && own+=(tests/integrations/test_vllm_soak.py)
  HF_HUB_OFFLINE=1 PYTHONPATH="$PEER/path" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" \
    -W ignore::pytest.PytestConfigWarning "${own[@]}" \
    > "$PEER/pytest-${TAG}integration.log" 2>&1 || { tail -n 40 "$PEER/pytest-${TAG}integration.log"; status=1; }
  echo "[vllm-peer $VLLM_VERSION] ${own[*]}:" \
       "$(tail -n 1 "$PEER/pytest-${TAG}integration.log") ($((SECONDS - t1)) s)"
  echo "[vllm-peer $VLLM_VERSION] done in $((SECONDS - tv)) s"
}

for v in "${VERSIONS[@]}"; do
  case $v in
    0.33.0) suite "$v" "$PEER/vllm-venv" tests/peer/vllm_expected.txt "" "$@" ;;
    0.34.0) suite "$v" "$PEER/vllm-$v-venv" tests/peer/vllm_expected_0.34.txt "$v-" "$@" ;;
    *) echo "[vllm-peer] no expectation file for vLLM $v (allowed 0.33.0, 0.34.0)" >&2; exit 2 ;;
  esac
done
echo "[vllm-peer] done in $((SECONDS - t0)) s"
exit $status
