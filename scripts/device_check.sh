#!/usr/bin/env bash
# The GPU check, in at most $BUDGET seconds (default 290), from the repository root, with a CUDA torch:
#   0. scripts/device_late.py (CUDA only): NCCL's completion contract emulated on the one GPU (values);
#   1. scripts/fake_bench.py --check: the multi-rank paths at W = 8, 64, 1024, flat and HSDP, on torch's fake
#      process group (no values); on CUDA, then --model llama70b at the full vocabulary (peak per unit);
#   2. `fsdp-shim check` on CUDA (NCCL), one rank per visible GPU (values);
#   3. `fsdp-shim bench` at 37 MiB (BIG=1: and at 327 MiB and 2.4 GB, if the budget has room).
# A step gets what the budget has left (under 15 s: skipped); wheels under .whl/ are installed offline; logs go
# to $OUT (default ./device-out). `--device cpu` (CI): step 1 at W = 8 and 2x4, steps 2 and 3 on 2 gloo processes.
set -u
DEVICE=cuda
case "$#:${1:-}" in 0:) ;; 1:--device=*) DEVICE=${1#--device=} ;; 2:--device) DEVICE=$2 ;; *) DEVICE="?" ;; esac
case "$DEVICE" in cuda|cpu) ;; *) echo "usage: device_check.sh [--device cuda|cpu] (not: $*)" >&2; exit 2 ;; esac
BUDGET=${BUDGET:-290}
OUT=${OUT:-./device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/fsdp-shim-site .whl/*.whl; then
        export PYTHONPATH=/tmp/fsdp-shim-site
    else  # wheels for another interpreter (the GPU machine's): this machine's own packages
        echo "device_check: .whl/ not installable here; using this python3's packages"
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
    ranks=$(python3 -c "import torch; print(torch.cuda.device_count())") || exit 2
    echo "GPUs: $ranks" | tee -a "$OUT/gpu.txt"
    meshes="8 2x4 64 2x32 1024 2x512"
else
    ranks=2  # two gloo processes on the host
    meshes="8 2x4"
    echo "device: cpu, 2 gloo ranks" | tee "$OUT/gpu.txt"
fi

status=0
left() {  # left SECONDS: SECONDS, or what the budget has left (5 s kept for the end) if less; 1 at least
    local rest=$((BUDGET - SECONDS - 5))
    rest=$(( $1 < rest ? $1 : rest ))
    echo $(( rest < 1 ? 1 : rest ))
}
step() {  # step NAME SECONDS COMMAND...: one step, its log in $OUT/NAME.txt
    local name=$1 seconds
    seconds=$(left "$2")
    shift 2
    if [ "$seconds" -lt 15 ]; then
        echo "=== $*: skipped, ${seconds} s of the ${BUDGET} s budget left" | tee "$OUT/$name.txt"
        return
    fi
    echo "=== $* ($(date -u +%T), ${seconds} s)"
    timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}
run() {  # run NAME SECONDS ARGS...: one fsdp-shim command on $DEVICE and $ranks ranks
    local name=$1 seconds
    seconds=$(left "$2")
    shift 2
    step "$name" "$seconds" python3 -m fsdp_shim "$@" --device "$DEVICE" --ranks "$ranks" --timeout $((seconds - 10))
}

if [ "$DEVICE" = cuda ]; then
    # NCCL's completion contract on this one GPU: 2 gloo processes, all-gathers that land late (values)
    step device_late 120 python3 scripts/device_late.py --timeout 110
fi
# The multi-rank paths on this one GPU (fake process group), 45 s per mesh at most
# shellcheck disable=SC2086  # $meshes: one argument a mesh
step fake_check 280 python3 scripts/fake_bench.py --check --device "$DEVICE" --world $meshes --reps 11 --timeout 45 \
    --json "$OUT/fake_check.json"
if [ "$DEVICE" = cuda ]; then
    # Llama-3-70B's shapes at the full vocabulary: peak allocated per unit, summon against unshard()
    step scale70b 100 python3 scripts/fake_bench.py --model llama70b --device cuda --world 64 1024 --vocab 128256 \
        --reps 3
fi

run check 65 check --verbose
if [ "$DEVICE" = cuda ]; then
    run bench37 50 bench --reps 10 --warmup 2
else  # two processes on two cores: fewer repetitions, the same contenders
    run bench37 150 bench --reps 3 --warmup 1
fi
if [ "${BIG:-0}" = 1 ]; then
    run bench327 150 bench --width 768 --reps 10 --warmup 2
    run bench2g 150 bench --width 2048 --reps 5 --warmup 1 --no-between
fi
echo "=== device_check: ${SECONDS} s of the ${BUDGET} s budget, exit $status"
exit $status
