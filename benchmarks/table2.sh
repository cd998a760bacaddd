#!/usr/bin/env bash
# The BRACE paper's Table 2 grid (attacks x aggregators) at a size this machine runs in
# about half an hour: Fashion-MNIST, non-IID q = 0.5, 20% Byzantine, single-process runs,
# two at a time. Usage: benchmarks/table2.sh [CLIENTS] [ROUNDS] [OUTDIR]
# (The cluster version of the same grid is jobs/table2.toml, submitted with `fedring sweep`.)
set -euo pipefail
clients=${1:-20}
rounds=${2:-300}
outdir=${3:-results/table2}
mkdir -p "$outdir"
lam=$(python -c "print(5 * $clients / 100)")  # the paper's lambda = 5 per 100 clients
jobs=()
for attack in none labelflip gaussian fang_krum fang_trim minmax minsum backdoor adaptive; do
  for agg in mean krum median trimmed_mean signsgd rlr brace; do
    case $agg in
      mean) topo=ring; lr=0.1 ;;
      krum|median|trimmed_mean) topo=server; lr=0.1 ;;
      signsgd|rlr|brace) topo=ring; lr=0.003 ;;
    esac
    byz=(--byzantine 0.2)
    [ "$attack" = none ] && byz=()
    out="$outdir/$attack-$agg.h5"
    [ -f "$out" ] && python -c "import h5py,sys; sys.exit(h5py.File('$out','r').attrs['status'] != 'complete')" 2>/dev/null && continue
    jobs+=("python -m fedring --clients $clients --rounds $rounds --eval-every 50 --topology $topo --aggregator $agg --lr $lr --attack $attack ${byz[*]} --set brace.lambda=$lam --out $out --overwrite --quiet")
  done
done
printf '%s\n' "${jobs[@]}" | xargs -P 2 -I{} sh -c '{} || echo "FAILED: {}"'
