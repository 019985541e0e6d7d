#!/usr/bin/env bash
# Data-parallel scaling: the enwik8 config with the Triton kernels on 1 GPU, then on 2 GPUs
# under torchrun (DDP over NCCL), same per-GPU batch (4 x 4 x 512), a fixed number of steps
# with validation, sampling and periodic checkpoints off. Prints tokens/s of each and the
# scaling efficiency tok/s(2) / (2 x tok/s(1)); writes OUT_DIR/ddp_summary.txt.
#
#   bash benchmarks/bench_ddp.sh OUT_DIR          (from the repo root, on a 2-GPU machine)
#
# Offline: without data/enwik8 the stdlib corpus stands in (data.download=false, so no
# network is tried). STEPS (default 150) and CONFIG can be overridden from the environment.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/bench_ddp.sh OUT_DIR}
STEPS=${STEPS:-150}
CONFIG=${CONFIG:-configs/enwik8.toml}
RUNS=${RUNS:-runs/bench_ddp}
RUN_TIMEOUT=${RUN_TIMEOUT:-160} # seconds per run: the whole script stays under 6 minutes
mkdir -p "$OUT"
rm -rf "$RUNS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink SHARP / multicast objects can take shared GPU hosts out of service: keep them off.
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} # torchrun would otherwise set 1; same for both

common=(--config "$CONFIG" --use-triton --max-steps "$STEPS"
    --set data.download=false --set eval.eval_every=0 --set eval.generate_every=0
    --set log.checkpoint_every=0 --set log.log_every=10 --set log.progress=false
    --cuda-graph "${CUDA_GRAPH:-auto}") # auto: one graph per step on 1 and on 2 GPUs
log="$OUT/ddp_log.txt"
: >"$log"
status=0

{
    date -Iseconds
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee -a "$log"

echo "--- 1 GPU: python3 train.py ${common[*]}" | tee -a "$log"
CUDA_VISIBLE_DEVICES=0 timeout "$RUN_TIMEOUT" python3 train.py "${common[@]}" \
    --run-dir "$RUNS/gpu1" >>"$log" 2>&1 || { echo "1-GPU run failed (see $log)"; status=1; }

port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
launcher=(python3 -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1
    "--master_port=$port")
echo "--- 2 GPUs: ${launcher[*]} train.py ${common[*]}" | tee -a "$log"
CUDA_VISIBLE_DEVICES=0,1 timeout "$RUN_TIMEOUT" "${launcher[@]}" train.py "${common[@]}" \
    --run-dir "$RUNS/gpu2" >>"$log" 2>&1 || { echo "2-GPU run failed (see $log)"; status=1; }

python3 - "$RUNS" "$STEPS" "$CONFIG" <<'PY' | tee "$OUT/ddp_summary.txt"
import json, pathlib, sys

runs, steps, config = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
print(f"{config} --use-triton, {steps} steps, bf16 autocast, per-GPU batch as configured;")
print("steady state = records after step 50 (first steps pay compilation / warm-up)")
rates = {}
for n in (1, 2):
    path = runs / f"gpu{n}" / "metrics.jsonl"
    if not path.exists():
        print(f"{n} GPU(s): failed (no metrics)")
        continue
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    steady = [r for r in recs if r["step"] > 50]
    if len(steady) < 2:
        print(f"{n} GPU(s): too few steps ({recs[-1]['step'] if recs else 0})")
        continue
    a, b = steady[0], steady[-1]
    rates[n] = (b["tokens"] - a["tokens"]) / (b["train_time_s"] - a["train_time_s"])
    ms = 1e3 * (b["train_time_s"] - a["train_time_s"]) / (b["step"] - a["step"])
    per_step = (b["tokens"] - a["tokens"]) // (b["step"] - a["step"])
    mem = max(r.get("peak_mem_mb", 0) for r in recs)
    print(f"{n} GPU(s): {rates[n]:,.0f} tokens/s | {ms:.1f} ms/step | {per_step} tokens/step "
          f"| peak mem {mem:,.0f} MiB (rank 0) | last loss {b['loss']:.4f}")
if len(rates) == 2:
    eff = rates[2] / (2 * rates[1])
    print(f"speed-up {rates[2] / rates[1]:.2f}x on 2 GPUs; scaling efficiency "
          f"tok/s(2) / (2 x tok/s(1)) = {eff:.1%}")
PY
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
