#!/usr/bin/env bash
# Training throughput on one GPU: the enwik8 config for a few hundred steps with PyTorch ops,
# with the Triton kernels, and with PyTorch ops under torch.compile; then the loss curves of
# all three in one plot (they must overlap).   Usage: bash benchmarks/bench_train.sh OUT_DIR
set -uo pipefail
OUT=${1:-bench_results}
STEPS=${STEPS:-300}
RUNS=${RUNS:-runs/bench}
mkdir -p "$OUT"
rm -rf "$RUNS"
common=(--config "${CONFIG:-configs/enwik8.toml}" --max-steps "$STEPS" --set eval.generate_every=100000
    --set log.checkpoint_every=100000 --set log.progress=false)
status=0
declare -A flags=([torch]="" [triton]="--use-triton" [compile]="--compile")
for name in torch triton compile; do
    echo "--- $name: python3 train.py ${common[*]} ${flags[$name]}"
    # shellcheck disable=SC2086
    python3 train.py "${common[@]}" ${flags[$name]} --run-dir "$RUNS/$name" >>"$OUT/train_log.txt" 2>&1 ||
        { echo "run $name failed (see train_log.txt)"; status=1; }
done
python3 train.py plot "$RUNS/torch" "$RUNS/triton" "$RUNS/compile" -o "$OUT/loss_curves.png" || status=1

python3 - "$RUNS" "$STEPS" <<'PY' | tee "$OUT/train_summary.md"
import json, sys, pathlib
runs, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
skip = steps // 6  # compilation, autotuning and allocator warm-up
print(f"{steps} steps, default precision; steady state = records after step {skip}\n")
print("| run | tokens/s | ms/step | peak mem (MiB) | last train loss | last val loss |")
print("|---|---|---|---|---|---|")
for name in ("torch", "triton", "compile"):
    path = runs / name / "metrics.jsonl"
    if not path.exists():
        print(f"| {name} | failed | | | | |")
        continue
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    steady = [r for r in recs if r["step"] > skip]
    steady = steady if len(steady) > 1 else recs
    a, b = steady[0], steady[-1]
    tok_s = (b["tokens"] - a["tokens"]) / (b["train_time_s"] - a["train_time_s"])
    ms = 1e3 * (b["train_time_s"] - a["train_time_s"]) / (b["step"] - a["step"])
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    mem = max(r.get("peak_mem_mb", 0) for r in recs)
    print(f"| {name} | {tok_s:,.0f} | {ms:.1f} | {mem:,.0f} | {b['loss']:.4f} | "
          f"{val[-1] if val else float('nan'):.4f} |")
PY
exit $status
