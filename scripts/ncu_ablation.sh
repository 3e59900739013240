#!/usr/bin/env bash
# ncu on scripts/epilogue_ablation.py's rows: each row's first launch at each shape (its kernel: the
# bare GEMM `plain`, `five_tiles`, the op `dswiglu_rowscale_stat`, ...), at the GPU's own clocks, with
# the counters that say where an epilogue's traffic goes (DRAM bytes read and written, L2 hit rates)
# and how busy the SMs were: the tensor pipes, the L1/shared-memory unit, the L2 and the busiest memory
# unit (each as % of its peak), and the epilogue's shared-memory loads and stores (instructions,
# wavefronts, bank conflicts). On the device, from the project root, after sourcing the site's setup.sh:
#
#   ROWS="bare,5 tiles,op" SHAPES=1b,8b bash scripts/ncu_ablation.sh
#
# Writes $OUT/ncu_ablation.txt (the command and every counter, per shape).
set -uo pipefail
ROWS=${ROWS:-"bare,5 tiles,op"}
SHAPES=${SHAPES:-1b}
OUT=${OUT:-.}
KERNEL=${KERNEL:-"regex:plain|four_tiles|five_tiles|three_stores|two_loads|dswiglu"}
METRICS='gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,'\
'lts__t_sector_op_read_hit_rate.pct,lts__t_sector_op_write_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,'\
'sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,'\
'sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,'\
'l1tex__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,'\
'gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed,'\
'l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,'\
'l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,'\
'smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum'
log="$OUT/ncu_ablation.txt"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC') $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); rows $ROWS at $SHAPES" >"$log"
IFS=, read -ra rows <<<"$ROWS"
for s in ${SHAPES//,/ }; do
  for row in "${rows[@]}"; do  # one process per row and shape: its first launch, the call before its timing
    cmd=(ncu --clock-control none --target-processes all -k "$KERNEL" --launch-count 1 --metrics "$METRICS"
         python3 scripts/epilogue_ablation.py --shapes "$s" --rows "$row" --out /tmp/ncu_ablation)
    { echo; echo "######## $s $row"; echo "# ${cmd[*]}"; } >>"$log"
    "${cmd[@]}" 2>&1 | grep -v "^==PROF==" >>"$log"
  done
done
grep -E "^######## |  kernel_|gpu__time|dram__|hit_rate|issue_active|throughput|hmma|shared" "$log"
