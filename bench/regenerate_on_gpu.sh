#!/usr/bin/env bash
# Issue 28's figure on a lent GPU, in the call that carries the pack's last part (../shared/gpu's
# README): unpack, then bench/bench_regenerate.py (regeneration against plain LLM.generate on the
# same engine, prompts, sampling and seeds; Llama-3.1-8B shape, dummy bf16 weights).
#   CONV=400 MAX_TOKENS=256 ROUNDS=2 bash bench/regenerate_on_gpu.sh
# ENGINES=inproc,child runs the bench once per engine home, one after the other.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
if [ ! -d /tmp/site/vllm ]; then
  cat /tmp/parts/site.tar.xz.part* > /tmp/s.tar.xz && mkdir -p /tmp/site && tar -xJf /tmp/s.tar.xz -C /tmp/site || exit 3
fi
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 VLLM_LOGGING_LEVEL=WARNING
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for home in $(echo "${ENGINES:-inproc}" | tr , ' '); do
  flag=""; [ "$home" = child ] && flag=--child
  timeout "${BENCH_TIMEOUT:-480}" python3 bench/bench_regenerate.py --conversations "${CONV:-400}" \
    --max-tokens "${MAX_TOKENS:-256}" --rounds "${ROUNDS:-2}" --kv-cache-gib "${KV:-40}" $flag \
    2>&1 | tee "$out/regenerate-$home.log" | grep -v -i "warn" | grep -E "^(round|REGEN|Trace|  |[A-Za-z]*Error)" | tail -30
done
