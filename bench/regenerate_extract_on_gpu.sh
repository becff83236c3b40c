#!/usr/bin/env bash
# Issue 28's last figure on a lent GPU, in the call that carries the pack's last part and
# .gpu/extras.tar.xz (../shared/gpu's README; bench/serve_on_h200.sh for the extras `hsx serve`
# needs): regenerate-then-extract through one `hsx serve` (one load) against a plain engine's
# regeneration then in-process extraction (two loads), bench/bench_regenerate_extract.py.
#   CONV=400 MAX_TOKENS=256 ROUNDS=2 bash bench/regenerate_extract_on_gpu.sh
# WARM=1: no untimed warm-up round (a later call on the same warm machine).
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
if [ ! -d /tmp/site/vllm ]; then
  cat /tmp/parts/site.tar.xz.part* > /tmp/s.tar.xz && mkdir -p /tmp/site && tar -xJf /tmp/s.tar.xz -C /tmp/site || exit 3
fi
if [ ! -d /tmp/extras ]; then
  mkdir -p /tmp/extras && tar -xJf .gpu/extras.tar.xz -C /tmp/extras || exit 4
fi
printf 'import sys\nsys.path.append("/tmp/extras")\n' > /tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 VLLM_LOGGING_LEVEL=WARNING
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${BENCH_TIMEOUT:-560}" python3 bench/bench_regenerate_extract.py --conversations "${CONV:-400}" \
  --max-tokens "${MAX_TOKENS:-256}" --rounds "${ROUNDS:-2}" --kv-cache-gib "${KV:-40}" ${WARM:+--no-warm-up} \
  2>&1 | tee "$out/regenerate-extract.log" | grep -v -i "warn" | grep -E "^(round|REGEN|Trace|  |[A-Za-z]*Error)" | tail -40
