"""Quantized layers on CPU with bf16 activations run torch's packed int4/int8 kernels, and
those give the dequantize-then-matmul reference's result.

References are independent of the packed path: GGML blocks dequantized by gguf-py, int
weights dequantized by the formula ``(q - z) * s`` written out here. Tolerances: int4 packs
are exact up to bf16 rounding of the group scale/offset (2^-8 relative each) and of the
output; per-channel int8 adds half a step of ``max|w_row| / 127`` per weight.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pdserve.engine.quantization.cpu_packed import Int4CpuGemm, Int8CpuGemm, int4_layout_fits
from pdserve.engine.quantization.gguf_blocks import q4_blocks_as_int4
from pdserve.engine.quantization.gguf_linear import GGUFLinear, GGUFPackedWeight
from pdserve.engine.quantization.int_linear import IntLinear
from pdserve.engine.quantization.int_weight import IntWeight

T = gguf.GGMLQuantizationType


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def _int_reference(codes, scales, zeros, group_size) -> torch.Tensor:
    """``(q - z) * s`` per group, float32, by hand."""
    g = torch.arange(codes.shape[1]) // group_size
    return (codes.float() - zeros.float()[:, g]) * scales.float()[:, g]


@pytest.mark.parametrize("zero_kind", ["integer", "float-min"])
def test_int4_layer_uses_packed_kernel_and_matches_reference(zero_kind):
    gen = torch.Generator().manual_seed(0)
    out_f, in_f, gs = 96, 256, 32
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out_f, in_f // gs, generator=gen) * 0.02 + 0.001).half()
    if zero_kind == "integer":
        zeros = torch.randint(0, 16, (out_f, in_f // gs), generator=gen, dtype=torch.uint8)
    else:
        zeros = (torch.randn(out_f, in_f // gs, generator=gen) * 4).half()
    layer = IntLinear(IntWeight(codes, scales, zeros, 4, gs), None, torch.float32)
    gemms = layer.cpu_gemms(torch.bfloat16)
    assert len(gemms) == 1 and isinstance(gemms[0], Int4CpuGemm)
    x = torch.randn(5, in_f, generator=gen).bfloat16()
    ref = x.float() @ _int_reference(codes, scales, zeros, gs).t()
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (5, out_f)
    assert _rel_err(y, ref) < 2e-2


def test_int8_layer_requantizes_per_channel_within_half_a_step():
    gen = torch.Generator().manual_seed(1)
    out_f, in_f, gs = 64, 256, 128
    codes = torch.randint(0, 256, (out_f, in_f), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out_f, in_f // gs, generator=gen) * 0.001 + 1e-4).half()
    zeros = torch.randint(100, 156, (out_f, in_f // gs), generator=gen, dtype=torch.uint8)
    layer = IntLinear(IntWeight(codes, scales, zeros, 8, gs), None, torch.float32)
    (gemm,) = layer.cpu_gemms(torch.bfloat16)
    assert isinstance(gemm, Int8CpuGemm)
    w = _int_reference(codes, scales, zeros, gs)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    w_int8 = gemm.qweight.float() * gemm.scales.float()[:, None]
    assert ((w_int8 - w).abs() <= step * 0.5 * 1.01 + 1e-6).all()
    x = torch.randn(3, in_f, generator=gen).bfloat16()
    assert _rel_err(layer(x), x.float() @ w.t()) < 3e-2


def test_fp32_activations_keep_the_slab_path():
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    scales = torch.full((32, 2), 0.01).half()
    zeros = torch.full((32, 2), 8, dtype=torch.uint8)
    layer = IntLinear(IntWeight(codes, scales, zeros, 4, 32), None, torch.float32)
    x = torch.randn(2, 64, generator=gen)
    ref = x @ _int_reference(codes, scales, zeros, 32).t()
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-5)
    assert "_cpu_gemms" not in layer.__dict__  # never built for fp32


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1])
def test_q4_blocks_as_int4_reproduce_gguf_py(ggml_type):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    blocks = gguf.quants.quantize(w, ggml_type)
    ref = torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type).copy()).float()
    codes, scales, offsets = q4_blocks_as_int4(ggml_type, torch.from_numpy(blocks), 128)
    g = torch.arange(128) // 32
    mine = (codes.float() - 8) * scales[:, g] + offsets[:, g]
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)


def test_gguf_layer_mixes_int4_and_int8_segments():
    """A fused layer whose q/k/v segments are Q4_1 and Q8_0 runs int4 for the first and
    per-channel int8 for the second, and matches gguf-py's dequantized weight."""
    rng = np.random.default_rng(4)
    w1 = rng.standard_normal((48, 128)).astype(np.float32) * 0.05
    w2 = rng.standard_normal((32, 128)).astype(np.float32) * 0.05
    parts = [GGUFPackedWeight(T.Q4_1, torch.from_numpy(gguf.quants.quantize(w1, T.Q4_1)), 128),
             GGUFPackedWeight(T.Q8_0, torch.from_numpy(gguf.quants.quantize(w2, T.Q8_0)), 128)]
    layer = GGUFLinear(parts, None, torch.float32)
    kinds = [type(g) for g in layer.cpu_gemms(torch.bfloat16)]
    assert kinds == [Int4CpuGemm, Int8CpuGemm]
    ref_w = torch.cat([torch.from_numpy(gguf.quants.dequantize(p.data.numpy(), p.ggml_type)
                                        .copy()).float() for p in parts])
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert _rel_err(layer(x), x.float() @ ref_w.t()) < 3e-2


def test_int4_layout_limits():
    assert int4_layout_fits(960, 576, 32)
    assert not int4_layout_fits(960, 576, 128)  # 576 is not a multiple of 128
    assert not int4_layout_fits(100, 64, 32)  # rows not a multiple of 16
    assert not int4_layout_fits(64, 64, 16)  # group size the kernel does not take
    with pytest.raises(ValueError, match="group"):
        Int4CpuGemm(torch.zeros(100, 64, dtype=torch.uint8), torch.ones(100, 2),
                    torch.zeros(100, 2), 32)
