"""Every Triton kernel matches its torch reference (run under TRITON_INTERPRET=1 on CPU).

Shapes are tiny (the interpreter runs each program in Python) but cover several block sizes,
GQA ratios, context lengths that are not multiples of the block size, and prefix-cached
starts. Tolerances: max |a - b| / max |b| <= 1e-3 in fp32, 2e-2 in bf16; FP8 codes within
one FP8 step (the interpreter rounds float -> e4m3 through numpy, not torch).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import PAD_SLOT_ID
from pdserve.engine.kernels.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from pdserve.engine.kernels.kv_store import (
    store_kv,
    store_kv_reference,
    store_segments,
)
from pdserve.engine.kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from pdserve.engine.kernels.rmsnorm import rms_norm, rms_norm_reference
from pdserve.engine.kernels.rotary import apply_rotary_, apply_rotary_reference
from pdserve.fp8 import quantize_blocks

TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
FP8 = torch.float8_e4m3fn


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def fp8_steps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between two FP8 tensors, counted in representable e4m3 values."""
    def ordinal(x: torch.Tensor) -> torch.Tensor:
        bits = x.view(torch.uint8).to(torch.int32)
        mag = bits & 0x7F
        return torch.where(bits >= 0x80, -mag, mag)
    return int((ordinal(a) - ordinal(b)).abs().max())


def random_tables(num_reqs: int, seq_lens: list[int], block_size: int, num_blocks: int,
                  gen: torch.Generator) -> torch.Tensor:
    """``[num_reqs, max_blocks]`` int32 of distinct, shuffled block ids (unused entries 0)."""
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros((num_reqs, max(need)), dtype=torch.int32)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[used:used + n].to(torch.int32)
        used += n
    return table


def slots_for(table: torch.Tensor, query_lens: list[int], seq_lens: list[int],
              block_size: int) -> torch.Tensor:
    """``[num_tokens]`` int64 slots of each request's new tokens."""
    slots = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for p in range(s - q, s):
            slots.append(int(table[r, p // block_size]) * block_size + p % block_size)
    return torch.tensor(slots, dtype=torch.int64)


def filled_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, gen: torch.Generator):
    """Random K and V caches; for FP8, codes of random data with per-(block, head) scales."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if dtype != FP8:
        return (torch.randn(shape, generator=gen).to(dtype),
                torch.randn(shape, generator=gen).to(dtype), None, None)
    kv = torch.randn((1, 2, *shape), generator=gen) * torch.rand(
        (1, 2, num_blocks, 1, num_kv_heads, 1), generator=gen) * 4
    payload, scales = quantize_blocks(kv)
    return payload[0, 0], payload[0, 1], scales[0, 0], scales[0, 1]


# -- attention -----------------------------------------------------------------------------

ATTN_CASES = [  # (block_size, num_heads, num_kv_heads, head_dim)
    (16, 4, 4, 32),   # MHA
    (8, 4, 2, 16),    # GQA 2
    (5, 8, 2, 16),    # GQA 4, block size not a power of two
    (32, 4, 1, 32),   # MQA
]


def paged_setup(case, cache_dtype, seq_lens: list[int], seed: int):
    """``(q_dtype, generator, (k_cache, v_cache, k_scales, v_scales), table, seq_lens)``."""
    block_size, _, num_kv_heads, head_dim = case
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 40
    caches = filled_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, gen)
    table = random_tables(len(seq_lens), seq_lens, block_size, num_blocks, gen)
    q_dtype = torch.bfloat16 if cache_dtype == FP8 else cache_dtype
    return q_dtype, gen, caches, table, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("case", ATTN_CASES)
def test_decode_attention_matches_reference(case, cache_dtype):
    _, num_heads, _, head_dim = case
    seq_lens = [1, 13, 37, 0, 21]  # 0: a padded CUDA-graph row
    q_dtype, gen, (k_cache, v_cache, ks, vs), table, lens = paged_setup(
        case, cache_dtype, seq_lens, seed=0)
    q = torch.randn((len(seq_lens), num_heads, head_dim), generator=gen).to(q_dtype)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, k_cache, v_cache, table, lens, scale, ks, vs)
    want = paged_decode_attention_reference(q, k_cache, v_cache, table, lens, scale, ks, vs)
    assert rel_err(got, want) <= TOL[q_dtype]
    assert not got[3].any()  # padding rows stay zero


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("case", ATTN_CASES)
def test_prefill_attention_over_cached_prefix_matches_reference(case, cache_dtype):
    _, num_heads, _, head_dim = case
    query_lens = [7, 20, 3, 1]
    seq_lens = [7, 29, 19, 11]  # fresh, prefix 9, prefix 16 (block-aligned for 8/16), 10
    q_dtype, gen, (k_cache, v_cache, ks, vs), table, lens = paged_setup(
        case, cache_dtype, seq_lens, seed=1)
    num_before = 2  # rows of other work (decodes) ahead of the prefills: left untouched
    cu = torch.tensor([0, 7, 27, 30, 31], dtype=torch.int32) + num_before
    q = torch.randn((num_before + sum(query_lens), num_heads, head_dim),
                    generator=gen).to(q_dtype)
    scale = head_dim ** -0.5
    out = torch.zeros_like(q)
    got = paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, max(query_lens), scale,
                                  ks, vs, out=out)
    want = paged_prefill_attention_reference(q, k_cache, v_cache, table, cu, lens, scale, ks, vs)
    assert rel_err(got, want) <= TOL[q_dtype]
    assert not got[:num_before].any()


# -- KV store --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_rows_at_slots_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(2)
    cache = torch.zeros((6, 4, 2, 16), dtype=dtype)
    x = torch.randn((5, 2, 16), generator=gen).to(dtype)
    slots = torch.tensor([3, 9, PAD_SLOT_ID, 22, 4])
    store_kv(x, cache, slots)
    flat = cache.view(-1, 2, 16)
    assert torch.equal(flat[torch.tensor([3, 9, 22, 4])], x[torch.tensor([0, 1, 3, 4])])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 4
    ref = torch.zeros_like(cache)
    store_kv_reference(x, ref, slots)
    assert torch.equal(ref, cache)


def fp8_store_both(x: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                   slots: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor,
                   ref_cache: torch.Tensor, ref_scales: torch.Tensor) -> None:
    """One step's store through the kernel and through the reference."""
    block_size = cache.shape[1]
    store_kv(x, cache, slots, scales, store_segments(query_lens, seq_lens, block_size,
                                                     torch.device("cpu")))
    store_kv_reference(x, ref_cache, slots, ref_scales)


@pytest.mark.parametrize("block_size", [4, 16])
def test_fp8_store_of_whole_blocks_is_the_wire_quantization(block_size):
    gen = torch.Generator().manual_seed(3)
    num_blocks, heads, dim = 5, 2, 16
    data = torch.randn((num_blocks * block_size, heads, dim), generator=gen).to(torch.bfloat16)
    data[:, 1] *= 30  # heads of different ranges
    slots = torch.arange(num_blocks * block_size)
    cache = torch.zeros((num_blocks, block_size, heads, dim), dtype=FP8)
    scales = torch.ones((num_blocks, heads))
    ref_cache, ref_scales = cache.clone(), scales.clone()
    n = num_blocks * block_size
    fp8_store_both(data, [n], [n], slots, cache, scales, ref_cache, ref_scales)
    wire_payload, wire_scales = quantize_blocks(
        data.view(1, 1, num_blocks, block_size, heads, dim).expand(1, 2, -1, -1, -1, -1))
    assert torch.equal(ref_cache.view(torch.uint8), wire_payload[0, 0].view(torch.uint8))
    assert torch.equal(ref_scales, wire_scales[0, 0])
    assert torch.equal(scales, ref_scales)
    assert fp8_steps(cache, ref_cache) <= 1


@pytest.mark.parametrize("block_size", [4, 16])
def test_fp8_store_appending_tokens_grows_scale_within_bound(block_size):
    """A prefill ending mid-block, then decode tokens of growing size (scale growth)."""
    gen = torch.Generator().manual_seed(4)
    heads, dim, num_blocks = 2, 16, 8
    prompt = 2 * block_size + 3
    num_decode = block_size + 2
    total = prompt + num_decode
    values = torch.randn((total, heads, dim), generator=gen)
    values *= torch.linspace(0.5, 8.0, total)[:, None, None]  # later tokens are larger
    values = values.to(torch.bfloat16)
    table = torch.tensor([[5, 2, 7, 0, 3]], dtype=torch.int32)
    cache = torch.zeros((num_blocks, block_size, heads, dim), dtype=FP8)
    scales = torch.ones((num_blocks, heads))
    ref_cache, ref_scales = cache.clone(), scales.clone()
    steps = [(prompt, prompt)] + [(1, prompt + i + 1) for i in range(num_decode)]
    start = 0
    for q_len, seq_len in steps:
        slots = slots_for(table, [q_len], [seq_len], block_size)
        fp8_store_both(values[start:start + q_len], [q_len], [seq_len], slots, cache, scales,
                       ref_cache, ref_scales)
        start += q_len
    assert fp8_steps(cache, ref_cache) <= 1
    assert torch.allclose(scales, ref_scales, rtol=1e-6)
    # The NOTE's bound, per element: 2^-4 |x| + 2^-8 * final scale (+ fp32 slack).
    slots = slots_for(table, [total], [total], block_size)
    blocks = slots // block_size
    dequant = ref_cache.view(-1, heads, dim)[slots].float() * ref_scales[blocks][:, :, None]
    x = values.float()
    bound = 2 ** -4 * x.abs() * (1 + 1e-5) + 2 ** -8 * ref_scales[blocks][:, :, None]
    assert bool(((dequant - x).abs() <= bound).all())
    assert bool((ref_scales[table[0, :3].long()] > 0).all())


# -- RMSNorm and rotary ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rmsnorm_with_residual_matches_reference(dtype, hidden):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((7, hidden), generator=gen).to(dtype)
    res = torch.randn((7, hidden), generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    out, new_res = rms_norm(x, w, 1e-6, res)
    want_out, want_res = rms_norm_reference(x, w, 1e-6, res)
    assert rel_err(out, want_out) <= TOL[dtype]
    assert rel_err(new_res, want_res) <= TOL[dtype] / 4  # the interpreter's bf16 rounding
    assert rel_err(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1)])
def test_rotary_matches_reference(dtype, heads):
    from pdserve.engine.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(6)
    num_heads, num_kv_heads = heads
    rope = RotaryEmbedding(32, 256, 10000.0)
    positions = torch.tensor([0, 5, 17, 200, 3])
    q = torch.randn((5, num_heads, 32), generator=gen).to(dtype)
    k = torch.randn((5, num_kv_heads, 32), generator=gen).to(dtype)
    want_q, want_k = apply_rotary_reference(positions, q, k, rope.cos_cached, rope.sin_cached)
    engine_q, _ = rope(positions, q, k)
    assert torch.equal(want_q, engine_q)  # the reference is the engine's arithmetic
    apply_rotary_(positions, q, k, rope.cos_cached, rope.sin_cached)
    assert rel_err(q, want_q) <= TOL[dtype]
    assert rel_err(k, want_k) <= TOL[dtype]
