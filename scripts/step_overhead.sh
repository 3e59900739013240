#!/usr/bin/env bash
# On the H200, from the repo root, after `source .device/carry/setup.sh` (one device call):
#   bash scripts/step_overhead.sh [SHAPE ...]        (default: 125m 1b-4x4096)
# train.py's full step (data, forward, backward, clip, AdamW, logging) against the benchmark's step
# (scripts/bench.py coda-graphs: forward + backward + clip + AdamW on a fixed batch) at the same
# model, batch and sequence length: train.py's tokens/s over its last 40 of 60 steps vs bench.py's
# median step. The target is train.py within 5% of the benchmark. Results in $OUT/step_overhead.txt.
set -uo pipefail
OUT=${OUT:-runs/step_overhead}
mkdir -p "$OUT" /tmp/step_overhead
for shape in ${@:-125m 1b-4x4096}; do
  case $shape in
    125m) preset=llama3_125m; batch=8; seq=2048; vocab=32768 ;;
    1b-4x4096) preset=llama3_1b; batch=4; seq=4096; vocab=128256 ;;
    1b-2x8192) preset=llama3_1b; batch=2; seq=8192; vocab=128256 ;;
    *) echo "unknown shape $shape"; exit 2 ;;
  esac
  timeout ${BENCH_TIMEOUT:-120} python3 scripts/bench.py --shape "$shape" --variants coda-graphs --profile-steps 0 \
    --iters 20 --out /tmp/step_overhead > "/tmp/step_overhead/bench_$shape.log" 2>&1
  # model.vocab_size pins the preset's vocabulary (the embedded corpus' tokenizer has 8192 tokens)
  timeout ${TRAIN_TIMEOUT:-150} python3 train.py model=$preset model.vocab_size=$vocab kernels.backend=cute \
    trainer.batch_size=$batch trainer.seq_len=$seq trainer.max_steps=60 trainer.log_every=20 trainer.eval_every=0 \
    trainer.ckpt_every=0 trainer.progress_bar=false data.cache_dir=/tmp/coda-data \
    trainer.run_dir=/tmp/step_overhead/run_$shape > "/tmp/step_overhead/train_$shape.log" 2>&1
  python3 - "$shape" "$batch" "$seq" >> "$OUT/step_overhead.txt" <<'PY'
import json, sys
shape, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bench = json.load(open(f"/tmp/step_overhead/bench_{shape}.json"))["variants"]["coda-graphs"]
metrics = [json.loads(l) for l in open(f"/tmp/step_overhead/run_{shape}/metrics.jsonl")]
last = [m for m in metrics if m.get("step") in (40, 60)]
train_ms = batch * seq / (sum(m["tokens_per_s"] for m in last) / len(last)) * 1e3
bench_ms = bench["step"]["median_ms"]
print(f"{shape}: train.py step {train_ms:.2f} ms (tokens/s at steps 40, 60: "
      f"{[round(m['tokens_per_s']) for m in last]}) | bench step {bench_ms:.2f} ms (fwd+bwd "
      f"{bench['fwd_bwd']['median_ms']:.2f}) | train / bench {train_ms / bench_ms:.3f}")
PY
done
cat "$OUT/step_overhead.txt"
