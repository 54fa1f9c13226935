"""The torch backend's prefills (fresh and over cached context) run torch's CPU flash-attention
kernel or pdserve's C++ kernels, never SDPA's math fallback that materializes ``[heads, L, L]``
scores, and equal a hand-written causal GQA attention."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.engine.attention.base import AttentionInputs
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.kernels.cpu_decode import cpu_decode_module
from pdserve.engine.kernels.cpu_prefill_attention import (
    use_cpu_prefill_attention,
    use_f32_prefill_attention,
)

H, HKV, D, BS = 6, 2, 32, 16


def _reference(q, k, v, q_start: int) -> torch.Tensor:
    """Causal GQA: query row i (position q_start + i) attends keys 0..q_start + i."""
    group = H // HKV
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * D**-0.5
    qpos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())


def _prefill(cached: int, seed: int, dtype: torch.dtype):
    """300 new tokens after ``cached`` positions through the backend, profiled: (output,
    profile, q, all keys, all values)."""
    gen = torch.Generator().manual_seed(seed)
    new, total = 300, cached + 300
    num_blocks = (total + BS - 1) // BS
    k_all = torch.randn(total, HKV, D, generator=gen).to(dtype)
    v_all = torch.randn(total, HKV, D, generator=gen).to(dtype)
    k_cache = torch.zeros(num_blocks, BS, HKV, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, HKV, D)[:cached] = k_all[:cached]
    v_cache.view(-1, HKV, D)[:cached] = v_all[:cached]
    q = torch.randn(new, H, D, generator=gen).to(dtype)
    backend = TorchAttentionBackend(torch.device("cpu"))
    meta = backend.build_metadata(AttentionInputs(
        slot_mapping=torch.arange(cached, total), query_lens=[new], seq_lens=[total],
        block_tables=[list(range(num_blocks))], num_decodes=0, block_size=BS))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = backend.forward(q, k_all[cached:], v_all[cached:], k_cache, v_cache, meta,
                              D**-0.5)
    return out, prof, q, k_all, v_all


@pytest.mark.parametrize("cached", [0, 200], ids=["fresh", "with-cached-context"])
def test_prefill_uses_flash_kernel_and_matches_reference(cached):
    """fp32: the AVX2 kernel where the CPU has no AVX512-BF16 (no SDPA at all), else
    torch's flash kernel."""
    out, prof, q, k_all, v_all = _prefill(cached, 0, torch.float32)
    ops = {e.key for e in prof.key_averages()}
    if use_f32_prefill_attention():
        assert not any("scaled_dot_product" in op for op in ops)
    else:
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
    torch.testing.assert_close(out, _reference(q, k_all, v_all, cached), rtol=1e-4, atol=1e-4)


def test_decodes_of_very_different_lengths_are_grouped_and_exact():
    """Decodes over 20, 30 and 700 cached tokens: attended in length groups (the short ones
    are not padded to 700), each equal to its own causal attention over its context."""
    gen = torch.Generator().manual_seed(1)
    lens = [20, 700, 30]
    blocks_per = [(n + BS - 1) // BS for n in lens]
    tables, first = [], 0
    for b in blocks_per:
        tables.append(list(range(first, first + b)))
        first += b
    k_cache = torch.randn(first, BS, HKV, D, generator=gen)
    v_cache = torch.randn(first, BS, HKV, D, generator=gen)
    q = torch.randn(len(lens), H, D, generator=gen)
    k_new = torch.randn(len(lens), HKV, D, generator=gen)
    v_new = torch.randn(len(lens), HKV, D, generator=gen)
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens)])
    backend = TorchAttentionBackend(torch.device("cpu"))
    meta = backend.build_metadata(AttentionInputs(
        slot_mapping=slots, query_lens=[1, 1, 1], seq_lens=lens, block_tables=tables,
        num_decodes=3, block_size=BS))
    assert max(g.slots.shape[1] for g in meta.decode_groups if g.rows is None
               or 0 in g.rows.tolist()) < 700  # the 20-token decode is not padded to 700
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta, D**-0.5)
    for i, (t, n) in enumerate(zip(tables, lens)):
        ctx = torch.tensor(t).repeat_interleave(BS) * BS + torch.arange(BS).repeat(len(t))
        k_ctx = k_cache.view(-1, HKV, D)[ctx[:n]]
        v_ctx = v_cache.view(-1, HKV, D)[ctx[:n]]
        ref = _reference(q[i:i + 1], k_ctx, v_ctx, n - 1)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-4, atol=1e-4)


needs_prefill_kernel = pytest.mark.skipif(
    not use_cpu_prefill_attention(),
    reason="no AVX512-BF16 (or AMX: torch's kernel), or no C++ toolchain")


@needs_prefill_kernel
@pytest.mark.parametrize("cached", [0, 200], ids=["fresh", "with-cached-context"])
def test_bf16_prefill_takes_the_cpu_kernel_and_matches_reference(cached):
    """In bf16 on a CPU with AVX512-BF16 the backend's prefills are the C++ kernel's (no
    SDPA at all), within bf16 rounding of the fp32 reference."""
    out, prof, q, k_all, v_all = _prefill(cached, 2, torch.bfloat16)
    assert not any("scaled_dot_product" in e.key for e in prof.key_averages())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q, k_all, v_all, cached),
                               rtol=0, atol=2e-2)


@needs_prefill_kernel
@pytest.mark.parametrize("n,ctx,heads,kv_heads,dim", [
    (1, 0, 9, 3, 64), (5, 0, 9, 3, 64), (37, 0, 9, 3, 64), (100, 70, 9, 3, 64),
    (130, 3, 6, 2, 64), (200, 0, 8, 2, 128), (33, 17, 4, 4, 32), (700, 1300, 9, 3, 64)])
def test_cpu_prefill_kernel_shapes(n, ctx, heads, kv_heads, dim):
    """Query tails (not a multiple of 16 tokens or of 4 rows), key tails (not a multiple of
    64), grouped and plain heads, every head size, strided (non-contiguous) token rows."""
    from pdserve.engine.kernels.cpu_prefill_attention import prefill_attention

    gen = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(n, heads + 1, dim, generator=gen).bfloat16()[:, :heads]  # strided
    k = torch.randn(ctx + n, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(ctx + n, kv_heads, dim, generator=gen).bfloat16()
    out = prefill_attention(q, k, v, ctx, dim**-0.5)
    group = heads // kv_heads
    kr, vr = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kr) * dim**-0.5
    mask = torch.arange(ctx + n)[None, :] > (ctx + torch.arange(n))[:, None]
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, -torch.inf).softmax(-1), vr)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2)


@needs_prefill_kernel
def test_cpu_prefill_kernel_rejects_what_it_does_not_take():
    from pdserve.engine.kernels.cpu_prefill_attention import prefill_attention

    q = k = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16"):
        prefill_attention(q.float(), k, k, 0, 1.0)
    with pytest.raises(RuntimeError, match="shapes"):
        prefill_attention(q, k, k, 1, 1.0)
    with pytest.raises(RuntimeError, match="head_dim"):
        prefill_attention(q[..., :48], k[..., :48], k[..., :48], 0, 1.0)


needs_f32_kernel = pytest.mark.skipif(
    cpu_decode_module("avx2") is None, reason="no AVX2/FMA/F16C, or no C++ toolchain")


@needs_f32_kernel
@pytest.mark.parametrize("n,ctx,heads,kv_heads,dim", [
    (1, 0, 9, 3, 64), (2, 1, 9, 3, 64), (5, 0, 9, 3, 64), (37, 0, 9, 3, 64),
    (100, 70, 9, 3, 64), (130, 3, 6, 2, 64), (200, 0, 8, 2, 128), (33, 17, 4, 4, 32),
    (25, 0, 7, 1, 64), (700, 1300, 9, 3, 64)])
def test_f32_prefill_kernel_shapes(n, ctx, heads, kv_heads, dim):
    """The AVX2 fp32 kernel (built on any CPU with AVX2/FMA/F16C, whichever build serves):
    items of 24 rows cut across tokens and padded (groups of 1, 2, 3, 4 and 7 heads), key
    tails (fewer than 4 keys in all, not a multiple of 64 or 4), every head size, strided
    token rows; within fp32 rounding of float64 attention."""
    module = cpu_decode_module("avx2")
    gen = torch.Generator().manual_seed(n + ctx)
    q = (2 * torch.randn(n, heads + 1, dim, generator=gen))[:, :heads]  # strided rows
    k = 2 * torch.randn(ctx + n, kv_heads, dim, generator=gen)
    v = torch.randn(ctx + n, kv_heads, dim, generator=gen)
    out = module.prefill_attention_f32(q, k, v, ctx, dim**-0.5)
    group = heads // kv_heads
    kr, vr = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kr) * dim**-0.5
    mask = torch.arange(ctx + n)[None, :] > (ctx + torch.arange(n))[:, None]
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, -torch.inf).softmax(-1), vr)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=5e-5)


@needs_f32_kernel
def test_f32_prefill_kernel_rejects_what_it_does_not_take():
    module = cpu_decode_module("avx2")
    q = k = torch.zeros(4, 2, 64)
    with pytest.raises(RuntimeError, match="fp32"):
        module.prefill_attention_f32(q.bfloat16(), k, k, 0, 1.0)
    with pytest.raises(RuntimeError, match="shapes"):
        module.prefill_attention_f32(q, k, k, 1, 1.0)
    with pytest.raises(RuntimeError, match="head_dim"):
        module.prefill_attention_f32(q[..., :48], k[..., :48], k[..., :48], 0, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        module.prefill_attention_f32(q[:, :, ::2], k[:, :, ::2], k[:, :, ::2], 0, 1.0)
