#!/usr/bin/env bash
# Peak memory of a whole MPI job: the largest sum, over samples every 0.5 s, of the
# proportional set size (PSS: shared pages split between the processes sharing them) of
# every process of the job. Usage: benchmarks/peak_memory.sh mpiexec -n 100 python -m fedring --rounds 2
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
while kill -0 "$job" 2>/dev/null; do
  total=0
  ranks=0
  for pid in "$job" $(descendants "$job"); do
    grep -qa "fedring" "/proc/$pid/cmdline" 2>/dev/null || continue
    pss=$(awk '/^Pss:/ {print $2}' "/proc/$pid/smaps_rollup" 2>/dev/null || echo 0)
    total=$((total + ${pss:-0}))
    ranks=$((ranks + 1))
  done
  if [ "$total" -gt "$peak" ]; then peak=$total; peak_ranks=$ranks; fi
  sleep 0.5
done
wait "$job"
echo "peak PSS of the job: $((peak / 1024)) MiB over ${peak_ranks:-0} processes ($((peak / 1024 / ${peak_ranks:-1})) MiB each)"
