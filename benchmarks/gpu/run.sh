#!/usr/bin/env bash
# The GPU run of umalloc in one command (a bare GPU machine, about 6 minutes): install carried wheels, run the
# GPU tests and benchmarks/bench_gpu.py, keep every log under $OUT, print a short table last.
#
#   benchmarks/gpu/run.sh            # on the GPU machine, from the repository root
#   benchmarks/gpu/run.sh --dry-run  # print what it would do and exit 0 (any machine)
#
# Wheels: every *.whl in $UMALLOC_WHEELS (default .whl/) is installed with --no-deps into /tmp/site (e.g. nixl-cu13
# for the NIXL VRAM tests; cupy and torch come with the image). Without them the NIXL tests skip.
# Budget (seconds, each step under `timeout`): env 10, install 60, tests 200, bench 150.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT="${OUT:-$PWD/out/gpu}"
WHEELS="${UMALLOC_WHEELS:-.whl}"
PY="${PYTHON:-python3}"
SITE=/tmp/site
TESTS="tests/translators/test_gpu_capture.py tests/pool/test_gpu_arena.py tests/translators/test_translators.py tests/translators/test_translate_agreement.py"

run() {  # run NAME TIMEOUT_S CMD...: log to $OUT/NAME.log, remember the status
    local name=$1 limit=$2; shift 2
    if (( DRY )); then echo "would run ($name, timeout ${limit}s): $*"; return 0; fi
    echo "== $name: $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc" | tee -a "$OUT/status.txt"
    return $rc
}

if (( DRY )); then
    echo "dry run: OUT=$OUT wheels=$WHEELS python=$PY"
    ls "$WHEELS"/*.whl 2>/dev/null | sed 's/^/would install: /' || true
else
    mkdir -p "$OUT"; : >"$OUT/status.txt"
fi
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=all MC_LOG_LEVEL=ERROR
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
run env 10 bash -c "nvidia-smi; $PY -c 'import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; $PY -m pip list 2>/dev/null | grep -iE 'cupy|triton|nixl|torch|numba|pytest'"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    run install 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$PYTHONPATH:$SITE"
    # umalloc's nixl backend imports the module nixl_cu12; the image is CUDA 13, so the carried wheel is nixl-cu13
    # (same API): alias it unless a real nixl_cu12 is there.
    if (( ! DRY )) && [[ -d "$SITE/nixl_cu13" && ! -e "$SITE/nixl_cu12" ]]; then
        printf 'import nixl_cu13 as _m\nfrom nixl_cu13 import *  # noqa: F401,F403\n\n\ndef __getattr__(name):\n    return getattr(_m, name)\n' >"$SITE/nixl_cu12.py"
        echo "aliased nixl_cu12 -> nixl_cu13" | tee -a "$OUT/status.txt"
    fi
fi
run tests 200 "$PY" -m pytest -q -p no:cacheprovider -o addopts="-rfE" --timeout 120 $TESTS
run bench 150 "$PY" benchmarks/bench_gpu.py --out "$OUT"
(( DRY )) && exit 0

echo; echo "== logs in $OUT"; cat "$OUT/status.txt"
echo "== tests (last lines)"; tail -n 15 "$OUT/tests.log"
echo "== bench table"
if grep -q '^what ' "$OUT/bench.log"; then sed -n '/^what /,$p' "$OUT/bench.log"; else tail -n 20 "$OUT/bench.log"; fi
