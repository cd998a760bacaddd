#!/usr/bin/env bash
# The GPU figures of issue 32 on one GPU, within 8 minutes of an H100 (docs/arrays.md, "Measuring
# on a GPU"): the tests that need CUDA, the ring of 100 clients on one rank against a bare sum
# (benchmarks/local_ring.py), the host's batch draws (benchmarks/draws.py), then `bench train`
# (the CNN with 100 clients, per client and batched, against the bare loops, and where its round
# goes: benchmarks/round_profile.py, printed; ResNet-18 with GroupNorm batched 25 against the bare
# batched loop; median, trimmed mean and Krum on the server against that ring-mean round) and
# `bench aggregators --device cuda --byzfl` on 100 x 11.2M rows. Every figure is a JSON record
# naming its device, in docs/measured/gpu/ (FEDRING_GPU_OUT elsewhere). Usage, from anywhere:
#   bash benchmarks/gpu.sh            # on a machine with a GPU (offline: wheels from .wheels/)
#   FEDRING_GPU_STEPS="tests aggregators" bash benchmarks/gpu.sh   # only those steps (train: all of bench train)
#   bash benchmarks/gpu.sh --smoke    # the same steps on the CPU at tiny sizes, into a temp folder
#                                     # (the CIFAR CNN standing in for ResNet-18)
# A step that fails or runs out of its time is reported, the others still run, and the script
# exits 1 after the summary.
set -euo pipefail
cd "$(dirname "$0")/.."
smoke=0
if [ "${1:-}" = "--smoke" ]; then smoke=1; elif [ -n "${1:-}" ]; then echo "usage: $0 [--smoke]" >&2; exit 2; fi
budget=470  # seconds for every step: 8 minutes less the summary's
start=$SECONDS
failed=()
only=${FEDRING_GPU_STEPS:-}  # e.g. "tests aggregators": only those steps (train: every bench train step)
# a device image whose mpi4py is built on Open MPI, run as root: Open MPI's mpiexec refuses root
# without these (MPICH ignores them)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ "$smoke" = 1 ]; then
  device=cpu out=${FEDRING_GPU_OUT:-$(mktemp -d)}
  clients=6 rounds=1 batch=4 cnn_batched=3 big=cnn_cifar big_batched=3 agg_clients=8 dim=3000 repeats=1
  ring_sizes="100 1000"
else
  device=cuda out=${FEDRING_GPU_OUT:-docs/measured/gpu}
  clients=100 rounds=10 batch=32 cnn_batched=100 big=resnet18_gn big_batched=25 agg_clients=100 dim=11200000 repeats=3
  ring_sizes="100 10000 139960 1000000"  # 139,960: the CNN's parameters
fi
mkdir -p "$out"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# an image whose interpreter is python3 alone: a python that execs it (a link would lose its venv)
if ! command -v python >/dev/null; then
  mkdir -p "$scratch/bin"
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$(command -v python3)" >"$scratch/bin/python"
  chmod +x "$scratch/bin/python"
  export PATH="$scratch/bin:$PATH"
fi

# step NAME LIMIT_S COMMAND...: run it under the time left (at most LIMIT_S); record a failure
step() {
  local name=$1 limit=$2
  shift 2
  if [ -n "$only" ] && [[ " $only " != *" ${name%%-*} "* ]]; then
    return 0
  fi
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: NOT RUN, the time budget is spent" >&2
    failed+=("$name (not run)")
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (at most ${limit} s; $((SECONDS - start)) s gone)"
  local t0=$SECONDS
  if timeout --signal=INT --kill-after=10 "$limit" "$@"; then
    echo "=== $name: done in $((SECONDS - t0)) s"
  else
    echo "=== $name: FAILED (exit $?) after $((SECONDS - t0)) s" >&2
    failed+=("$name")
  fi
}

# --- the environment: Python with torch (CUDA unless --smoke), numpy, mpi4py, h5py, pytest; what
# fedring needs beyond them comes from .wheels/ (array-api-compat; ByzFL is optional), offline
python - <<EOF
import sys, torch, numpy
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, numpy {numpy.__version__}")
if "$device" == "cuda":
    assert torch.cuda.is_available(), "no GPU visible: run with --smoke on a machine without one"
    print("device:", torch.cuda.get_device_name(0))
EOF
if [ "$smoke" = 0 ]; then
  for module in array_api_compat byzfl; do
    if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
      wheel=$(ls .wheels/"${module}"-*.whl 2>/dev/null | head -1 || true)
      if [ -n "$wheel" ]; then
        python -m pip install -q --no-index --no-deps "$wheel"
      elif [ "$module" = byzfl ]; then
        echo "warning: no .wheels/byzfl-*.whl: ByzFL's rules are not timed" >&2
      else
        echo "error: $module is missing and .wheels/ has no wheel of it" >&2
        exit 1
      fi
    fi
  done
  # an mpi4py that finds no MPI library: MPICH from its wheel in .wheels/ (pip download mpich)
  if ! python -c "from mpi4py import MPI" 2>/dev/null; then
    wheel=$(ls .wheels/mpich-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$wheel" ]; then
      echo "error: mpi4py finds no MPI library and .wheels/ has no mpich wheel" >&2
      exit 1
    fi
    python -m pip install -q --no-index --no-deps "$wheel"
    prefix=$(python -c "import sys; print(sys.prefix)")
    export PATH="$prefix/bin:$PATH" LD_LIBRARY_PATH="$prefix/lib:${LD_LIBRARY_PATH:-}"
  fi
  if ! (cd / && python -c "import fedring") 2>/dev/null; then
    python -m pip install -q --no-index --no-deps --no-build-isolation -e .
  fi
fi
# the data sets the bench trains on; random images in their published formats where they are absent
data="the published files"
if [ ! -d "${FEDRING_DATA:-/usr/share/datasets/fashion-mnist}" ] || [ ! -d "${FEDRING_CIFAR10:-cifar-10-batches-py}" ]; then
  eval "export $(python benchmarks/gpu_figures.py data "$scratch/data")"
  data="random images in the published formats (benchmarks/gpu_figures.py data)"
fi
name=$(python -c "import torch; print(torch.cuda.get_device_name(0) if '$device' == 'cuda' else 'cpu')")

# --- the tests that need CUDA (skipped without one), and the attacks on tensors: about 60 s.
# --smoke only collects them: the suite itself runs them on the CPU
gpu_tests=$(grep -l "cuda.is_available" tests/test_*.py | tr '\n' ' ' || true)
if [ "$smoke" = 1 ]; then
  step tests 60 python -m pytest -q -p no:cacheprovider --collect-only $gpu_tests tests/test_attacks_on_device.py
else
  step tests 120 python -m pytest -q -p no:cacheprovider --junitxml "$scratch/tests.xml" \
    $gpu_tests tests/test_attacks_on_device.py
  [ -f "$scratch/tests.xml" ] && python benchmarks/gpu_figures.py tests "$scratch/tests.xml" "$out/tests.json" "$name"
fi

# --- the ring of 100 clients on one rank against a bare sum, numpy and device rows, and the
# reduce-scatter's padded and planned paths forced (what PADDED_BYTES chooses between): about 40 s
# shellcheck disable=SC2086
step ring 90 python benchmarks/local_ring.py --device "$device" --sizes $ring_sizes --repeats "$((repeats * 7))" \
  --paths --json "$out/local_ring.json"

# --- the host's draws of a round's batch indices, 100 clients (the device waits for them before the
# round's first kernel; a lent machine's host is not this one's): a few seconds
step draws 30 python benchmarks/draws.py --repeats "$((repeats * 7))" --few --json "$out/draws.json"

# --- bench train: the CNN, 100 clients per client and batched, plain and with momentum, clipping
# and weight decay (about 30 s each); ResNet-18 (GroupNorm)
# batched 25 on the ring (about 45 s) and with three server rules (about 45 s each)
train() {  # train NAME ARGS...: one bench train record, marked with the data it read
  local file=$1
  shift
  step "$file" 120 python -m fedring bench train --device "$device" --clients "$clients" --batch-size "$batch" \
    --json "$out/$file.json" "$@"
  [ -f "$out/$file.json" ] && python benchmarks/gpu_figures.py mark "$out/$file.json" "data=$data" "command=bench train $*"
  return 0
}
train train-cnn --model cnn --rounds "$rounds" --batched-clients "$cnn_batched"
# the same with the field's client settings: each client step clips, decays and keeps momentum
# (about 30 s)
train train-cnn-protocol --model cnn --rounds "$rounds" --batched-clients "$cnn_batched" \
  --set momentum=0.9 --set clip_norm=1 --set weight_decay=0.0005
# where the CNN's round goes, per client and batched (cProfile, about 40 s; into the log: the
# machine returns only so many files)
step profile 90 python benchmarks/round_profile.py --device "$device" --clients "$clients" \
  --rounds $((rounds > 5 ? 5 : rounds)) --top 25
resnet=(--model "$big" --dataset cifar10 --rounds $((rounds > 3 ? 3 : rounds)) --batched-clients "$big_batched")
train "train-$big-ring" "${resnet[@]}"
for rule in median trimmed_mean krum; do
  train "train-$big-server-$rule" "${resnet[@]}" --topology server --aggregator "$rule" --byzantine 0.2
done

# --- bench aggregators on the device against ByzFL's torch rules, 100 x 11.2M float32 (4.5 GB):
# about 120 s
rules=mean,median,trimmed_mean,krum,multikrum,geomed,cclip,cclip-random,mda,monna-0,meamed,caf-byzfl,smea
rules=$rules,nnm+mean,bucketing+mean,clipping+mean,arc+mean
step aggregators 240 python -m fedring bench aggregators --device "$device" --byzfl --clients "$agg_clients" \
  --dim "$dim" --repeats "$repeats" --rules "$rules" --json "$out/aggregators.json"

echo
echo "=== summary ($((SECONDS - start)) s; records in $out; data: $data)"
python benchmarks/gpu_figures.py summary "$out"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
