#!/usr/bin/env bash
# ncu on one fused GEMM per shape under scripts/epilogue_stages.py's variants: kernel time, DRAM
# bytes, L2 hit rate, issue activity and the stall reasons the epilogue studies read (barrier:
# pingpong's epilogue turn-taking and the epilogue's own barriers; long scoreboard; wait). One process
# per variant and shape, each variant with its own kernel cache (quack's key does not see the
# variants' patches). On the device, from the project root, after sourcing the site's setup.sh:
#
#   VARIANTS="ship pf" SHAPES=125m,1b-4x4096 OP=gemm_dswiglu_rowscale_stat bash scripts/ncu_epilogue.sh
#
# Writes $OUT/ncu_epilogue.txt (the command and every counter, per variant and shape). Profiles the
# first launch of OP at each shape (the checked run, before the timing loop), at the GPU's own clocks.
set -uo pipefail
VARIANTS=${VARIANTS:-"ship pf"}
SHAPES=${SHAPES:-125m}
OP=${OP:-gemm_dswiglu_rowscale_stat}
OUT=${OUT:-.}
KERNEL=${KERNEL:-regex:${OP#gemm_}}
METRICS='gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,'\
'lts__t_sector_op_read_hit_rate.pct,smsp__issue_active.avg.pct_of_peak_sustained_active,'\
'smsp__warps_eligible.avg.per_cycle_active,smsp__pcsamp_warps_issue_stalled_long_scoreboard,'\
'smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_wait'
log="$OUT/ncu_epilogue.txt"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC') $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $OP at $SHAPES; variants $VARIANTS" >"$log"
for v in $VARIANTS; do
  for s in ${SHAPES//,/ }; do  # one process per shape: ncu's launch count would otherwise take one shape's launches only
    cmd=(ncu --clock-control none --target-processes all -k "$KERNEL" --launch-count 1 --metrics "$METRICS"
         python3 scripts/epilogue_stages.py --variant "$v" --child time --shapes "$s" --ops "$OP")
    { echo; echo "######## $v $s"; echo "# QUACK_CACHE_DIR=/tmp/ncu_$v ${cmd[*]}"; } >>"$log"
    QUACK_CACHE_DIR=/tmp/ncu_$v QUACK_CACHE_ENABLED=1 "${cmd[@]}" 2>&1 | grep -v "^==PROF==" >>"$log"
  done
done
grep -E "^######## |  kernel_|gpu__time|dram__bytes|hit_rate|issue_active|eligible|stalled_(long|barrier|wait)|^RESULT" "$log"
