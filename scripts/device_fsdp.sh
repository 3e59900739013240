#!/usr/bin/env bash
# On a 2-GPU H200 host, from the repo root, after `source .device/carry/setup.sh` (ONE device call,
# kind nvidia-h200-x2):   bash scripts/device_fsdp.sh   (RUN_8B=1: also the 8b run, ~200 s more; PROFILE=0: no 4.)
# 1. llama3_1b on 1 GPU and under FSDP2 on 2 GPUs with the same global batch (20 steps each): the
#    losses must agree (bf16: to about 1e-2) and the tokens/s are compared (strong scaling);
# 2. llama3_1b under FSDP2 on 2 GPUs with the 1-GPU run's batch on each GPU (weak scaling);
# 3. the 1b FSDP2 run's checkpoint (saved on 2 GPUs, sharded) resumed on 1 GPU for 10 more steps;
# 4. the FSDP2 overlap profile (scripts/fsdp_overlap_profile.py): 3 profiled steps of a 4-layer
#    llama3_1b slice on 2 GPUs, NCCL kernel time under compute -> $OUT/fsdp_overlap.json;
# 5. with RUN_8B=1, llama3_8b under FSDP2 on 2 GPUs for 50 steps (batch 2 x 2048 per GPU), last.
# Summaries land in $OUT/fsdp_summary.txt; full logs in $OUT/*.log.
set -uo pipefail
OUT=${OUT:-runs/fsdp}
R=/tmp/fsdp_runs
mkdir -p "$OUT" "$R"
export NCCL_NVLS_ENABLE=0  # NVLink SHARP multicast off for multi-GPU runs (see README, Multi-GPU)
TWO="python3 -m torch.distributed.run --standalone --nproc_per_node=2 train.py"
# log_every=10: a logged step reads the device, so logging every step would hide the host running ahead.
# optim.lr=3e-4: at the presets' 3e-3 the first 1b steps have gradient norms of 27-89 and every pair of
# runs diverges (eager on 1 vs 2 GPUs by 0.16 at step 17, 2026-11-30), which says nothing about agreement
COMMON="optim.lr=3e-4 trainer.progress_bar=false trainer.log_every=10 trainer.eval_every=0 trainer.seq_len=2048 kernels.backend=auto"
summary() { grep -E "model |step +(1|10|20|30|40|50|60) \||resumed|Error|error" "$1" | tail -n 20 | sed "s|^|$2: |" >> "$OUT/fsdp_summary.txt"; }

timeout 90 python3 train.py model=llama3_1b $COMMON trainer.batch_size=8 trainer.max_steps=20 trainer.ckpt_every=0 \
  trainer.run_dir=$R/1b_1gpu > "$OUT/1b_1gpu.log" 2>&1; echo "1b_1gpu rc=$?" >> "$OUT/fsdp_summary.txt"
summary "$OUT/1b_1gpu.log" 1b_1gpu
timeout 110 $TWO model=llama3_1b $COMMON trainer.batch_size=4 trainer.max_steps=20 trainer.ckpt_every=0 \
  trainer.parallel=fsdp trainer.run_dir=$R/1b_fsdp > "$OUT/1b_fsdp.log" 2>&1; echo "1b_fsdp rc=$?" >> "$OUT/fsdp_summary.txt"
summary "$OUT/1b_fsdp.log" 1b_fsdp
timeout 110 $TWO model=llama3_1b $COMMON trainer.batch_size=8 trainer.max_steps=20 trainer.ckpt_every=0 \
  trainer.parallel=fsdp trainer.run_dir=$R/1b_fsdp_weak > "$OUT/1b_fsdp_weak.log" 2>&1; echo "1b_fsdp_weak rc=$?" >> "$OUT/fsdp_summary.txt"
summary "$OUT/1b_fsdp_weak.log" 1b_fsdp_weak
# saved on 2 GPUs at step 20, resumed on 1 GPU (same global batch 8) to step 30
timeout 80 python3 train.py model=llama3_1b $COMMON trainer.batch_size=8 trainer.max_steps=30 trainer.ckpt_every=0 \
  trainer.run_dir=$R/1b_fsdp > "$OUT/1b_resume_1gpu.log" 2>&1; echo "1b_resume_1gpu rc=$?" >> "$OUT/fsdp_summary.txt"
summary "$OUT/1b_resume_1gpu.log" 1b_resume_1gpu
if [ "${PROFILE:-1}" = 1 ]; then
timeout 40 python3 -m torch.distributed.run --standalone --nproc_per_node=2 scripts/fsdp_overlap_profile.py \
  --preset llama3_1b --n-layers 4 --batch 4 --seq 2048 --warmup 3 --steps 3 --out "$OUT" > "$OUT/overlap.log" 2>&1
echo "overlap rc=$?" >> "$OUT/fsdp_summary.txt"
python3 - "$OUT/fsdp_overlap.json" >> "$OUT/fsdp_summary.txt" <<'PY' || true
import json, sys
s = json.load(open(sys.argv[1]))
for kind in ("all_gather", "reduce_scatter", "nccl"):
    print(f"overlap {kind}: busy {s[kind]['busy_ms']:.2f} ms/step, under compute {s[kind]['overlapped_ms']:.2f} ms "
          f"({s[kind]['overlapped_fraction']})")
print(f"overlap: compute busy {s['compute_busy_ms']:.2f} ms/step, GPU span {s['gpu_span_ms']:.2f} ms/step")
PY
fi
# last: its final checkpoint (84 GB of fp32 weights and AdamW moments over two ranks) outlasts the timeout
# and fills the disk, which stopped every run after it in the first call (exit 4: run-dir write failed)
if [ "${RUN_8B:-0}" = 1 ]; then
# peak memory per GPU of the 8b run: nvidia-smi's memory.used (the allocator's cache included), sampled every 0.5 s
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/8b_gpu_memory.csv" 2>/dev/null &
SMI=$!
timeout 190 $TWO model=llama3_8b $COMMON trainer.batch_size=2 trainer.max_steps=50 trainer.ckpt_every=0 \
  trainer.parallel=fsdp trainer.run_dir=$R/8b_fsdp > "$OUT/8b_fsdp.log" 2>&1; echo "8b_fsdp rc=$?" >> "$OUT/fsdp_summary.txt"
kill $SMI 2>/dev/null
awk -F', ' '$2 > m[$1] {m[$1] = $2} END {for (g in m) printf "8b_fsdp: GPU %s peak memory.used %d MiB\n", g, m[g]}' \
  "$OUT/8b_gpu_memory.csv" >> "$OUT/fsdp_summary.txt"
summary "$OUT/8b_fsdp.log" 8b_fsdp
fi
python3 - "$R" >> "$OUT/fsdp_summary.txt" <<'PY'
import json, sys
def losses(d): return {m["step"]: m["loss"] for m in map(json.loads, open(f"{sys.argv[1]}/{d}/metrics.jsonl"))}
one = losses("1b_1gpu")
for other in ("1b_fsdp",):
    two = losses(other)
    common = sorted(set(one) & set(two) & set(range(1, 21)))
    print(f"1b 1 GPU vs {other}, max |loss diff| over steps {common}:", max(abs(one[s] - two[s]) for s in common))
PY
cat "$OUT/fsdp_summary.txt"
