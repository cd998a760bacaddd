#!/usr/bin/env bash
# Peak memory of a whole MPI job: the largest sum, over samples every 0.5 s, of the
# proportional set size (PSS: shared pages split between the processes sharing them) of
# every process of the job; and each rank's peak resident set (VmHWM, the kernel's own
# high-water mark, read until the rank exits). Usage:
#   benchmarks/peak_memory.sh mpiexec -n 100 python -m fedring --rounds 2
set -euo pipefail
descendants() {  # the job's processes only: other fedring jobs may be running on the machine
  local child
  for child in $(pgrep -P "$1" || true); do
    echo "$child"
    descendants "$child"
  done
}
"$@" &
job=$!
peak=0
declare -A hwm rank_of
while kill -0 "$job" 2>/dev/null; do
  total=0
  ranks=0
  for pid in "$job" $(descendants "$job"); do
    grep -qa "fedring" "/proc/$pid/cmdline" 2>/dev/null || continue
    pss=$(awk '/^Pss:/ {print $2}' "/proc/$pid/smaps_rollup" 2>/dev/null || echo 0)
    total=$((total + ${pss:-0}))
    ranks=$((ranks + 1))
    if [ -z "${rank_of[$pid]:-}" ]; then  # MPICH's PMI_RANK, Open MPI's rank; none: the launcher
      rank_of[$pid]=$( { tr '\0' '\n' < "/proc/$pid/environ"; } 2>/dev/null |  # it may have just exited
                      sed -n 's/^\(PMI_RANK\|OMPI_COMM_WORLD_RANK\)=//p' | head -1 || true)
    fi
    h=$(awk '/^VmHWM:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
    [ "${h:-0}" -gt "${hwm[$pid]:-0}" ] && hwm[$pid]=$h
  done
  if [ "$total" -gt "$peak" ]; then peak=$total; peak_ranks=$ranks; fi
  sleep 0.5
done
wait "$job"
echo "peak PSS of the job: $((peak / 1024)) MiB over ${peak_ranks:-0} processes ($((peak / 1024 / ${peak_ranks:-1})) MiB each)"
for pid in "${!hwm[@]}"; do
  if [ -n "${rank_of[$pid]:-}" ]; then echo "rank ${rank_of[$pid]}: peak RSS $((hwm[$pid] / 1024)) MiB"; fi
done | sort -t' ' -k2,2n
