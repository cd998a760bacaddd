#!/usr/bin/env bash
# Peak memory of every rank at the literature's size: 100 clients of ResNet-18 (resnet18_gn,
# d = 11,173,962) on 4 ranks, one round (one evaluation, at the end), for the ring and for the
# server with median, trimmed mean and Krum (docs/figures.md). Needs about 12 GiB free: each
# run waits until `free` reports that much available. Usage: benchmarks/resnet_memory.sh [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-results/resnet-memory}
mkdir -p "$out"
export PYTHONPATH="$here/..:$here${PYTHONPATH:+:$PYTHONPATH}"  # fedring, and the colour_data plugin
for spec in "ring mean" "server median" "server trimmed_mean" "server krum"; do
  set -- $spec
  until [ "$(free -g | awk '/^Mem/ {print $7}')" -ge 12 ]; do sleep 10; done
  echo "== topology $1, aggregator $2"
  "$here/peak_memory.sh" mpiexec -n 4 python -m fedring run --dataset colour_data:Colour --clients 100 \
    --rounds 1 --batch-size 2 --topology "$1" --aggregator "$2" --quiet --overwrite --out "$out/$1-$2.h5"
done
