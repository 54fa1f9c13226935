"""The torch backend's prefills (fresh and over cached context) run torch's CPU flash-attention
kernel, never SDPA's math fallback that materializes ``[heads, L, L]`` scores, and equal a
hand-written causal GQA attention."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.engine.attention.base import AttentionInputs
from pdserve.engine.attention.torch_backend import TorchAttentionBackend

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


@pytest.mark.parametrize("cached", [0, 200], ids=["fresh", "with-cached-context"])
def test_prefill_uses_flash_kernel_and_matches_reference(cached):
    gen = torch.Generator().manual_seed(0)
    new = 300
    total = cached + new
    num_blocks = (total + BS - 1) // BS
    k_cache = torch.zeros(num_blocks, BS, HKV, D)
    v_cache = torch.zeros(num_blocks, BS, HKV, D)
    k_all = torch.randn(total, HKV, D, generator=gen)
    v_all = torch.randn(total, HKV, D, generator=gen)
    k_cache.view(-1, HKV, D)[:cached] = k_all[:cached]
    v_cache.view(-1, HKV, D)[:cached] = v_all[:cached]
    q = torch.randn(new, H, D, generator=gen)
    backend = TorchAttentionBackend(torch.device("cpu"))
    meta = backend.build_metadata(AttentionInputs(
        slot_mapping=torch.arange(cached, total), query_lens=[new], seq_lens=[total],
        block_tables=[list(range(num_blocks))], num_decodes=0, block_size=BS))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = backend.forward(q, k_all[cached:], v_all[cached:], k_cache, v_cache, meta,
                              D**-0.5)
    ops = {e.key for e in prof.key_averages()}
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
