"""The fused CPU decode kernel (pdserve.engine.kernels.cpu_decode, pdserve.engine.compiled.fused_decode):
its GEMVs against double-precision references, its decoder stack against the eager model
for each tiny architecture, and speculative decoding staying lossless through it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import AttentionInputs
from pdserve.engine.compiled.fused_decode import MAX_FUSED_PREFILL_CONTEXT
from pdserve.engine.entrypoints.llm import LLM
from pdserve.engine.kernels import cpu_decode as cd
from pdserve.engine.layers.linear import cpu_has_native_gemm
from pdserve.engine.sampling_params import SamplingParams

needs_kernel = pytest.mark.skipif(cd.cpu_decode_module() is None,
                                  reason="no AVX2/FMA/F16C or no C++ toolchain")
pytestmark = needs_kernel
#: The builds this CPU runs (the AVX2 one everywhere, AVX512-BF16 where the CPU has it).
ISAS = [name for name, (_, needs) in cd.BUILDS.items() if needs <= cd.cpu_flags()]


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization, in torch: int8 codes and a scale per 32."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1), 0)  # fp32, as in C++
    return torch.round(blocks * inv).double(), (amax / 127.0).double()


def _reference(kind: str, x: torch.Tensor, w: torch.Tensor, parts: dict) -> torch.Tensor:
    """``x @ W^T`` in double, as the kernel defines it for each weight kind."""
    if kind == "bf16":
        return x.double() @ w.bfloat16().double().t()
    q, d = _quantize_rows(x)  # [M, nb, 32], [M, nb, 1]
    xq = (q * d).reshape(x.shape[0], -1)
    if kind == "int8":
        _, codes, scale = parts["seg"]
        return (xq @ codes.double().t()) * scale.double()
    codes, dd, mm = parts["codes"], parts["d"], parts["m"]
    # d * dx * (codes . xq) + m * sum(x) per block: the offset multiplies the exact sum
    n, k = codes.shape
    cb = codes.double().reshape(n, k // 32, 32)
    dots = torch.einsum("mbj,nbj->mnb", q, cb)
    scaled = dots * d.squeeze(-1)[:, None, :] * dd.double()[None]
    sums = x.double().reshape(x.shape[0], -1, 32).sum(-1)  # [M, nb]
    return scaled.sum(-1) + sums @ mm.double().t()


def _segment(kind: str, n: int, k: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor, dict]:
    w = torch.randn(n, k, generator=gen) * 0.1
    if kind == "bf16":
        return cd.bf16_segment(w), w, {}
    if kind == "int8":
        seg = cd.int8_segment(w)
        return seg, w, {"seg": seg}
    codes = torch.randint(0, 16, (n, k), generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    m = (-8 * d + torch.randn(n, k // 32, generator=gen) * 0.01).half().float()
    return cd.int4_segment(codes, d, m), w, {"codes": codes, "d": d, "m": m}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["bf16", "int4", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 32])
def test_fused_linear_matches_its_definition(kind, rows, isa):
    """Each weight kind computes what its docstring says (bf16 values rounded at the end),
    two segments fill their own output columns, the bias is added, and each token's row is
    bit for bit the one-row call (plain decoding = speculative verification), in every
    build this CPU runs (K = 104: whole 32-column blocks and a tail; 32 rows: the panels;
    quantized: 48 rows in 16-row tiles where the build has AVX512-VNNI, 40 rows, not a
    multiple of 16, by the per-row kernels)."""
    gen = torch.Generator().manual_seed(rows * 7 + len(kind))
    k = 96 if kind != "bf16" else 104
    n_b = 32 if kind == "bf16" else 40
    seg_a, w_a, parts_a = _segment(kind, 48, k, gen)
    seg_b, w_b, parts_b = _segment(kind, n_b, k, gen)
    bias = torch.randn(48 + n_b, generator=gen).bfloat16().float()
    lin = cd.cpu_decode_module(isa).FusedLinear([seg_a, seg_b], bias, k)
    x = torch.randn(rows, k, generator=gen).bfloat16().float()
    y = lin.forward(x)
    ref = torch.cat([_reference(kind, x, w_a, parts_a), _reference(kind, x, w_b, parts_b)], -1)
    ref = (ref + bias.double()).float().bfloat16().float()
    assert y.shape == (rows, 48 + n_b) and y.dtype == torch.float32
    # one bf16 step of slack (fp32 accumulation order against double), and for quantized
    # activations one int8 code: x * 127 / amax can round either way where it is within
    # an fp32 rounding of a half
    code = 0.0 if kind == "bf16" else 2 * float(_quantize_rows(x)[1].max()) * float(
        torch.cat([w_a, w_b]).abs().max() if kind == "int8" else 0.4)
    torch.testing.assert_close(y, ref, rtol=2**-7, atol=1e-3 + code)
    for r in range(rows):
        assert torch.equal(lin.forward(x[r:r + 1]), y[r:r + 1])


def _dequantized(kind: str, w: torch.Tensor, parts: dict) -> torch.Tensor:
    """The weights a quantized segment stands for, rounded to bf16 once (double)."""
    if kind == "int8":
        _, codes, scale = parts["seg"]
        values = codes.float() * scale.float()[:, None]
    else:
        n, k = parts["codes"].shape
        values = (parts["codes"].float().reshape(n, k // 32, 32) * parts["d"][..., None]
                  + parts["m"][..., None]).reshape(n, k)
    return values.bfloat16().double()


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("rows", [33, 100, 700])
def test_quantized_segments_past_32_rows_take_bf16_gemms(kind, rows):
    """Steps of more than 32 rows (prefill) multiply a quantized segment as its weights
    dequantized to bf16 (no int8 activations), through torch's bf16 GEMM: against the
    double product with those weights, one bf16 step of slack; 700 rows split over the
    threads, 33 and 100 one call (sizes where bf16 weights take oneDNN's packed form)."""
    isa = max(ISAS, key=lambda name: len(cd.BUILDS[name][1]))
    if not cpu_has_native_gemm(torch.bfloat16):
        pytest.skip("no native bf16 GEMMs here: prefill steps stay on the eager model")
    gen = torch.Generator().manual_seed(rows + len(kind))
    seg_a, w_a, parts_a = _segment(kind, 48, 96, gen)
    seg_b, w_b, parts_b = _segment(kind, 40, 96, gen)
    lin = cd.cpu_decode_module(isa).FusedLinear([seg_a, seg_b], torch.empty(0), 96)
    x = torch.randn(rows, 96, generator=gen).bfloat16().float()
    y = lin.forward(x)
    w = torch.cat([_dequantized(kind, w_a, parts_a), _dequantized(kind, w_b, parts_b)])
    ref = (x.double() @ w.t()).float().bfloat16().float()
    torch.testing.assert_close(y, ref, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 16, 17, 32])
def test_amx_tiles_match_the_definition_and_the_avx512_tiles(rows, monkeypatch):
    """Where the CPU has AMX, bf16 weights with K % 32 == 0 multiply in AMX tiles (weight
    rows in blocks of 32, the 16 left over in AVX512-BF16 tiles): the definition within a
    bf16 step, each token's row bit for bit the one-row call, and the AVX512-BF16 tiles'
    result (``PDSERVE_CPU_AMX=0``) within one bf16 step of it."""
    if "amx" not in ISAS:
        pytest.skip("no AMX on this CPU")
    mod = cd.cpu_decode_module("amx")
    if not mod.amx_usable():  # Linux before 5.16 does not grant the tile state
        pytest.skip("the OS did not grant AMX tile state")
    gen = torch.Generator().manual_seed(rows)
    k = 160
    w_a, w_b = torch.randn(48, k, generator=gen) * 0.1, torch.randn(64, k, generator=gen) * 0.1
    lin = mod.FusedLinear([cd.bf16_segment(w_a), cd.bf16_segment(w_b)], torch.empty(0), k)
    x = torch.randn(rows, k, generator=gen).bfloat16().float()
    y = lin.forward(x)
    ref = (x.double() @ torch.cat([w_a, w_b]).bfloat16().double().t()).float().bfloat16().float()
    torch.testing.assert_close(y, ref, rtol=2**-7, atol=1e-3)
    for r in range(rows):
        assert torch.equal(lin.forward(x[r:r + 1]), y[r:r + 1])
    monkeypatch.setenv("PDSERVE_CPU_AMX", "0")
    assert not mod.amx_usable()
    torch.testing.assert_close(lin.forward(x), y, rtol=2**-7, atol=1e-3)


def _amx_module():
    """The AMX build where the CPU has AMX and Linux grants the tile state, else skip."""
    if "amx" not in ISAS:
        pytest.skip("no AMX on this CPU")
    mod = cd.cpu_decode_module("amx")
    if not mod.amx_usable():
        pytest.skip("the OS did not grant AMX tile state")
    return mod


@pytest.mark.parametrize("n,ctx,heads,kv_heads", [
    (1, 0, 9, 3), (5, 0, 9, 3), (16, 0, 9, 3), (17, 3, 9, 3), (100, 70, 9, 3), (130, 3, 6, 2),
    (300, 0, 4, 4), (257, 255, 8, 1), (700, 1300, 9, 3), (90, 200, 8, 2), (333, 64, 14, 2)])
def test_amx_prefill_attention_matches_the_definition(n, ctx, heads, kv_heads):
    """The AMX prefill attention kernel (cpu_amx_attention.cpp): causal attention of n
    queries after ctx cached keys, within bf16 rounding of a double-precision softmax, for
    query tails (not a multiple of 16), key tails (not a multiple of 32), superblocks of 256
    keys with and without the diagonal, grouped and plain heads (a KV head's query heads in
    items of 3, 2 or 1: groups of 3, 4, 7, 8), strided queries."""
    mod = _amx_module()
    gen = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(n, heads + 1, 64, generator=gen).bfloat16()[:, :heads]  # strided
    k = torch.randn(ctx + n, kv_heads, 64, generator=gen).bfloat16()
    v = torch.randn(ctx + n, kv_heads, 64, generator=gen).bfloat16()
    out = mod.amx_prefill_attention(q, k, v, ctx, 0.125)
    group = heads // kv_heads
    kr, vr = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kr) * 0.125
    mask = torch.arange(ctx + n)[None, :] > (ctx + torch.arange(n))[:, None]
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, -torch.inf).softmax(-1), vr)
    assert out.dtype == torch.bfloat16 and out.shape == (n, heads, 64)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)
    with pytest.raises(RuntimeError, match="context then the chunk"):
        mod.amx_prefill_attention(q, k, v, ctx + 1, 0.125)


def test_amx_prefill_attention_with_scores_spanning_fp32s_range():
    """Scores of standard deviation ~30 (attention sinks span that much): probabilities down
    to 2^-149 relative to the row's maximum, where the kernel's 2^x returns 0 below 2^-125
    instead of denormals; the output still matches a double-precision softmax, and a row
    whose only visible key is far below the others still gets weight 1 on it."""
    mod = _amx_module()
    gen = torch.Generator().manual_seed(7)
    n, heads, kv_heads = 300, 9, 3
    q = (torch.randn(n, heads, 64, generator=gen) * 30).bfloat16()
    k = torch.randn(n, kv_heads, 64, generator=gen).bfloat16()
    v = torch.randn(n, kv_heads, 64, generator=gen).bfloat16()
    out = mod.amx_prefill_attention(q, k, v, 0, 0.125)
    kr, vr = k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kr) * 0.125
    assert (scores.amax(-1, keepdim=True) - scores).max() * 1.4427 > 150  # past fp32's range
    mask = torch.arange(n)[None, :] > torch.arange(n)[:, None]
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, -torch.inf).softmax(-1), vr)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)
    torch.testing.assert_close(out[0].double(), v[0].double().repeat_interleave(3, 0),
                               rtol=0, atol=0)


def test_amx_prefill_attention_probabilities_hit_every_mantissa_entry_within_bound():
    """The kernel's probabilities are bf16 bits from 2^x rounded to 1/128 of a power of 2
    and a 128-entry mantissa correction (MANT_FIX): one query sees key 0 (score 0, value
    e0) and key 1 (score 0.125 a, value 0), so its output's first dimension is p / (1 + p)
    with p = 2^-x. x swept over 8 powers of 2 in steps of 1/128 (every table entry, once
    per power) keeps within 0.65 % of p (the entry's bound) plus the output's bf16 rounding
    (0.39 %), unbiased on average; x = 0 gives exactly 1/2."""
    import math

    mod = _amx_module()
    heads = 1025
    x = torch.arange(heads - 1, dtype=torch.float64) / 128 + 1 / 512
    a = torch.cat([torch.zeros(1), x / (0.125 * math.log2(math.e))]).bfloat16()
    xs = a.double() * 0.125 * math.log2(math.e)  # the powers of 2 the bf16 scores give
    assert len(set((xs[1:] * 128).round().long().remainder(128).tolist())) == 128
    q = torch.zeros(2, heads, 64, dtype=torch.bfloat16)
    k, v = torch.zeros_like(q), torch.zeros_like(q)
    q[1, :, 0], k[1, :, 0], v[0, :, 0] = a, 1, 1
    out = mod.amx_prefill_attention(q, k, v, 0, 0.125)[1, :, 0].double()
    p = torch.exp2(-xs)
    rel = out / (p / (1 + p)) - 1
    assert out[0] == 0.5
    assert rel.abs().max() < 0.0065 + 0.0039, rel.abs().max()
    assert abs(rel.mean()) < 5e-4


def test_amx_prefill_attention_when_later_keys_outscore_the_first_block():
    """Scores that grow along the keys (keys scaled up with their position), so a query's
    max passes the first block's by far more than the kernel's lazy threshold (2^16) again
    and again: O and the sums rescaled, the probabilities waiting for the values flushed
    first; the output still matches a double-precision softmax."""
    mod = _amx_module()
    gen = torch.Generator().manual_seed(11)
    n, heads, kv_heads = 600, 9, 3
    q = (torch.randn(n, heads, 64, generator=gen) * 2).bfloat16()
    growth = 0.5 + torch.arange(n, dtype=torch.float32)[:, None, None] / 100
    k = (torch.randn(n, kv_heads, 64, generator=gen) * growth).bfloat16()
    v = torch.randn(n, kv_heads, 64, generator=gen).bfloat16()
    out = mod.amx_prefill_attention(q, k, v, 0, 0.125)
    kr, vr = k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kr) * 0.125
    mask = torch.arange(n)[None, :] > torch.arange(n)[:, None]
    scores = scores.masked_fill(mask, -torch.inf)
    # rows past the first 64 keys whose max beats the first 64 keys' by over 16 powers of 2
    jump = (scores[:, 64:, :].amax(-1) - scores[:, 64:, :64].amax(-1)) * 1.4427
    assert (jump > 16).float().mean() > 0.5
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vr)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)


def test_fused_prefill_chunks_in_amx_tiles_match_the_eager_model(tmp_path, monkeypatch):
    """A random-weight Llama with head_dim 64 on an AMX CPU: a fused step of two decodes, a
    40-token chunk after 300 cached positions, a 100-token prompt and a 16-token one (its
    prefill runs in one call of the AMX kernel) gives the eager bf16 model's hidden states
    and K/V within bf16 rounding, as the same step with torch's flash attention does.
    (The second layer's K/V amplify the first's attention differences; with this test's
    weights drawn from seeds 0-5 the largest K/V difference past rtol was 0.042 for the
    kernel, 0.053 for its polynomial-2^x predecessor, 0.037 for torch's kernel, which keeps
    the probabilities in fp32: atol 6e-2, as for the hidden states.)"""
    import transformers

    _amx_module()
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.08, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(
        tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), dtype="bfloat16", load_progress=False, block_size=16,
              num_kv_blocks=64, max_model_len=512)
    runner = llm.engine.runner
    fused = runner.fused_decode
    gen = torch.Generator().manual_seed(0)
    runner.kv_cache.copy_((torch.randn(runner.kv_cache.shape, generator=gen) * 0.5).bfloat16())
    tables = [list(range(0, 22)), [30, 31], list(range(40, 47)), [50, 51, 52], [60]]
    query_lens, seq_lens = [40, 1, 100, 1, 16], [340, 20, 100, 40, 16]
    ids, pos, slots = _step_inputs(runner, query_lens, seq_lens, tables, gen)
    before = runner.kv_cache.clone()
    outputs = {}
    for choice in ("", "torch"):  # "": the AMX kernel
        monkeypatch.setenv("PDSERVE_PREFILL_ATTENTION", choice)
        runner.kv_cache.copy_(before)
        outputs[choice] = fused.run(ids, pos, slots, query_lens, tables), runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    meta = runner.backend.build_metadata(AttentionInputs(
        slot_mapping=slots, query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
        num_decodes=0, block_size=16))
    with torch.no_grad():
        ref = runner.model(ids, pos, runner.kv_caches, meta)
    for hidden, kv in outputs.values():
        torch.testing.assert_close(hidden.float(), ref.float(), rtol=2e-2, atol=6e-2)
        torch.testing.assert_close(kv.float(), runner.kv_cache.float(), rtol=2e-2, atol=6e-2)


@pytest.mark.parametrize("k", [96, 608])  # 3 and 19 blocks: pairs and a tail block
def test_int4_rows_are_bit_for_bit_the_same_in_every_build(k):
    """The AVX512 builds' int4 GEMV (two blocks per vpdpbusd) sums the same integers into
    the same fp32 lanes as the AVX2 one (maddubs + madd): equal outputs, bit for bit."""
    gen = torch.Generator().manual_seed(k)
    seg, _, _ = _segment("int4", 40, k, gen)
    x = torch.randn(32, k, generator=gen).bfloat16().float()
    outs = {isa: cd.cpu_decode_module(isa).FusedLinear([seg], torch.empty(0), k).forward(x)
            for isa in ISAS}
    for isa in ISAS:
        assert torch.equal(outs[isa], outs["avx2"]), isa


def test_int4_segment_round_trips_codes_and_scales():
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (16, 64), generator=gen)
    d, m = torch.rand(16, 2, generator=gen), torch.rand(16, 2, generator=gen)
    kind, packed, ds = cd.int4_segment(codes, d, m)
    assert kind == cd.INT4 and packed.shape == (16, 32) and ds.shape == (16, 2, 2)
    blocks = packed.reshape(16, 2, 16)
    back = torch.cat((blocks & 0xF, blocks >> 4), dim=-1).reshape(16, 64)
    assert torch.equal(back.long(), codes)
    assert torch.equal(ds[:, 0].float(), d.half().float())
    with pytest.raises(ValueError, match="multiple of 32"):
        cd.group_to_blocks(d, 48)
    with pytest.raises(ValueError, match="int4 segment"):
        cd.int4_segment(codes[:, :40], d, m)


def test_fused_linear_refuses_bad_shapes():
    mod = cd.cpu_decode_module()
    with pytest.raises(RuntimeError, match="bf16 segment"):
        mod.FusedLinear([cd.bf16_segment(torch.randn(8, 16))], torch.empty(0), 32)
    lin = mod.FusedLinear([cd.bf16_segment(torch.randn(8, 16))], torch.empty(0), 16)
    with pytest.raises(RuntimeError, match="x must be"):
        lin.forward(torch.randn(2, 8))


def _step_inputs(runner, query_lens: list[int], seq_lens: list[int],
                 tables: list[list[int]], gen: torch.Generator):
    bs = runner.block_size
    ids, pos, slots = [], [], []
    for q, s, bt in zip(query_lens, seq_lens, tables):
        for p in range(s - q, s):
            ids.append(int(torch.randint(0, 500, (1,), generator=gen)))
            pos.append(p)
            slots.append(bt[p // bs] * bs + p % bs)
    return (torch.tensor(ids), torch.tensor(pos), torch.tensor(slots))


@pytest.mark.parametrize("step", ["decode", "prefill"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_decoder_matches_the_eager_model(arch, isa, step, tmp_path, monkeypatch):
    """On a random-weight checkpoint of each family (GQA, q/k/v bias, q/k norm, RoPE
    scalings), a step of decodes and verification rows over a filled cache gives the eager
    bf16 model's hidden states, K/V and EAGLE-3 features, within bf16 rounding, in every
    build this CPU runs (contexts of 17-40 keys: whole blocks of 8 and tails); so does a
    step with a 37-token prefill beside them (42 rows: the kernel's GEMMs are torch's), with
    and without EAGLE-3 features."""
    from conftest import build_tiny_checkpoint

    monkeypatch.setenv("PDSERVE_CPU_DECODE_ISA", isa)

    build_tiny_checkpoint(arch, tmp_path)
    llm = LLM(str(tmp_path), dtype="bfloat16", load_progress=False, block_size=16,
              num_kv_blocks=12, max_model_len=128)
    runner = llm.engine.runner
    fused = runner.fused_decode
    assert fused is not None
    gen = torch.Generator().manual_seed(0)
    # a filled cache: random K/V of the size the model writes (positions < 40)
    runner.kv_cache.copy_((torch.randn(runner.kv_cache.shape, generator=gen) * 0.5).bfloat16())
    tables = [[3, 4, 5], [7, 1, 9], [2, 6, 8]]
    query_lens, seq_lens = [1, 1, 4], [17, 40, 33]  # two decodes, one 4-row verification
    if step == "prefill":  # a 20-token chunk after 20 cached positions, a whole prompt
        query_lens, seq_lens = [1, 20, 37], [17, 40, 37]
    ids, pos, slots = _step_inputs(runner, query_lens, seq_lens, tables, gen)
    before = runner.kv_cache.clone()
    hidden, aux = fused.run(ids, pos, slots, query_lens, tables, aux_layer_ids=(0, 1))
    kv_fused = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    meta = runner.backend.build_metadata(AttentionInputs(
        slot_mapping=slots, query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
        num_decodes=query_lens.count(1), block_size=16))
    with torch.no_grad():
        ref, ref_aux = runner.model(ids, pos, runner.kv_caches, meta, aux_layer_ids=(0, 1))
    assert hidden.dtype == torch.bfloat16 and hidden.shape == ref.shape
    # the final norm's output is of unit scale, where a bf16 step is 2^-7: a few steps apart
    # where the eager GEMMs are oneDNN's native bf16 ones (another summation order): seen
    # up to 0.047 (6 steps) in single rows, in every build alike; a wrong attention is off
    # by whole units
    torch.testing.assert_close(hidden.float(), ref.float(), rtol=2e-2, atol=6e-2)
    torch.testing.assert_close(aux.float(), ref_aux.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kv_fused.float(), runner.kv_cache.float(), rtol=2e-2, atol=4e-2)
    # the written slots changed, nothing else did
    changed = (kv_fused != before).flatten(4).any(-1).any(0).any(0)  # [blocks, block_size]
    written = torch.zeros_like(changed)
    written.view(-1)[slots] = True
    assert not (changed & ~written).any()
    with pytest.raises(ValueError, match="aux_layer_ids"):
        fused.run(ids, pos, slots, query_lens, tables, aux_layer_ids=(5,))
    # without features to return, a prefill step's layers take their inputs from the last
    # one's bf16 output (residual add and norm in one pass): the same values bit for bit
    runner.kv_cache.copy_(before)
    plain = fused.run(ids, pos, slots, query_lens, tables)
    assert torch.equal(plain, hidden)
    assert torch.equal(runner.kv_cache, kv_fused)


def test_fused_path_is_chosen_only_where_it_applies(tmp_path):
    from conftest import build_tiny_checkpoint

    build_tiny_checkpoint("llama", tmp_path)
    small = dict(num_kv_blocks=16, max_model_len=128)
    assert LLM(str(tmp_path), dtype="float32", load_progress=False, **small).engine.runner \
        .fused_decode is None  # fp32 models keep the eager path (exact against transformers)
    assert LLM(str(tmp_path), dtype="bfloat16", load_progress=False, **small,
               enforce_eager=True).engine.runner.fused_decode is None
    assert LLM(str(tmp_path), dtype="bfloat16", load_progress=False, **small,
               kv_cache_dtype="fp8").engine.runner.fused_decode is None
    fused = LLM(str(tmp_path), dtype="bfloat16", load_progress=False, **small).engine.runner.fused_decode
    assert fused.can_run(cd.MAX_FUSED_TOKENS, 4096)
    # longer steps (prefill chunks) where torch multiplies bf16 natively, with short contexts
    # unless the build's prefill chunks take the blocked attention kernel (AVX512-BF16)
    native = cpu_has_native_gemm(torch.bfloat16)
    blocked = hasattr(cd.cpu_decode_module(), "prefill_attention")
    assert fused.can_run(cd.MAX_FUSED_TOKENS + 1, MAX_FUSED_PREFILL_CONTEXT) == native
    assert fused.can_run(cd.MAX_FUSED_TOKENS + 1, MAX_FUSED_PREFILL_CONTEXT + 1) == (
        native and blocked)


def test_fused_step_calls_layer_done_once_each_layer_is_in_the_cache(tmp_path):
    """A prefill worker streams each layer's K/V as soon as it is written: the kernel calls
    ``layer_done(l)`` for l = 0, 1, ... from inside its call, when layer l's K/V (and no
    later layer's) are in the cache, and the step's outputs do not change."""
    from conftest import build_tiny_checkpoint

    build_tiny_checkpoint("llama", tmp_path)
    llm = LLM(str(tmp_path), dtype="bfloat16", load_progress=False, block_size=16,
              num_kv_blocks=12, max_model_len=128)
    runner = llm.engine.runner
    fused = runner.fused_decode
    gen = torch.Generator().manual_seed(0)
    tables, query_lens, seq_lens = [[3, 4, 5]], [37], [37]
    ids, pos, slots = _step_inputs(runner, query_lens, seq_lens, tables, gen)
    ref = fused.run(ids, pos, slots, query_lens, tables)
    after = runner.kv_cache[:, :, [3, 4, 5]].clone()
    runner.kv_cache.zero_()
    seen = []

    def layer_done(layer: int) -> None:
        written = runner.kv_cache[:, :, [3, 4, 5]].flatten(1).ne(0).any(1)  # per layer
        seen.append((layer, written.tolist()))

    hidden = fused.run(ids, pos, slots, query_lens, tables, layer_done=layer_done)
    num_layers = runner.kv_cache.shape[0]
    assert [layer for layer, _ in seen] == list(range(num_layers))
    for layer, written in seen:
        assert written == [i <= layer for i in range(num_layers)]
    assert torch.equal(hidden, ref)
    assert torch.equal(runner.kv_cache[:, :, [3, 4, 5]], after)
    with pytest.raises(ZeroDivisionError):  # a failing callback fails the step
        fused.run(ids, pos, slots, query_lens, tables, layer_done=lambda layer: 1 / 0)
    assert torch.equal(fused.run(ids, pos, slots, query_lens, tables), ref)  # and it runs on


@pytest.mark.parametrize("quantization", [None, "rtn-int4", "rtn-int8"])
def test_greedy_speculation_stays_lossless_through_the_fused_kernel(quantization):
    """bf16 SmolLM2 (dense, int4 and int8 weights): n-gram speculative decoding's greedy
    tokens equal plain decoding's, both run by the fused kernel (its rows are independent,
    so verifying k drafts computes what k plain steps compute)."""
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
               "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(None, dtype="bfloat16", load_progress=False, quantization=quantization)
    assert plain.engine.runner.fused_decode is not None
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    del plain
    spec = LLM(None, dtype="bfloat16", load_progress=False, quantization=quantization,
               speculative_method="ngram", num_speculative_tokens=4)
    got = spec.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in got] == want
    assert spec.engine.spec_stats.num_accepted_tokens > 0  # drafts were verified and kept


@pytest.mark.parametrize("quantization,bound", [(None, 1.015), ("rtn-int4", 1.03), ("rtn-int8", 1.02),
                                                ("gguf", 1.02)])
def test_fused_perplexity_matches_the_eager_model(quantization, bound):
    """Held-out perplexity of SmolLM2 scored in chunks of 32 tokens (each chunk one fused
    step) and in fused chunks of 256 (prefill steps: torch's bf16 GEMMs, quantized weights
    dequantized to bf16 for them) against chunks of 256 through the eager model (fusion
    capped at 32 tokens) stays within ``bound``. A 2-core Xeon with AMX, this session's
    figures: fused 32 / fused 256 / eager: bf16 44.42 / 44.59 / 44.42, rtn-int4 44.73 /
    44.28 / 44.34, rtn-int8 44.41 / 44.17 / 44.17, gguf 45.09 / 44.41 / 44.61.

    Measured (512 tokens of the held text): bf16 fused 44.56, eager 44.26 (chunks of 256),
    44.34 (32), 44.23 (16); rtn-int4 fused 44.81, eager 44.32 / 44.42 / 44.46. The bf16
    gap is the weights, not the kernel: on CPUs without native bf16 the eager model keeps
    the checkpoint's fp32 weights for GEMMs of more than 8 rows and rounds them to bf16
    only for its decode GEMV, as the fused kernel always does (the GGUF's dequantized Q4_1
    values are not bf16 numbers). For int4 the int8 activations (GGML's Q4_1 x Q8_1
    scheme) add about 0.5 %; gguf (the file's Q4_1 blocks as they are, its Q8_0 LM head as
    per-channel int8) fused 44.53 against eager 44.43 / 44.31. rtn-int4's fused figure
    moves by up to 2 % between numerically equivalent attention kernels (its activations are
    rounded to int8, so a last-bit difference can flip a code): four 512-token windows of the
    held text, the AMX prefill kernel before and after its grouped-head rewrite (the same
    error against a double-precision softmax): 44.90 / 45.28, 59.07 / 59.90, 56.62 / 56.34,
    43.58 / 44.48; bf16 44.63 / 44.49, 58.48 / 58.64, 56.31 / 56.37, 43.31 / 43.45."""
    from pdserve.offline.perplexity import held_text, perplexity

    llm = LLM(None, dtype="bfloat16", load_progress=False, quantization=quantization,
              num_kv_blocks=64, max_model_len=1024)
    ids = llm.tokenizer(held_text())["input_ids"][:512]
    fused_decode = llm.engine.runner.fused_decode
    fused = perplexity(llm.engine, ids, chunk_size=cd.MAX_FUSED_TOKENS)
    # 256-token chunks: fused too where the CPU multiplies bf16 natively (quantized weights
    # dequantized to bf16 for the step's GEMMs), then the eager model with fusion capped
    chunks256 = perplexity(llm.engine, ids, chunk_size=256)
    prefill_cap = fused_decode.max_tokens
    fused_decode.max_tokens = cd.MAX_FUSED_TOKENS
    try:
        eager = perplexity(llm.engine, ids, chunk_size=256)
    finally:
        fused_decode.max_tokens = prefill_cap
    print(f"{quantization}: perplexity fused {fused:.4f} (256-token chunks {chunks256:.4f}), "
          f"eager {eager:.4f}")
    assert 1 / bound < fused / eager < bound
    assert 1 / bound < chunks256 / eager < bound
