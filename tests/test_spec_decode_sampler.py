"""Specification tests for draft verification (pdserve.engine.spec_decode.rejection_sampler).

Distribution tests use Pearson's chi-squared statistic, computed here, against the critical
value at significance 0.001 for ``df = support size - 1`` (from the chi-squared table).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.sample.sampling_metadata import SamplingMetadata
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec_decode.rejection_sampler import RejectionSampler

CPU = torch.device("cpu")
VOCAB_SIZE = 8
NUM_TRIALS = 20_000
#: Chi-squared critical values at p = 0.001, keyed by degrees of freedom.
CHI2_CRITICAL_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}

# Target logits of the first and second draft positions and the bonus position.
TARGET_LOGITS = np.array(
    [
        [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5],
        [-1.0, 0.0, 2.5, 0.3, 1.2, -2.0, 0.7, 0.1],
        [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4],
    ]
)
# Adversarial draft: most mass where the target has the least, per draft position.
ADVERSARIAL_DRAFT_PROBS = np.array(
    [
        [0.01, 0.01, 0.02, 0.03, 0.05, 0.08, 0.3, 0.5],
        [0.4, 0.01, 0.01, 0.03, 0.05, 0.4, 0.05, 0.05],
    ]
)


def build(params: list[SamplingParams], generators=None) -> SamplingMetadata:
    num_rows = len(params)
    return SamplingMetadata.build(
        params,
        prompt_token_ids=[[] for _ in range(num_rows)],
        output_token_ids=[[] for _ in range(num_rows)],
        generators=generators if generators is not None else [None] * num_rows,
        eos_token_id=None,
        vocab_size=VOCAB_SIZE,
        device=CPU,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def reference_probs(
    values: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    is_logits: bool = True,
) -> np.ndarray:
    """Independent numpy truncation of one distribution: temperature, top-k, top-p."""
    probs = np.exp(values / temperature - np.max(values / temperature)) if is_logits else values
    probs = probs / probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros_like(probs, dtype=bool)
    keep[order[: top_k if top_k > 0 else len(probs)]] = True
    probs = np.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    if top_p < 1.0:
        cumulative = 0.0
        kept = np.zeros_like(keep)
        for token in np.argsort(-probs, kind="stable"):
            if cumulative >= top_p:
                break
            kept[token] = True
            cumulative += probs[token]
        probs = np.where(kept, probs, 0.0) / probs[kept].sum()
    return probs


def chi_squared(samples: np.ndarray, expected_probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and df over the support; asserts nothing lands outside it."""
    counts = np.bincount(samples, minlength=len(expected_probs))
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"samples outside the support: {counts}"
    expected = expected_probs[support] * len(samples)
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    return statistic, int(support.sum()) - 1


def run_trials(
    params: SamplingParams, draft_probs: np.ndarray | None, draft_tokens: np.ndarray,
    seed: int,
):
    """NUM_TRIALS independent requests, each verifying ``draft_tokens[i]`` in one call."""
    num_draft = draft_tokens.shape[1]
    logits = torch.tensor(TARGET_LOGITS[[*range(num_draft), 2]], dtype=torch.float32)
    target_logits = logits.repeat(NUM_TRIALS, 1)  # [NUM_TRIALS * (k + 1), V]
    probs = None if draft_probs is None else torch.tensor(draft_probs, dtype=torch.float32)
    out = RejectionSampler()(
        target_logits,
        draft_token_ids=draft_tokens.tolist(),
        draft_probs=[probs] * NUM_TRIALS,
        metadata=build([params] * NUM_TRIALS),
        default_generator=seeded(seed),
    )
    return out.output_token_ids.numpy(), out.num_accepted_tokens.numpy()


def sample_drafts(truncated_draft_probs: np.ndarray, seed: int) -> np.ndarray:
    """``[NUM_TRIALS, k]`` draft tokens, position j drawn from ``truncated_draft_probs[j]``."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [rng.choice(VOCAB_SIZE, size=NUM_TRIALS, p=row) for row in truncated_draft_probs], axis=1
    )


# ---------------------------------------------------------------------------------- greedy

GREEDY_LOGITS = torch.tensor(
    [
        [0.0, 1.0, 3.0, 2.0],  # argmax 2
        [0.5, 4.0, 0.0, 1.0],  # argmax 1
        [1.0, 0.0, 2.0, 5.0],  # argmax 3
        [9.0, 1.0, 2.0, 3.0],  # argmax 0 (bonus row)
    ]
)


def greedy_metadata(num_requests: int) -> SamplingMetadata:
    return SamplingMetadata.build(
        [SamplingParams(temperature=0.0)] * num_requests,
        [[] for _ in range(num_requests)], [[] for _ in range(num_requests)],
        [None] * num_requests, None, 4, CPU,
    )


def test_greedy_accepts_matching_prefix_then_emits_target_argmax():
    out = RejectionSampler()(GREEDY_LOGITS, [[2, 1, 0]], [None], greedy_metadata(1))
    assert out.to_lists() == ([[2, 1, 3]], [2])


def test_greedy_first_draft_mismatch_emits_only_the_correction():
    out = RejectionSampler()(GREEDY_LOGITS, [[3, 1, 3]], [None], greedy_metadata(1))
    assert out.to_lists() == ([[2]], [0])


def test_greedy_all_accepted_emits_the_bonus_token():
    out = RejectionSampler()(GREEDY_LOGITS, [[2, 1, 3]], [None], greedy_metadata(1))
    assert out.to_lists() == ([[2, 1, 3, 0]], [3])


def test_greedy_rows_without_drafts_behave_like_plain_greedy():
    # Four requests with k = 0: one row each, the emitted token is that row's argmax.
    out = RejectionSampler()(GREEDY_LOGITS, [[], [], [], []], [None] * 4, greedy_metadata(4))
    assert out.to_lists() == ([[2], [1], [3], [0]], [0, 0, 0, 0])


def test_greedy_requests_with_different_draft_lengths_in_one_batch():
    # Request 0 uses rows 0..1 (k = 1), request 1 uses rows 2..3 (k = 1).
    out = RejectionSampler()(GREEDY_LOGITS, [[2], [1]], [None, None], greedy_metadata(2))
    assert out.to_lists() == ([[2, 1], [3]], [1, 0])


def test_padded_output_ends_with_placeholders():
    # Request 0: rows 0..2 (draft 2 accepted, 0 rejected -> 1); request 1: row 3 alone.
    out = RejectionSampler()(GREEDY_LOGITS, [[2, 0], []], [None, None], greedy_metadata(2))
    assert out.output_token_ids.tolist() == [[2, 1, -1], [0, -1, -1]]


# ---------------------------------------------------------------------------------- random


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.8, 0, 1.0), (1.0, 5, 1.0), (1.2, 6, 0.8)]
)
def test_first_token_follows_target_with_adversarial_draft(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    # The draft token must be drawn from the draft's own truncated distribution.
    truncated_q = np.stack(
        [reference_probs(q, top_k=top_k, top_p=top_p, is_logits=False)
         for q in ADVERSARIAL_DRAFT_PROBS]
    )
    drafts = sample_drafts(truncated_q, seed=1)
    tokens, _ = run_trials(params, ADVERSARIAL_DRAFT_PROBS, drafts, seed=2)
    expected = reference_probs(TARGET_LOGITS[0], temperature, top_k, top_p)
    statistic, df = chi_squared(tokens[:, 0], expected)
    assert statistic < CHI2_CRITICAL_P001[df], (statistic, df)


def test_second_token_after_an_accepted_first_follows_the_target():
    params = SamplingParams(temperature=1.0)
    drafts = sample_drafts(ADVERSARIAL_DRAFT_PROBS, seed=3)
    tokens, num_accepted = run_trials(params, ADVERSARIAL_DRAFT_PROBS, drafts, seed=4)
    second = tokens[num_accepted >= 1, 1]
    assert len(second) > 1000
    statistic, df = chi_squared(second, reference_probs(TARGET_LOGITS[1]))
    assert statistic < CHI2_CRITICAL_P001[df], (statistic, df)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (4, 0.9)])
def test_point_mass_draft_first_token_follows_target(top_k, top_p):
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    # Half the requests propose the likeliest token, half the least likely one.
    drafts = np.array([[0, 1], [7, 5]] * (NUM_TRIALS // 2))
    tokens, _ = run_trials(params, None, drafts, seed=5)
    expected = reference_probs(TARGET_LOGITS[0], 1.0, top_k, top_p)
    statistic, df = chi_squared(tokens[:, 0], expected)
    assert statistic < CHI2_CRITICAL_P001[df], (statistic, df)


def test_point_mass_draft_is_accepted_with_target_probability():
    drafts = np.array([[0, 1]] * NUM_TRIALS)
    _, num_accepted = run_trials(SamplingParams(temperature=1.0), None, drafts, seed=6)
    p0 = reference_probs(TARGET_LOGITS[0])[0]
    accepted = (num_accepted >= 1).sum()
    # Binomial(NUM_TRIALS, p0): 4.5 standard deviations.
    assert abs(accepted - NUM_TRIALS * p0) < 4.5 * np.sqrt(NUM_TRIALS * p0 * (1 - p0))


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (3, 1.0)])
def test_draft_identical_to_target_is_always_fully_accepted(top_k, top_p):
    temperature = 0.7
    target_q = np.stack([reference_probs(TARGET_LOGITS[j], temperature) for j in range(2)])
    truncated_q = np.stack(
        [reference_probs(TARGET_LOGITS[j], temperature, top_k, top_p) for j in range(2)]
    )
    drafts = sample_drafts(truncated_q, seed=7)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, num_accepted = run_trials(params, target_q, drafts, seed=8)
    assert (num_accepted == 2).all()
    np.testing.assert_array_equal(tokens[:, :2], drafts)


def test_seeded_request_does_not_depend_on_its_batch():
    logits = torch.tensor(TARGET_LOGITS, dtype=torch.float32)  # one request, k = 2
    params = SamplingParams(temperature=1.0, seed=11)
    alone = RejectionSampler()(logits, [[7, 5]], [None], build([params], [seeded(11)]))
    other = torch.randn(2, VOCAB_SIZE)
    batched = RejectionSampler()(
        torch.cat([other, logits]), [[3], [7, 5]], [None, None],
        build([SamplingParams(temperature=1.0), params], [None, seeded(11)]),
    )
    assert batched.to_lists()[0][1] == alone.to_lists()[0][0]


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = torch.tensor(TARGET_LOGITS, dtype=torch.float32)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    out = RejectionSampler()(
        torch.cat([logits, logits]), [[7, 5], [0, 2]], [None, None], build(params), seeded(0)
    )
    # Greedy request: argmaxes are 0, 2, 7, so both drafts are accepted and 7 is the bonus.
    assert out.to_lists()[0][1] == [0, 2, 7]


# ---------------------------------------------------------------------------------- errors


def test_row_count_mismatch_is_rejected():
    with pytest.raises(ValueError, match="rows"):
        RejectionSampler()(GREEDY_LOGITS, [[2]], [None], greedy_metadata(1))


def test_draft_probs_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="draft_probs"):
        RejectionSampler()(
            GREEDY_LOGITS[:2], [[2]], [torch.full((2, 4), 0.25)], greedy_metadata(1)
        )


def test_penalties_are_rejected():
    metadata = SamplingMetadata.build(
        [SamplingParams(presence_penalty=1.0)], [[]], [[]], [None], None, 4, CPU
    )
    with pytest.raises(ValueError, match="penalties"):
        RejectionSampler()(GREEDY_LOGITS[:1], [[]], [None], metadata)
