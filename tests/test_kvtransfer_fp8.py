"""FP8 e4m3 block quantization: rounding, scales and the documented error bound."""

from __future__ import annotations

import pytest
import torch

from pdserve.fp8 import (
    FP8_E4M3_MAX, dequantize_blocks, fp8_e4m3_values, fp8_error_bound, quantize_blocks)

SHAPE = (2, 2, 5, 16, 3, 64)  # [num_layers, 2, num_blocks, block_size, H, D]


def _round_trip(kv: torch.Tensor, dtype: torch.dtype):
    payload, scales = quantize_blocks(kv)
    return payload, scales, dequantize_blocks(payload, scales, dtype)


def _assert_within_bound(kv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    _, scales, kv_hat = _round_trip(kv, out_dtype)
    err = (kv.double() - kv_hat.double()).abs()
    bound = fp8_error_bound(kv, scales, out_dtype)
    worst = (err - bound).max()
    assert bool((err <= bound).all()), f"error exceeds the bound by {worst.item():.3g}"
    return err


def test_scales_are_block_head_absmax_over_448():
    torch.manual_seed(0)
    kv = torch.randn(SHAPE) * 3
    payload, scales = quantize_blocks(kv)
    assert payload.dtype == torch.float8_e4m3fn and payload.shape == kv.shape
    assert scales.dtype == torch.float32 and scales.shape == (2, 2, 5, 3)
    absmax = kv.abs().permute(0, 1, 2, 4, 3, 5).reshape(2, 2, 5, 3, -1).max(dim=-1).values
    torch.testing.assert_close(scales, absmax / 448, rtol=0, atol=0)
    # The largest element of every (block, head) lands on +-448 exactly.
    codes = payload.float().abs().permute(0, 1, 2, 4, 3, 5).reshape(2, 2, 5, 3, -1)
    assert bool((codes.max(dim=-1).values == FP8_E4M3_MAX).all())


def test_rounding_is_to_a_nearest_e4m3_value():
    # Reference: distance to the nearest of the 254 finite e4m3 values, found by brute force.
    torch.manual_seed(1)
    kv = torch.randn(1, 2, 3, 16, 2, 8) * torch.logspace(-4, 2, 8)
    payload, scales = quantize_blocks(kv)
    y = (kv / scales[:, :, :, None, :, None]).double().flatten()
    values = fp8_e4m3_values().double()
    finite = values[torch.isfinite(values)]
    nearest_dist = (y[:, None] - finite[None, :]).abs().min(dim=1).values
    got_dist = (y - payload.double().flatten()).abs()
    assert bool(torch.isclose(got_dist, nearest_dist, rtol=0, atol=1e-12).all())


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_within_bound_on_random_blocks(in_dtype, out_dtype):
    torch.manual_seed(2)
    # Per-block magnitudes from 1e-3 to 1e2, like real K/V with a few loud heads.
    mags = torch.logspace(-3, 2, SHAPE[2]).view(1, 1, -1, 1, 1, 1)
    kv = (torch.randn(SHAPE) * mags).to(in_dtype)
    _assert_within_bound(kv, out_dtype)


def test_bound_is_nearly_tight_in_the_normal_range():
    # Uniform mantissas make some elements land near a rounding midpoint: the worst
    # relative error must approach 2^-4 (the bound is not vacuous).
    torch.manual_seed(3)
    kv = torch.rand(SHAPE) + 0.5
    _, _, kv_hat = _round_trip(kv, torch.float32)
    rel = ((kv - kv_hat).abs() / kv).max().item()
    assert 0.9 * 2 ** -4 < rel <= 2 ** -4 + 2 ** -19


def test_per_block_error_at_most_absmax_times_2_pow_minus_4_plus_slack():
    torch.manual_seed(4)
    kv = torch.randn(SHAPE, dtype=torch.bfloat16) * 7
    _, scales, kv_hat = _round_trip(kv, torch.bfloat16)
    err = (kv.double() - kv_hat.double()).abs()
    per_block = err.permute(0, 1, 2, 4, 3, 5).reshape(2, 2, 5, 3, -1).max(dim=-1).values
    absmax = scales.double() * 448
    eta = 2 ** -9 + 2 ** -20  # bf16 unit roundoff + slack for fp32 steps
    assert bool((per_block <= absmax * (2 ** -4 + 2 * eta + 2 ** -9 / 448)).all())


def test_all_zero_blocks_round_trip_exactly_with_unit_scale():
    kv = torch.randn(SHAPE)
    kv[0, 1, 2] = 0.0  # one whole block, all heads
    kv[1, 0, :, :, 1] = 0.0  # one head in every block of a layer
    payload, scales, kv_hat = _round_trip(kv, torch.float32)
    assert scales[0, 1, 2].tolist() == [1.0, 1.0, 1.0]
    assert bool((scales[1, 0, :, 1] == 1.0).all())
    assert not bool(torch.isnan(payload.float()).any())
    assert bool((kv_hat[0, 1, 2] == 0).all()) and bool((kv_hat[1, 0, :, :, 1] == 0).all())
    _assert_within_bound(kv, torch.float32)


def test_one_huge_outlier_keeps_the_absolute_bound():
    torch.manual_seed(5)
    kv = torch.randn(SHAPE) * 1e-3
    kv[0, 0, 0, 3, 1, 7] = 1e4  # small neighbours fall into e4m3's subnormal range
    err = _assert_within_bound(kv, torch.bfloat16)
    # Its block's small values are lost to the absolute 2^-9 * s term, not to NaN/inf.
    assert bool(torch.isfinite(err).all())
    neighbours = err[0, 0, 0, :, 1].clone()  # [block_size, D]
    neighbours[3, 7] = 0.0
    assert neighbours.max().item() <= 2 ** -9 * 1e4 / 448


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_subnormal_range_values(dtype):
    torch.manual_seed(6)
    kv = torch.randn(SHAPE)
    # Values at and below the fp8 normal threshold 2^-6 * s, and fp16 subnormal inputs.
    kv[0] *= 2 ** -6 / 448 * 3
    kv[1, 0] = torch.randint(-8, 9, kv[1, 0].shape) * 2 ** -9 * (1 / 448)
    kv[1, 1] *= 1e-6
    _assert_within_bound(kv.to(dtype), dtype)


def test_exact_representable_values_survive_unchanged():
    # x = s * (an e4m3 value) with s a power of two: quantization is exact.
    values = fp8_e4m3_values()
    finite = values[torch.isfinite(values)]
    kv = finite[torch.randint(0, finite.numel(), SHAPE)] * 2.0 ** -5
    kv[..., 0] = 448 * 2.0 ** -5  # pin every (block, head) absmax so s = 2^-5 exactly
    _, scales, kv_hat = _round_trip(kv, torch.float32)
    assert bool((scales == 2.0 ** -5).all())
    assert torch.equal(kv_hat, kv)


def test_normal_range_elements_have_a_purely_relative_bound():
    torch.manual_seed(9)
    kv = torch.randn(SHAPE, dtype=torch.bfloat16) * 3
    _, scales, kv_hat = _round_trip(kv, torch.bfloat16)
    s = scales.double()[:, :, :, None, :, None]
    x = kv.double()
    normal = x.abs() >= 2 ** -6 * s
    eta = 2 ** -9 + 2 ** -20
    err = (x - kv_hat.double()).abs()
    assert bool((err[normal] <= (2 ** -4 + 2 * eta) * x.abs()[normal]).all())


def test_blocks_too_tiny_for_a_normal_scale_become_zeros():
    kv = torch.randn(SHAPE)
    kv[0, 0, 0, :, 0] = torch.randn(16, 64) * 1e-37  # absmax < 448 * 2^-126
    payload, scales, kv_hat = _round_trip(kv, torch.float32)
    assert scales[0, 0, 0, 0].item() == 1.0
    assert bool((payload[0, 0, 0, :, 0].float() == 0).all())
    assert not bool(torch.isnan(kv_hat).any())
    _assert_within_bound(kv, torch.float32)


def test_non_finite_input_raises():
    kv = torch.randn(SHAPE)
    kv[1, 1, 1, 1, 1, 1] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_blocks(kv)
    kv[1, 1, 1, 1, 1, 1] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_blocks(kv)


def test_dequantize_accepts_uint8_payload_and_out_buffer():
    torch.manual_seed(7)
    kv = torch.randn(SHAPE, dtype=torch.bfloat16)
    payload, scales = quantize_blocks(kv)
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    got = dequantize_blocks(payload.view(torch.uint8), scales, torch.bfloat16, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, dequantize_blocks(payload, scales, torch.bfloat16))


def test_chunking_does_not_change_the_result(monkeypatch):
    import pdserve.fp8 as fp8

    torch.manual_seed(8)
    kv = torch.randn(3, 2, 7, 16, 3, 64, dtype=torch.bfloat16)
    payload, scales = quantize_blocks(kv)
    kv_hat = dequantize_blocks(payload, scales, torch.bfloat16)
    monkeypatch.setattr(fp8, "_CHUNK_ELEMS", 5000)  # one row per chunk, ragged tail
    payload2, scales2 = quantize_blocks(kv)
    assert torch.equal(payload.view(torch.uint8), payload2.view(torch.uint8))
    assert torch.equal(scales, scales2)
    assert torch.equal(kv_hat, dequantize_blocks(payload2, scales2, torch.bfloat16))


def test_rejects_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="kv: expected"):
        quantize_blocks(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="dtype"):
        quantize_blocks(torch.randn(SHAPE).to(torch.float64))
    payload, scales = quantize_blocks(torch.randn(SHAPE))
    with pytest.raises(ValueError, match="scales"):
        dequantize_blocks(payload, scales[:, :, :1], torch.float32)
