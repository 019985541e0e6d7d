#!/usr/bin/env bash
# Everything the lent GPU must run, in one call (see the device tool's METHOD.md).
# Usage on the GPU machine, from the repo root:  bash benchmarks/gpu_run.sh [STAGE ...]
# Stages: tests ops step train (default: all). Results go under $OUT (default
# benchmarks/results/<device>/): a markdown table and a PNG per op, step_*.md, train.md,
# loss_curves.png, env.txt. PYTEST_ARGS adds arguments to the tests stage; QUICK=1 shortens
# the sweeps.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
device=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
OUT=${OUT:-benchmarks/results/$device}
mkdir -p "$OUT"
stages=("${@:-tests ops step train}")
stages=(${stages[*]})
quick=${QUICK:+--quick}
status=0

{
    date -Iseconds
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

for stage in "${stages[@]}"; do
    echo "=== $stage"
    case $stage in
    tests)
        # the whole suite on the GPU: gpu-marked tests plus the small-shape ones on CUDA tensors
        python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tail -n 40 | tee "$OUT/pytest.txt"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    ops)
        for bench in benchmarks/bench_{layernorm,softmax,cross_entropy,dropout,embedding,matmul,attention}.py; do
            [ -f "$bench" ] || continue
            echo "--- $bench"
            python3 "$bench" --out "$OUT" $quick 2>&1 | tail -n 30 || status=1
        done
        ;;
    step)
        python3 benchmarks/bench_step.py --out "$OUT" --preset small 2>&1 | tail -n 20 || status=1
        python3 benchmarks/bench_step.py --out "$OUT" --preset large --dropout 0.0 \
            --cases torch:eager triton:graph torch:compile-ro sdpa-gpt:compile-ro 2>&1 |
            tail -n 12 || status=1
        ;;
    train)
        python3 benchmarks/bench_train.py --out "$OUT" --steps "${STEPS:-300}" 2>&1 | tail -n 12 ||
            status=1
        ;;
    *) echo "unknown stage $stage"; status=1 ;;
    esac
done
exit $status
