#!/bin/bash
# The measurement matrix of `python -m fedring bench network` (docs/figures.md, "The network"):
# one JSON per cluster under docs/measured/network/, then the tidy CSV, the tables and the plot.
#   sudo benchmarks/network.sh            # the whole matrix (about 15 min on an idle 2-core machine)
#   sudo benchmarks/network.sh 1gbit      # only the runs at one rate
# Each line is one emulated cluster: RATE NODES RANKS_PER_NODE SIZES WAIT; a rate's old files go first.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/measured/network
mkdir -p "$OUT"
ONLY=${1:-}
rm -f "$OUT/${ONLY:-}"*.json
while read -r rate nodes ppn sizes wait; do
  [ -z "$rate" ] || [ "${rate:0:1}" = "#" ] && continue
  [ -n "$ONLY" ] && [ "$ONLY" != "$rate" ] && continue
  name="$rate-${nodes}x$ppn-$wait"
  echo "== $name (sizes 2^{$sizes})" >&2
  python -m fedring bench network --rate "$rate" --nodes "$nodes" --ranks-per-node "$ppn" --sizes "$sizes" \
    --repeats 3 --wait "$wait" --json "$OUT/$name.json" < /dev/null
done <<'EOF'
# scalability at 1 Gbit/s: 2, 4, 8 nodes, one and two ranks per node
1gbit 2 1 20,22,24 spin
1gbit 4 1 20,22,24 spin
1gbit 8 1 20,22,24 spin
1gbit 2 2 20,22,24 spin
1gbit 4 2 20,22,24 spin
1gbit 8 2 20,22,24 spin
# the other wait policy (the default is spin)
1gbit 2 1 20,22,24 sleep
1gbit 4 1 20,22,24 sleep
1gbit 4 2 20,22,24 sleep
# a federated deployment's uplink, and a data centre's
100mbit 4 1 20,22 spin
100mbit 4 2 20,22 spin
10gbit 4 1 20,22,24 spin
10gbit 4 2 20,22,24 spin
EOF
python benchmarks/network_report.py "$OUT"/*.json --csv docs/measured/network.csv --plot docs/measured/network-scaling.png
