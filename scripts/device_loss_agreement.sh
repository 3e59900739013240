#!/usr/bin/env bash
# On a 2-GPU H200 host, from the repo root, after `source .device/carry/setup.sh` (one device call):
#   bash scripts/device_loss_agreement.sh
# Which llama3_1b runs agree step by step (bf16, 20 steps, global batch 8 x 2048, the embedded corpus):
# eager on 1 GPU, eager under FSDP2 on 2 GPUs, CODA on 1 GPU without CUDA graphs (then, in the
# background on GPU 1, BACKENDS=cute,reference h200_compare.sh: the 125m curves with a noise floor).
# Per-step losses and grad norms side by side in $OUT/loss_agreement.txt, the runs' logs in /tmp (their
# errors in $OUT/agreement_errors.log); the compare's table, plot and the cute runs' metrics in $OUT (8 files).
set -uo pipefail
OUT=${OUT:-runs/loss_agreement}
R=/tmp/agree_runs
mkdir -p "$OUT" "$R"
export NCCL_NVLS_ENABLE=0
C="model=llama3_1b trainer.progress_bar=false trainer.log_every=1 trainer.eval_every=0 trainer.seq_len=2048 trainer.max_steps=20 trainer.ckpt_every=0 kernels.backend=cute"
timeout 100 python3 -m torch.distributed.run --standalone --nproc_per_node=2 train.py $C model.impl=eager trainer.batch_size=4 \
  trainer.parallel=fsdp trainer.run_dir=$R/eager_fsdp > "$R/eager_fsdp.log" 2>&1; echo "eager_fsdp rc=$?"
(CUDA_VISIBLE_DEVICES=1 BACKENDS=cute,reference timeout 330 bash scripts/h200_compare.sh 1000; rm -f "$OUT"/*_reference_metrics.jsonl) &
CUDA_VISIBLE_DEVICES=0 timeout 90 python3 train.py $C model.impl=eager trainer.batch_size=8 trainer.run_dir=$R/eager_1gpu \
  > "$R/eager_1gpu.log" 2>&1; echo "eager_1gpu rc=$?"
CUDA_VISIBLE_DEVICES=0 timeout 90 python3 train.py $C model.impl=coda trainer.batch_size=8 trainer.cuda_graphs=off \
  trainer.run_dir=$R/coda_1gpu_nographs > "$R/coda_1gpu_nographs.log" 2>&1; echo "coda_1gpu_nographs rc=$?"
CUDA_VISIBLE_DEVICES=0 timeout 90 python3 train.py $C model.impl=coda trainer.batch_size=8 \
  trainer.run_dir=$R/coda_1gpu > "$R/coda_1gpu.log" 2>&1; echo "coda_1gpu rc=$?"
python3 - "$R" > "$OUT/loss_agreement.txt" <<'PY'
import json, os, sys
runs = {}
for d in sorted(os.listdir(sys.argv[1])):
    try:
        runs[d] = {m["step"]: m for m in map(json.loads, open(f"{sys.argv[1]}/{d}/metrics.jsonl"))}
    except OSError:
        pass
names = list(runs)
print("step " + " ".join(f"{n:>26s}" for n in names) + "   (loss / grad_norm)")
for s in range(1, 21):
    print(f"{s:4d} " + " ".join(f"{runs[n][s]['loss']:12.4f} {runs[n][s]['grad_norm']:12.4f} " if s in runs[n] else f"{'-':>26s}" for n in names))
PY
wait
grep -h -i -E "error|Traceback" "$R"/*.log | head -n 40 > "$OUT/agreement_errors.log"
cat "$OUT/loss_agreement.txt"; head -8 "$OUT/compare.md" 2>/dev/null
