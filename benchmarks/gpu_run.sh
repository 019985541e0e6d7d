#!/usr/bin/env bash
# Everything the lent GPU must run, in one call (see the device tool's METHOD.md).
# Usage on the GPU machine, from the repo root:  bash benchmarks/gpu_run.sh [STAGE ...]
# Stages: tests, bench_ops, train (default: all). Results go under $OUT (default gpu_out/).
# PYTEST_ARGS adds arguments to the tests stage (e.g. a subset of files).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
stages=("${@:-tests bench_ops train}")
stages=(${stages[*]})
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
        python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 |
            tail -n 40 | tee "$OUT/pytest.txt"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    bench_ops)
        python3 benchmarks/bench_ops.py --out "$OUT" 2>&1 | tail -n 80
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    train)
        bash benchmarks/bench_train.sh "$OUT" || status=1
        ;;
    *) echo "unknown stage $stage"; status=1 ;;
    esac
done
exit $status
