#!/usr/bin/env bash
# Issue 13 on the lent H200, in the call that carries the pack's last part (../shared/gpu) and
# .gpu/extras.tar.xz (`bash scripts/pack-serve-extras.sh .gpu` makes it): what vLLM's server
# needs beyond the pack (uvicorn, uvloop, prometheus, aiohttp, ...), put on sys.path *after* the
# machine's own packages (sitecustomize), so that what the machine has wins. Then `hsx serve` on
# the GPU (preflight, probe, vLLM's server) and bench/bench_serve.py --gpu: served vs
# plain-through-the-server vs in-process, one run.
#   ROUNDS=3 CONV=400 [SERVERS=2] bash bench/serve_on_h200.sh
# SERVERS=2: two servers on the one GPU (half its memory each) feeding one run (issue 14's
# data-parallel case, as far as one GPU shows it).
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
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
python3 - <<'PY' 2>&1 | tee "$out/imports.log"
import importlib, sys
for name in ("httpx", "uvicorn", "uvloop", "prometheus_client", "aiohttp", "fastapi",
             "vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.serve"):
    try:
        module = importlib.import_module(name)
        where = getattr(module, "__file__", "") or ""
        print(f"import {name}: ok ({'extras' if where.startswith('/tmp/extras') else 'machine or pack'})")
    except Exception as exc:
        print(f"import {name}: FAILED {exc!r}")
PY
timeout "${BENCH_TIMEOUT:-520}" python3 bench/bench_serve.py --gpu --rounds "${ROUNDS:-3}" \
  --conversations "${CONV:-400}" --servers "${SERVERS:-1}" 2>&1 | tee "$out/bench_serve.log" \
  | grep -v -i "warn" | tail -40
