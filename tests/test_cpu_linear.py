"""``cpu_linear`` (row-padded ``(W @ x^T)^T``) against ``F.linear``, and the layer using it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kernels.cpu_gemv import (
    MAX_GEMV_ROWS,
    Bf16GemvLinear,
    bf16_gemv,
    bf16_gemv_module,
    swap_to_bf16_gemv,
)
from pdserve.engine.layers.linear import (
    MAX_BF16_GEMV_ROWS,
    MAX_PADDED_ROWS,
    PADDED_ROWS,
    Fp32GemmLinear,
    cpu_linear,
    wants_fp32_gemm,
)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 9, 15, 17, 33, 80, 81, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 64, generator=g)
    y = cpu_linear(x, w, b)
    assert y.shape == (rows, 96) and y.is_contiguous() and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_padding_rows_leave_real_rows_alone():
    # 7 rows pad to 8: the 7 real rows must be what 8 real rows give for those rows when
    # the eighth is zero (the padded GEMM is that GEMM), and exactly so.
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 32, generator=g), torch.randn(7, 32, generator=g)
    padded = torch.cat([x, torch.zeros(1, 32)])
    assert torch.equal(cpu_linear(x, w), torch.mm(w, padded.t()).t()[:7])


def test_table_is_sorted_and_other_shapes_fall_back():
    assert list(PADDED_ROWS) == sorted(set(PADDED_ROWS)) and MAX_PADDED_ROWS == PADDED_ROWS[-1]
    w = torch.randn(8, 4)
    x3 = torch.randn(2, 3, 4)
    torch.testing.assert_close(cpu_linear(x3, w), F.linear(x3, w))


def test_fp32_gemm_layer_bf16_and_fp32():
    lin = nn.Linear(64, 48, bias=True)
    layer = Fp32GemmLinear(lin)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), lin(x), rtol=1e-5, atol=1e-5)
    # an fp32 model's layer shares the weight's storage (no second copy)
    assert layer.weight.data_ptr() == lin.weight.data_ptr()
    xb = x.bfloat16()
    out = layer(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(xb.float(), lin.weight, lin.bias),
                               rtol=1e-2, atol=1e-2)


def test_wants_fp32_gemm():
    cpu = torch.device("cpu")
    assert wants_fp32_gemm(cpu, torch.float32)
    assert not wants_fp32_gemm(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_bf16_layer_rows_match_a_bf16_gemm_with_fp32_accumulation(rows):
    """1-2 bf16 rows take the bf16 GEMV, more take the fp32 GEMM: both equal the product of
    the bf16-rounded weight with fp32 accumulation, rounded to bf16 (one bf16 step)."""
    gen = torch.Generator().manual_seed(rows)
    lin = nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 256, generator=gen).bfloat16().float())
        lin.bias.copy_(torch.randn(96, generator=gen).bfloat16().float())
    layer = Fp32GemmLinear(lin)
    x = torch.randn(rows, 256, generator=gen).bfloat16()
    ref = (x.double() @ lin.weight.double().t() + lin.bias.double()).float()
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-2)
    max_rows = MAX_GEMV_ROWS if bf16_gemv_module() is not None else MAX_BF16_GEMV_ROWS
    assert ("_weight_bf16" in layer.__dict__) == (rows <= max_rows)


needs_kernel = pytest.mark.skipif(bf16_gemv_module() is None,
                                  reason="no AVX2/FMA or no C++ toolchain: F.linear is used")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("out_features,in_features", [(96, 256), (1000, 77), (7, 33), (4, 8)])
def test_avx2_bf16_gemv_equals_fp32_accumulation(rows, out_features, in_features):
    """The C++ kernel (pdserve.engine.kernels.cpu_gemv): the bf16 weight times fp32 rows,
    fp32 accumulation, for K a multiple of its 32-wide loop and not (the scalar tail)."""
    gen = torch.Generator().manual_seed(out_features + in_features + rows)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen)
    ref = (x.double() @ w.double().t()).float()
    out = bf16_gemv(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 * in_features ** 0.5)
    # rows are independent and summed in one order: each row of a multi-row call is, bit
    # for bit, the 1-row call on it (plain decoding = speculative verification)
    for r in range(rows):
        torch.testing.assert_close(bf16_gemv(x[r:r + 1], w), out[r:r + 1], rtol=0, atol=0)


@needs_kernel
def test_avx2_bf16_gemv_refuses_what_it_does_not_compute():
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="x must be"):
        bf16_gemv_module().gemv(w, torch.randn(9, 16))  # 9 rows
    with pytest.raises(RuntimeError, match="w must be"):
        bf16_gemv_module().gemv(w.float(), torch.randn(1, 16))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, MAX_GEMV_ROWS, MAX_GEMV_ROWS + 1, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemv_layer_is_a_bf16_gemm_with_fp32_accumulation(rows, with_bias):
    """Bf16GemvLinear (the EAGLE head's layers on a CPU with native bf16): the kernel for
    decode-sized inputs, F.linear above; both a bf16 GEMM with fp32 accumulation, and the
    layer holds the replaced layer's own tensors."""
    torch.manual_seed(rows)
    lin = nn.Linear(96, 40, bias=with_bias).bfloat16()
    layer = Bf16GemvLinear(lin)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    x = torch.randn(rows, 96).bfloat16()
    out = layer(x)
    ref = x.double() @ lin.weight.double().t()
    if with_bias:
        ref = ref + lin.bias.double()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    if rows <= MAX_GEMV_ROWS:  # the kernel's value, rounded once
        expect = bf16_gemv_module().gemv(lin.weight.detach(), x.float())
        if with_bias:
            expect = expect + lin.bias.float()
        torch.testing.assert_close(out, expect.bfloat16(), rtol=0, atol=0)
    else:
        torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)


@needs_kernel
def test_swap_to_bf16_gemv_replaces_only_bf16_linear_layers():
    model = nn.Sequential(nn.Linear(8, 8).bfloat16(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Sequential(nn.Linear(8, 4, bias=False).bfloat16()))
    assert swap_to_bf16_gemv(model) == 2
    assert isinstance(model[0], Bf16GemvLinear) and isinstance(model[3][0], Bf16GemvLinear)
    assert type(model[1]) is nn.Linear  # fp32 stays
    assert swap_to_bf16_gemv(model) == 0  # already swapped
