#!/usr/bin/env bash
# The GPU checks in one go, in under 8 minutes on one H200: ragged transport against the dense oracle
# (with kept guest copies too), planner latency on the GPU, the grouped GEMM against its buffer,
# whether the guest-weight transfer is scheduled around the home-slot GEMMs, the dispatch benchmark
# with the ragged transport, and a short training run with the ragged transport, in two micro-batches
# per step. Uses the machine's own JAX (no install); results land in $OUT or benchmarks/results/gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
py=python3
status=0
timeout 240 $py -m benchmarks.gpu_check --out "$out" 2>&1 | tee "$out/gpu_check.log" || status=1
timeout 150 $py -m benchmarks.dispatch --nodes 1 --gpus "$($py -c 'import jax; print(jax.device_count())')" \
  --backend ragged --out "$out" 2>&1 | tee "$out/dispatch.log" || status=1
timeout 80 $py -m train --config configs/tiny_cpu.yaml --fresh --set topology.num_nodes=1 \
  --set topology.gpus_per_node=1 --set moe.transport=ragged --set train.steps=30 --set train.batch_size=8 \
  --set train.microbatches=2 \
  --set train.run_dir="$out/tiny_gpu" 2>&1 | tail -n 5 | tee "$out/train.log" || status=1
exit $status
