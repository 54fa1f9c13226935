"""The one-pass FP8 C kernels (pdserve/fp8_cpu.c) give the torch reference path's bits:
codes, scales and dequantized values, for every KV dtype, odd head sizes (scalar tails),
subnormal and tie cases; and the fused gather/scatter equals index_select / index_copy_."""

from __future__ import annotations

import pytest
import torch

from pdserve.fp8 import (
    dequantize_blocks, dequantize_into_cache, quantize_blocks, quantize_cache_blocks)
from pdserve.fp8_cpu import fp8_kernels

pytestmark = pytest.mark.skipif(fp8_kernels() is None,
                                reason="FP8 CPU kernels unavailable (no AVX2/F16C or no cc)")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _kv(shape, dtype, seed):
    """Random KV with per-block magnitudes over 10 decades, exact zeros, a zero block and
    values on e4m3 rounding ties (half-way between two codes after scaling)."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-6, 4, shape[2]).view(1, 1, -1, 1, 1, 1)
    kv = torch.randn(shape, generator=g) * mags
    kv[..., 0, :, :, :] = 0.0  # block 0: all zeros -> scale 1.0
    kv.view(-1)[::7] = 0.0
    # ties: 448 * (1 + 1/16) / 448-scaled values land exactly between e4m3 neighbours
    kv[..., 1, 0, 0, :4] = torch.tensor([448.0, 17.0, 9.0, 0.0068359375])
    return kv.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40, 5])
def test_quantize_matches_the_torch_reference_bit_for_bit(dtype, head_dim):
    kv = _kv((2, 2, 9, 16, 3, head_dim), dtype, seed=head_dim)
    codes, scales = quantize_blocks(kv)
    ref_codes, ref_scales = quantize_blocks(kv, use_kernels=False)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))


def test_quantize_matches_on_every_subnormal_and_normal_magnitude():
    """Values spanning all e4m3 exponents (after scaling) in tiny steps, both signs."""
    y = torch.linspace(-448.0, 448.0, 16 * 3 * 64 * 40)
    kv = y.view(1, 2, 20, 16, 3, 64).clone()
    kv[0, 0, :, 0, :, 0] = 448.0  # pin each block's absmax so the scale is exactly 1
    kv[0, 1, :, 0, :, 0] = -448.0
    codes, scales = quantize_blocks(kv)
    ref_codes, _ = quantize_blocks(kv, use_kernels=False)
    assert bool((scales == 1.0).all())
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 5])
def test_dequantize_matches_the_torch_reference_bit_for_bit(dtype, head_dim):
    kv = _kv((2, 2, 9, 16, 3, head_dim), torch.float32, seed=3)
    codes, scales = quantize_blocks(kv)
    every_code = torch.arange(256, dtype=torch.uint8).repeat(head_dim)[: 16 * 3 * head_dim]
    codes.view(torch.uint8)[0, 0, 2].view(-1).copy_(every_code)  # NaN codes included
    out = dequantize_blocks(codes, scales, dtype)
    ref = dequantize_blocks(codes, scales, dtype, use_kernels=False)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


def test_quantize_raises_on_non_finite_values():
    kv = torch.randn(1, 2, 2, 16, 3, 64)
    kv[0, 1, 1, 3, 2, 7] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_blocks(kv)
    kv[0, 1, 1, 3, 2, 7] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_blocks(kv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_gather_equals_index_select_then_quantize(dtype):
    cache = _kv((4, 2, 12, 16, 3, 64), dtype, seed=5)
    ids = torch.tensor([7, 2, 11, 0, 5])
    codes, scales = quantize_cache_blocks(cache, ids, 1, 3)
    ref_codes, ref_scales = quantize_blocks(cache[1:3].index_select(2, ids), use_kernels=False)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scales, ref_scales)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_scatter_writes_only_the_given_blocks_and_layers(dtype):
    kv = _kv((2, 2, 3, 16, 3, 64), torch.float32, seed=6)
    codes, scales = quantize_blocks(kv)
    cache = torch.full((4, 2, 8, 16, 3, 64), 7.0, dtype=dtype)
    expected = cache.clone()
    expected[1:3].index_copy_(2, torch.tensor([6, 1, 3]),
                              dequantize_blocks(codes, scales, dtype, use_kernels=False))
    dequantize_into_cache(codes, scales, cache, torch.tensor([6, 1, 3]), layer_start=1)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_fused_paths_refuse_blocks_outside_the_cache():
    cache = torch.zeros(2, 2, 4, 16, 3, 64)
    with pytest.raises(ValueError, match="block_ids"):
        quantize_cache_blocks(cache, torch.tensor([1, 4]), 0, 2)
    codes, scales = quantize_blocks(torch.randn(1, 2, 2, 16, 3, 64))
    with pytest.raises(ValueError, match="layers"):
        dequantize_into_cache(codes, scales, cache, torch.tensor([0, 1]), layer_start=2)
