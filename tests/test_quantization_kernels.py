"""Every quantized-weight format and kernel matches its dequantize-then-matmul reference.

CPU paths (slab dequantization in torch) and Triton kernels (under ``TRITON_INTERPRET=1``)
are checked on random weights. Tolerances: GGML block dequantization is exact against
``gguf.quants.dequantize``; packed int layouts round-trip exactly; fp32 GEMMs agree within
1e-4 relative; fp16 kernels within 2e-3 relative (fp16 rounding of the dequantized weight);
FP8 within one e4m3 step (2**-3 relative) of the weight.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # read by Triton when the kernels are first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pdserve.engine.quantization.fp8_linear import Fp8Linear  # noqa: E402
from pdserve.engine.quantization.gguf_blocks import BLOCK_DEQUANTIZERS, dequantize_rows  # noqa: E402
from pdserve.engine.quantization.gguf_linear import GGUFLinear, GGUFPackedWeight  # noqa: E402
from pdserve.engine.quantization.int_layouts import (  # noqa: E402
    pack_awq,
    pack_compressed_tensors,
    pack_gptq,
    unpack_awq,
    unpack_compressed_tensors,
    unpack_gptq,
)
from pdserve.engine.quantization.int_linear import IntLinear, pack_nibbles  # noqa: E402
from pdserve.engine.quantization.int_weight import IntWeight, quantize_rtn  # noqa: E402
from pdserve.engine.quantization.loading import is_skipped  # noqa: E402

T = gguf.GGMLQuantizationType


def _valid_random_blocks(ggml_type: T, num_rows: int, row_values: int,
                         rng: np.random.Generator) -> np.ndarray:
    """Random GGML blocks: quantized by gguf-py where it can, else random bytes with
    finite float16 super-scales (gguf-py has no Q4_K/Q6_K quantizer)."""
    _, values, nbytes = BLOCK_DEQUANTIZERS[ggml_type]
    try:
        w = rng.standard_normal((num_rows, row_values)).astype(np.float32)
        return gguf.quants.quantize(w, ggml_type)
    except NotImplementedError:
        blocks = rng.integers(0, 256, (num_rows * row_values // values, nbytes), dtype=np.uint8)
        f16_offsets = {T.Q4_K: (0, 2), T.Q6_K: (208,)}[ggml_type]
        for off in f16_offsets:
            d = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
            blocks[:, off:off + 2] = d[:, None].view(np.uint8)
        return blocks.reshape(num_rows, -1)


@pytest.mark.parametrize("ggml_type", list(BLOCK_DEQUANTIZERS), ids=lambda t: t.name)
def test_gguf_block_dequantizer_equals_gguf_py(ggml_type):
    packed = _valid_random_blocks(ggml_type, 8, 512, np.random.default_rng(0))
    expected = gguf.quants.dequantize(packed, ggml_type)
    got = dequantize_rows(ggml_type, torch.from_numpy(packed))
    assert torch.equal(got, torch.from_numpy(expected))


def test_gguf_linear_mixed_types_matches_dequantized_matmul():
    rng = np.random.default_rng(1)
    q = _valid_random_blocks(T.Q4_K, 48, 256, rng)
    v = _valid_random_blocks(T.Q6_K, 16, 256, rng)
    parts = [GGUFPackedWeight(T.Q4_K, torch.from_numpy(q), 256),
             GGUFPackedWeight(T.Q6_K, torch.from_numpy(v), 256)]
    layer = GGUFLinear(parts, None, torch.float32, max_scratch_elems=256 * 20)  # 3+ slabs
    w = torch.cat([torch.from_numpy(gguf.quants.dequantize(p, t))
                   for p, t in ((q, T.Q4_K), (v, T.Q6_K))])
    x = torch.randn(5, 256)
    torch.testing.assert_close(layer(x), x @ w.t(), rtol=1e-4, atol=1e-4)
    assert layer.packed_bytes() == q.nbytes + v.nbytes


@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, 48), (8, 32), (4, -1)])
def test_int_linear_matches_reference_and_bounds_scratch(bits, group_size):
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    iw = quantize_rtn(w, bits, group_size)
    layer = IntLinear(iw, torch.randn(40), torch.float32, max_scratch_elems=96 * 16)
    assert layer.max_rows_per_slab == 16
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), x @ iw.dequantize().t() + layer.bias,
                               rtol=1e-4, atol=1e-4)
    # RTN error is at most half a quantization step per weight
    gi = iw.group_index()
    assert ((iw.dequantize() - w).abs() <= iw.scales.float()[:, gi] / 2 + 1e-3).all()


def test_float_zero_points_reproduce_a_q4_1_grid_exactly():
    """The "min" form keeps each group's minimum: a Q4_1-style weight (``q * d + m`` per 32
    columns, every group using codes 0 and 15) comes back bit for bit; integer zero points
    move every group by up to half a step."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (24, 96), generator=g)
    q[:, ::32] = 0
    q[:, 1::32] = 15
    d = (torch.rand(24, 3, generator=g) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(24, 3, generator=g) * 0.07).half().float()
    w = (q.view(24, 3, 32) * d[..., None] + m[..., None]).view(24, 96)
    exact = quantize_rtn(w, 4, 32, float_zeros=True)
    assert exact.zeros.dtype == torch.float16
    err_float = (exact.dequantize() - w).abs().max().item()
    err_int = (quantize_rtn(w, 4, 32).dequantize() - w).abs().max().item()
    assert err_float <= 1e-3 * w.abs().max().item(), err_float  # fp16 rounding of s and z
    assert err_int > 10 * err_float
    layer = IntLinear(exact, None, torch.float32)
    assert layer.zeros.dtype == torch.float16
    x = torch.randn(4, 96)
    torch.testing.assert_close(layer(x), x @ exact.dequantize().t(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="integer zero points"):
        from pdserve.engine.quantization.int_layouts import pack_gptq
        pack_gptq(exact)


def _random_int_weight(out_features, in_features, bits, group_size, act_order=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_groups = -(-in_features // group_size)
    g_idx = None
    if act_order:  # GPTQ desc_act: groups assigned in a permuted column order
        perm = torch.randperm(in_features, generator=g)
        g_idx = (torch.arange(in_features) // group_size)[perm.argsort()].to(torch.int32)
    return IntWeight(
        codes=torch.randint(0, 2**bits, (out_features, in_features), generator=g,
                            dtype=torch.uint8),
        scales=(torch.rand(out_features, num_groups, generator=g) * 0.02 + 1e-3).half(),
        zeros=torch.randint(1, 2**bits, (out_features, num_groups), generator=g,
                            dtype=torch.uint8),
        bits=bits, group_size=group_size, g_idx=g_idx)


def _assert_same_weight(a: IntWeight, b: IntWeight):
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.zeros, b.zeros)
    assert torch.equal(a.scales, b.scales)
    assert torch.equal(a.dequantize(), b.dequantize())


def test_awq_layout_round_trip_and_nibble_order():
    w = _random_int_weight(24, 64, 4, 32)
    packed = pack_awq(w)
    assert packed["qweight"].shape == (64, 3) and packed["qweight"].dtype == torch.int32
    assert packed["qzeros"].shape == (2, 3) and packed["scales"].shape == (2, 24)
    # AutoAWQ order: physical nibble 1 of the first word holds logical output column 2
    assert int(packed["qweight"][0, 0] >> 4 & 0xF) == int(w.codes[2, 0])
    _assert_same_weight(unpack_awq(packed["qweight"], packed["qzeros"], packed["scales"], 32), w)


@pytest.mark.parametrize("bits,act_order", [(4, False), (4, True), (8, False)])
def test_gptq_layout_round_trip(bits, act_order):
    w = _random_int_weight(16, 64, bits, 16, act_order=act_order)
    packed = pack_gptq(w)  # v1: stores zero - 1
    assert packed["qweight"].shape == (64 * bits // 32, 16)
    first_zero = int(packed["qzeros"][0, 0] & (2**bits - 1))
    assert first_zero == int(w.zeros[0, 0]) - 1
    got = unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"],
                      bits, 16)
    assert (got.g_idx is not None) == act_order
    _assert_same_weight(got, w)
    layer = IntLinear(got, None, torch.float32)
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), x @ w.dequantize().t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_tensors_layout_round_trip(bits):
    w = _random_int_weight(16, 64, bits, 32)
    packed = pack_compressed_tensors(w)
    assert packed["weight_packed"].shape == (16, 64 * bits // 32)
    assert packed["weight_zero_point"].shape == (16 * bits // 32, 2)
    # codes are stored as signed + 2**(bits-1), i.e. the unsigned code itself, low bits first
    assert int(packed["weight_packed"][0, 0] & (2**bits - 1)) == int(w.codes[0, 0])
    _assert_same_weight(unpack_compressed_tensors(packed, bits, 32), w)


def test_fp8_linear_within_one_e4m3_step():
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    layer = Fp8Linear(w, None, torch.float32)
    deq = layer.dequantize()
    step = 2.0**-3 * w.abs()  # e4m3 has 3 mantissa bits
    assert ((deq - w).abs() <= step / 2 + layer.weight_scale[:, None] * 2**-9).all()
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), x @ deq.t(), rtol=1e-4, atol=1e-4)
    assert layer.packed_bytes() == 32 * 64 + 32 * 4


def test_skip_patterns_match_dotted_components():
    assert is_skipped("lm_head", ("lm_head",))
    assert is_skipped("model.layers.0.mlp.down_proj", ("layers.0",))
    assert not is_skipped("model.layers.10.mlp.down_proj", ("layers.0",))
    assert is_skipped("model.layers.3.self_attn.qkv_proj", ("layers.3.self_attn.k_proj",))
    assert not is_skipped("model.layers.3.self_attn.o_proj", ("q_proj",))


triton = pytest.importorskip("triton")


@pytest.mark.parametrize("float_zeros", [False, True], ids=["int_zeros", "float_zeros"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w4a16_triton_kernel_matches_reference(dtype, float_zeros):
    from pdserve.engine.quantization.kernels.w4a16 import w4a16_linear, w4a16_reference

    torch.manual_seed(0)
    # K not a multiple of the group: ragged
    iw = quantize_rtn(torch.randn(80, 200), 4, 64, float_zeros=float_zeros)
    args = (pack_nibbles(iw.codes), iw.scales, iw.zeros, 64)
    x = torch.randn(5, 200).to(dtype)
    y, ref = w4a16_linear(x, *args), w4a16_reference(x, *args)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max())


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("num_tokens", [1, 7])  # GEMV (decode) and GEMM
def test_gguf_triton_kernel_matches_reference(ggml_type, num_tokens):
    from pdserve.engine.quantization.kernels.gguf_gemm import gguf_linear, gguf_linear_reference

    packed = torch.from_numpy(_valid_random_blocks(ggml_type, 72, 128,
                                                   np.random.default_rng(2)))
    x = torch.randn(num_tokens, 128)
    y, ref = gguf_linear(x, packed, ggml_type), gguf_linear_reference(x, packed, ggml_type)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max())
