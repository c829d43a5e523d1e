#!/usr/bin/env bash
# The GPU check: `fsdp-shim check` and `fsdp-shim bench` on CUDA (NCCL), one
# rank per visible GPU, run from the repository root on a machine whose
# python3 already has a CUDA torch. Nothing is installed from the network:
# wheels under .whl/ (wrapt, when the machine's is older than we declare) are
# installed into a private folder first. Logs go to $OUT (default ./device-out).
#
#   bash scripts/device_check.sh            # check, then bench at 37 and 327 MiB
#   BIG=1 bash scripts/device_check.sh      # and a 2.4 GB model
set -u
OUT=${OUT:-./device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fsdp-shim-site \
        .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/fsdp-shim-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
ranks=$(python3 -c "import torch; print(torch.cuda.device_count())") || exit 2
echo "GPUs: $ranks" | tee -a "$OUT/gpu.txt"

status=0
run() {  # run NAME SECONDS ARGS...: one fsdp-shim command, its log in $OUT/NAME.txt
    local name=$1 seconds=$2
    shift 2
    echo "=== fsdp-shim $* ($(date -u +%T))"
    timeout "$seconds" python3 -m fsdp_shim "$@" --device cuda --ranks "$ranks" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}

run check 120 check --verbose --timeout 110
run bench37 120 bench --reps 20 --warmup 3 --timeout 110
run bench327 150 bench --width 768 --reps 10 --warmup 2 --timeout 140
# host cost per call on the GPU (one real NCCL rank), next to the fake backend's figures in the README
echo "=== host_cost.py --device cuda ($(date -u +%T))"
timeout 150 python3 scripts/host_cost.py --device cuda --world 1 --reps 11 2>&1 | tee "$OUT/host_cost.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# the weight sync's two-group shape (tests/test_weight_sync.py) on NCCL: needs 3 GPUs, says "skipped" below that
echo "=== two_groups.py --device cuda ($(date -u +%T))"
timeout 200 python3 scripts/two_groups.py --device cuda --timeout 180 2>&1 | tee "$OUT/two_groups.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ "${BIG:-0}" = 1 ]; then
    run bench2g 150 bench --width 2048 --reps 5 --warmup 1 --no-between --timeout 140
fi
exit $status
