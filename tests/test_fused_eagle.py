"""The EAGLE-1 head's layer in the fused CPU kernel (pdserve/engine/spec_decode/fused_eagle.py)
against the head's eager forward, on the default model and its shipped head in bf16; and
greedy decoding with it drafting equals plain decoding."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.base import AttentionInputs
from pdserve.engine.kernels.cpu_decode import cpu_decode_module

pytestmark = pytest.mark.skipif(cpu_decode_module() is None,
                                reason="the fused CPU kernel is not built on this machine")

PROMPTS = ["Tell me about the history of the bicycle in a few sentences.",
           "Write three short tips for staying focused while studying.",
           "Why do leaves change colour in autumn?"]


@pytest.fixture(scope="module")
def eagle_llm():
    return LLM(None, dtype="bfloat16", load_progress=False, speculative_method="eagle",
               speculative_model="default", num_speculative_tokens=2, max_model_len=512)


def _inputs(proposer, requests, n: int):
    """Positions and attention inputs for the last ``n`` written positions of each request."""
    positions, slots, seq_lens = [], [], []
    for r in requests:
        start = r.num_tokens - n - 1
        span = list(range(start, start + n))
        positions += span
        slots += proposer._slots(r, span)
        seq_lens.append(start + n)
    return torch.tensor(positions), AttentionInputs(
        slot_mapping=torch.tensor(slots), query_lens=[n] * len(requests), seq_lens=seq_lens,
        block_tables=[r.block_table for r in requests],
        num_decodes=len(requests) if n == 1 else 0, block_size=proposer.block_size)


def test_the_fused_head_layer_matches_the_eager_head(eagle_llm):
    engine = eagle_llm.engine
    proposer = engine.proposer
    assert proposer.fused is not None  # bf16 on a CPU the kernel runs on: drafts go fused
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, text in enumerate(PROMPTS):
        engine.add_request(f"m{i}", eagle_llm.tokenizer.encode(text), params)
    for _ in range(6):
        engine.step()
    requests = [engine.requests[f"m{i}"] for i in range(len(PROMPTS))]
    hidden_size = engine.arch.hidden_size
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        # a chain step (one row each, one or three requests) and ingests of a few rows
        for reqs, n in ((requests[:1], 1), (requests, 1), (requests[:1], 3), (requests[:2], 2)):
            positions, inputs = _inputs(proposer, reqs, n)
            ids = torch.randint(100, 40000, (len(positions),), generator=gen)
            hidden = (torch.randn(len(positions), hidden_size, generator=gen) * 2).bfloat16()
            eager = proposer.model(ids, hidden, positions, proposer.kv_caches,
                                   proposer.runner.backend.build_metadata(inputs))
            fused = proposer.fused.run(ids, positions, hidden, inputs)
            assert fused.dtype == torch.bfloat16 and fused.shape == eager.shape
            # the same arithmetic up to the order of sums: within two bf16 steps
            torch.testing.assert_close(fused.float(), eager.float(), atol=4e-2, rtol=1.6e-2)
            assert (fused == eager).float().mean() > 0.4  # most values equal outright
    for i in range(len(PROMPTS)):
        engine.abort_request(f"m{i}")


def test_greedy_decoding_with_fused_drafts_equals_plain_decoding(eagle_llm):
    plain = LLM(None, dtype="bfloat16", load_progress=False, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [eagle_llm.tokenizer.encode(t) for t in PROMPTS]
    drafted = [o.outputs[0].token_ids for o in eagle_llm.generate(prompts, params)]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert drafted == expected
    stats = eagle_llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # the head drafted, some kept


def test_draft_lm_head_rows_come_from_the_bf16_copy_where_gemms_run_in_fp32(eagle_llm):
    """Where the target's GEMMs run in fp32 (a bf16 model on a CPU without native bf16), the
    head's FR-Spec rows are gathered from the LM head's bf16 copy (half the bytes a draft)
    and multiplied by the bf16 GEMV: within bf16 rounding of the fp32 product, same argmax
    on well-separated rows."""
    from pdserve.engine.layers.linear import Fp32GemmLinear

    head = eagle_llm.engine.proposer.model
    if not isinstance(head.target.lm_head, Fp32GemmLinear) or not head.has_draft_vocab:
        pytest.skip("the target's LM head is bf16 here (native bf16 GEMMs)")
    head._draft_lm_head = None
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, eagle_llm.engine.arch.hidden_size, generator=gen).bfloat16()
    logits, ids = head.compute_draft_logits(hidden)
    assert head._draft_lm_head.dtype == torch.bfloat16
    ref = hidden.double() @ head.target.lm_head.weight.double()[ids].T
    torch.testing.assert_close(logits.double(), ref, rtol=1e-2, atol=0.05)
