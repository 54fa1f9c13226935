"""bench/gpu_bench.py: its CPU-side parts (shapes, byte/FLOP accounting, floors) and its
clear refusal without CUDA."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu_bench.py"


@pytest.fixture(scope="module")
def gpu_bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_builds_qwen3_shape_and_prints_floors(gpu_bench, capsys):
    assert gpu_bench.main(["--dry-run", "--models", "qwen3-0.6b"]) == 0
    out = capsys.readouterr().out
    # Qwen3-0.6B by hand: embedding (tied) + 28 x (q/k/v/o, q/k norms, SwiGLU, 2 norms) + norm.
    h, inter, layers, q, kv, hd, vocab = 1024, 3072, 28, 16 * 128, 8 * 128, 128, 151936
    per_layer = h * (q + 2 * kv) + q * h + 2 * hd + 3 * h * inter + 2 * h
    num_params = vocab * h + layers * per_layer + h
    assert f"qwen3-0.6b: {num_params / 1e9:.3f} B parameters" in out
    assert out.count("decode b=") == 4 + 4 and "prefill 8x2048" in out
    # Floor of batch 1: (weights + one context's KV) over the nominal bandwidth.
    kv_bytes = 1024 * 2 * layers * kv * 2
    floor_ms = 1e3 * (2 * num_params + kv_bytes) / gpu_bench.NOMINAL_COPY_BYTES_PER_S
    assert f"decode b=1   ctx=1024: floor {floor_ms:.3f} ms" in out


def test_fp8_kv_bytes_are_half_plus_scales(gpu_bench):
    from pdserve.engine.config import ModelArchConfig

    arch = ModelArchConfig.from_hf_config(gpu_bench.MODEL_SHAPES["llama-3.1-8b"])
    bf16 = gpu_bench.kv_bytes_read(arch, 4, 100, 2)
    fp8 = gpu_bench.kv_bytes_read(arch, 4, 100, 1)
    scales = 4 * 2 * 32 * 8 * 4 * 7  # 7 blocks of 16 hold 100 tokens
    assert fp8 == bf16 // 2 + scales


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_refuses_clearly_without_cuda(gpu_bench, capsys):
    assert gpu_bench.main(["--models", "qwen3-0.6b"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
