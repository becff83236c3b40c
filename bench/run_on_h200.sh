#!/usr/bin/env bash
# What one `device` call runs on the lent H200, once the three parts of ../shared/gpu's pack
# (vLLM 0.26) are in /tmp/parts: unpack, preflight + HF parity on the GPU, the GPU benchmark.
#   CONV=400 SIDES=plain,inproc,child STORES=shm,disk bash bench/run_on_h200.sh
#   CONFIG=tests/fixtures/configs/deepseek-v3 OVERRIDE=num_hidden_layers=8,n_routed_experts=64 KV=16 ...
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
if [ ! -d /tmp/site/vllm ]; then
  cat /tmp/parts/site.tar.xz.part* > /tmp/s.tar.xz && mkdir -p /tmp/site && tar -xJf /tmp/s.tar.xz -C /tmp/site || exit 3
fi
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 VLLM_LOGGING_LEVEL=WARNING
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; df -h /var/tmp /dev/shm | tail -2
if [ "${FP8CHECK:-0}" = 1 ]; then
  timeout 120 python3 bench/gpu_fp8_copier.py 2>&1 | tee "$out/fp8_copier.log" | tail -5
fi
if [ "${PARITY:-1}" = 1 ]; then
  timeout "${PARITY_TIMEOUT:-200}" python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep -E "^(==|PARITY|    )" | cut -c1-400
fi
timeout "${BENCH_TIMEOUT:-480}" python3 bench/bench_gpu.py --conversations "${CONV:-400}" \
  --sides "${SIDES:-plain,inproc,child}" --stores "${STORES:-shm,disk}" --side-timeout "${SIDE_TIMEOUT:-200}" \
  --config "${CONFIG:-tests/fixtures/configs/llama-3.1-8b}" --config-override "${OVERRIDE:-}" --kv-cache-gib "${KV:-40}" \
  2>&1 | tee "$out/bench.log" | grep -v "^RESULTS" | grep -v -i "warn" | tail -80
