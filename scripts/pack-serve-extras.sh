#!/usr/bin/env bash
# Packs what vLLM 0.26.0's OpenAI server (vllm.entrypoints.openai.api_server and `vllm serve`,
# which `hsx serve` runs) needs on the lent H200 beyond the machine's own packages (torch,
# transformers, huggingface_hub, ...) and ../shared/gpu/pack-vllm.sh's pack: uvicorn with uvloop,
# httptools, websockets and watchfiles; aiohttp; prometheus_client and its FastAPI instrumentator;
# model-hosting-container-standards; python-multipart; httpx (hsx's clients: the machine's hub
# brings httpx2 only); each with what it needs. Also a few small ones vLLM's processes or hsx's
# middleware import that the machine may have (pillow, einops, cloudpickle, py-cpuinfo, blake3,
# xxhash, annotated-doc), and typer/rich for hsx's command line. Found (2026-12-06) from the
# vllm 0.26.0 wheel's Requires-Dist against the pack, then on a CPU machine (torch 2.11.0, the
# pack, these extras) until nothing was missing: the server modules imported, `vllm serve
# --help`, vLLM's app built and served by its uvicorn. Not tried on a GPU yet.
# Versions: requirements/cpu-constraints.txt's, known to work with each other.
# bench/serve_on_h200.sh unpacks OUT_DIR/extras.tar.xz into a folder put on sys.path *after*
# the machine's and the pack's packages, so a package also found there is harmless.
# Usage: pack-serve-extras.sh [OUT_DIR] [EXTRA_PIP_SPEC ...]   (OUT_DIR: .gpu; extra specs: more
# cp312 wheels to include). About 30 s on 2 cores; writes OUT_DIR/extras.tar.xz (about 15 MB).
set -euo pipefail
out=${1:-.gpu}; shift || true
py=$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3 2>/dev/null | head -1 || true)
if [ -z "$py" ] && python3.12 --version >/dev/null 2>&1; then py=python3.12; fi
[ -n "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
specs=(# the ASGI server (uvicorn[standard]) and what vllm's serve/ssl code imports of it
       uvicorn==0.55.0 h11==0.16.0 click==8.5.1 httptools==0.9.0 websockets==16.1.1 uvloop==0.23.0
       watchfiles==1.3.0 anyio==4.16.0 idna==3.20
       # httpx: hsx serve's clients and model-hosting-container-standards'
       httpx==0.29.0 httpcore==1.0.9 certifi==2026.10.19.post1
       aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
       multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
       prometheus_client==0.26.0 prometheus-fastapi-instrumentator==8.1.0
       model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
       # fastapi's Form/UploadFile: checked as vLLM's speech-to-text routes are imported
       python-multipart==0.0.34
       # imported on vLLM's own import path (sampling params, workers, executor, usage stats),
       # by fastapi (annotated-doc) and by hsx's middleware (xxhash)
       pillow==13.0.0 einops==0.8.2 cloudpickle==3.1.3 py-cpuinfo==9.0.0 blake3==1.0.11
       annotated-doc==0.0.7 xxhash==4.1.0
       # `hsx serve`'s own command line (flows.cli: typer, rich), for a machine whose transformers
       # did not bring them
       typer==0.29.2 rich==15.0.0 shellingham==1.5.4 markdown-it-py==4.3.0 mdurl==0.1.2
       pygments==2.21.0
       "$@")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$work/whl" "${specs[@]}"
"$py" -m pip install -q --no-deps --no-compile --no-index --target "$work/extras" "$work"/whl/*.whl
mkdir -p "$out"
tar -cf - -C "$work/extras" . | xz -6 -T1 > "$out/extras.tar.xz"
ls -la "$out/extras.tar.xz"
