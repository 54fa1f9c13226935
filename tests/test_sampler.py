"""Specification tests for the batched sampler (pdserve.engine.sample)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sample import Sampler, SamplingMetadata, apply_penalties
from pdserve.engine.sample.draws import draw_uniforms, greedy_tokens, sample_rows
from pdserve.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def build(
    params: list[SamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos_token_id: int | None = None,
) -> SamplingMetadata:
    num_rows = len(params)
    return SamplingMetadata.build(
        params,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(num_rows)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(num_rows)],
        generators=generators if generators is not None else [None] * num_rows,
        eos_token_id=eos_token_id,
        vocab_size=vocab_size,
        device=CPU,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def sample_support(logits_row: list[float], params: SamplingParams, num_draws: int) -> set[int]:
    """Draws ``num_draws`` tokens from one logits row and returns the set of tokens seen."""
    logits = torch.tensor([logits_row] * num_draws)
    metadata = build([params] * num_draws, vocab_size=len(logits_row))
    tokens = Sampler()(logits, metadata, default_generator=seeded(0)).sampled_token_ids
    return set(tokens.tolist())


# --- greedy ------------------------------------------------------------------------------


def test_greedy_rows_take_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.0, 2.9], [-5.0, -4.0, -6.0, -4.5]])
    metadata = build([SamplingParams(temperature=0.0)] * 3, vocab_size=4)
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.tolist() == [1, 0, 1]
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_keep_argmax_first_index_rule(dtype):
    """Ties go to the first maximal index, a NaN counts as the maximum, an all -inf row
    gives 0: what torch.argmax returns, at the vocabulary size of the real model too."""
    gen = seeded(5)
    for vocab in (7, 49152):
        logits = torch.randint(0, 4, (40, vocab), generator=gen).to(dtype)  # many ties
        logits[0, :] = 1.0
        logits[1, vocab - 1] = 9.0
        logits[2, 3] = logits[2, 5] = float("nan")
        logits[3, :] = float("-inf")
        logits[4, 2] = logits[4, vocab - 2] = float("inf")
        expected = logits.argmax(dim=-1)
        assert expected[:5].tolist() == [0, vocab - 1, 3, 0, 2]
        assert torch.equal(greedy_tokens(logits), expected)
        assert torch.equal(greedy_tokens(logits[::2, 1:]), logits[::2, 1:].argmax(dim=-1))
        assert greedy_tokens(logits).dtype == torch.int64


def test_greedy_row_takes_argmax_inside_mixed_batch():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 4.0, 3.9, 0.0]])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    metadata = build(params, vocab_size=4)
    assert not metadata.all_greedy and not metadata.all_random
    for seed in range(20):
        out = Sampler()(logits, metadata, default_generator=seeded(seed))
        assert out.sampled_token_ids[1].item() == 1


def test_top_k_1_equals_greedy_at_high_temperature():
    logits = torch.randn(16, 50, generator=seeded(3))
    metadata = build([SamplingParams(temperature=5.0, top_k=1)] * 16, vocab_size=50)
    out = Sampler()(logits, metadata, default_generator=seeded(4))
    expected = [max(range(50), key=lambda i: row[i]) for row in logits.tolist()]
    assert out.sampled_token_ids.tolist() == expected


def test_sampler_does_not_modify_input_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, -0.5, 0.0]])
    original = logits.clone()
    params = SamplingParams(temperature=0.8, top_p=0.5, repetition_penalty=2.0, logit_bias={0: 5.0})
    metadata = build([params] * 2, vocab_size=3, prompts=[[2], [1]], outputs=[[2], [0]])
    Sampler()(logits, metadata, default_generator=seeded(0))
    assert torch.equal(logits, original)


# --- seeds -------------------------------------------------------------------------------


def sample_steps(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    num_steps: int,
    default_seed: int,
) -> list[list[int]]:
    """Samples ``num_steps`` times with the same logits; returns tokens per row."""
    default_generator = seeded(default_seed)
    metadata = build(params, vocab_size=logits.shape[1], generators=generators)
    steps = [
        Sampler()(logits, metadata, default_generator).sampled_token_ids.tolist()
        for _ in range(num_steps)
    ]
    return [list(row) for row in zip(*steps)]


def test_same_seed_gives_same_tokens_twice():
    logits = torch.zeros(1, 100)  # uniform: every token is equally likely
    params = [SamplingParams(temperature=1.0, seed=7)]
    first = sample_steps(logits, params, [seeded(7)], num_steps=10, default_seed=1)
    second = sample_steps(logits, params, [seeded(7)], num_steps=10, default_seed=2)
    assert first == second
    # Sanity: the draw is random, so a different seed gives a different sequence.
    other = sample_steps(logits, params, [seeded(8)], num_steps=10, default_seed=1)
    assert other != first


def test_seeded_request_is_independent_of_row_and_batch():
    request_logits = torch.randn(1, 100, generator=seeded(11)) * 0.5
    request = SamplingParams(temperature=1.0, seed=42)
    alone = sample_steps(request_logits, [request], [seeded(42)], num_steps=10, default_seed=0)

    others = torch.randn(3, 100, generator=seeded(12))
    batch_logits = torch.cat([others[:2], request_logits, others[2:]])
    batch_params = [
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=1.3, top_p=0.9),
        request,
        SamplingParams(temperature=0.5, top_k=20),
    ]
    generators = [None, None, seeded(42), None]
    in_batch = sample_steps(batch_logits, batch_params, generators, num_steps=10, default_seed=5)
    assert in_batch[2] == alone[0]


# --- temperature distribution ------------------------------------------------------------

# Chi-square critical value for 7 degrees of freedom at p = 0.001.
CHI_SQUARE_CRITICAL_DF7_P001 = 24.32


def test_temperature_sampling_follows_softmax_of_scaled_logits():
    logits_row = [1.0, 0.5, 0.0, -0.5, 0.3, 1.2, -1.0, 0.8]
    temperature = 0.7
    num_draws = 20000
    exps = [math.exp(x / temperature) for x in logits_row]
    expected_probs = [e / sum(exps) for e in exps]

    logits = torch.tensor([logits_row] * num_draws)
    metadata = build([SamplingParams(temperature=temperature)] * num_draws, vocab_size=8)
    tokens = Sampler()(logits, metadata, default_generator=seeded(1234)).sampled_token_ids
    observed = torch.bincount(tokens, minlength=8).tolist()

    chi_square = sum(
        (obs - num_draws * p) ** 2 / (num_draws * p) for obs, p in zip(observed, expected_probs)
    )
    assert chi_square < CHI_SQUARE_CRITICAL_DF7_P001


def test_inverse_transform_draw_is_exact_on_a_grid_and_never_draws_zero_weights():
    """Uniforms evenly spaced over [0, 1) hit each token exactly in proportion to its
    (unnormalized) weight; zero weights, also at the ends, are never drawn, not even by
    the largest uniform below 1."""
    weights = torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 4.0, 0.0, 0.0])
    n = 1000
    uniforms = torch.arange(n, dtype=torch.float64) / n
    tokens = sample_rows(weights.expand(n, -1), uniforms)
    assert torch.bincount(tokens, minlength=8).tolist() == [0, 100, 0, 200, 300, 400, 0, 0]
    top = torch.tensor([math.nextafter(1.0, 0.0)], dtype=torch.float64)
    assert sample_rows(torch.tensor([[0.0, 0.1, 0.7, 0.2, 0.0]]), top).tolist() == [3]
    assert sample_rows(torch.tensor([[0.0, 0.3, 0.0]]), torch.zeros(1)).tolist() == [1]
    assert sample_rows(torch.zeros(1, 4), torch.zeros(1)).tolist() == [3]  # in range


def test_seeded_rows_draw_their_own_uniform_and_skipping_draws_matches_sampling():
    """A seeded row's uniform comes from its own generator whatever the batch; advancing
    a generator past n tokens (a migrated request) leaves it where sampling n tokens
    would."""
    generators = {1: seeded(7)}
    batch = draw_uniforms(3, generators, seeded(1), torch.device("cpu"))
    alone = draw_uniforms(1, {0: seeded(7)}, seeded(99), torch.device("cpu"))
    assert batch[1] == alone[0] and batch[0] != batch[1]
    params = SamplingParams(temperature=1.0, seed=5)
    sampled = Request("a", [1, 2], params, 4, (0,), torch.device("cpu"))
    skipped = Request("b", [1, 2], params, 4, (0,), torch.device("cpu"))
    for _ in range(3):
        draw_uniforms(1, {0: sampled.generator}, None, torch.device("cpu"))
    skipped.skip_sampled_draws(3, vocab_size=8)
    assert torch.rand(1, generator=sampled.generator) == torch.rand(1, generator=skipped.generator)


# --- truncation --------------------------------------------------------------------------

# Token ids 0..4 with probabilities 0.15, 0.05, 0.4, 0.1, 0.3 (not sorted by id on purpose).
TRUNCATION_PROBS = [0.15, 0.05, 0.4, 0.1, 0.3]
TRUNCATION_LOGITS = [math.log(p) for p in TRUNCATION_PROBS]


@pytest.mark.parametrize(
    ("top_p", "expected_support"),
    [
        (0.35, {2}),  # 0.4 alone reaches 0.35
        (0.65, {2, 4}),  # 0.4 + 0.3 = 0.7 reaches 0.65
        (0.8, {2, 4, 0}),  # 0.7 + 0.15 = 0.85 reaches 0.8
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_top_p(top_p, expected_support):
    params = SamplingParams(temperature=1.0, top_p=top_p)
    assert sample_support(TRUNCATION_LOGITS, params, num_draws=2000) == expected_support


@pytest.mark.parametrize(
    ("top_k", "expected_support"),
    [(1, {2}), (2, {2, 4}), (3, {2, 4, 0}), (4, {2, 4, 0, 3}), (0, {0, 1, 2, 3, 4})],
)
def test_top_k_keeps_k_most_likely_tokens(top_k, expected_support):
    params = SamplingParams(temperature=1.0, top_k=top_k)
    assert sample_support(TRUNCATION_LOGITS, params, num_draws=2000) == expected_support


@pytest.mark.parametrize(
    ("min_p", "expected_support"),
    [
        (0.3, {2, 4, 0}),  # threshold 0.12 keeps 0.4, 0.3, 0.15
        (0.5, {2, 4}),  # threshold 0.2
        (0.2, {2, 4, 0, 3}),  # threshold 0.08
    ],
)
def test_min_p_keeps_tokens_above_fraction_of_max_prob(min_p, expected_support):
    params = SamplingParams(temperature=1.0, min_p=min_p)
    assert sample_support(TRUNCATION_LOGITS, params, num_draws=2000) == expected_support


def test_top_k_then_top_p_renormalizes_over_top_k_survivors():
    # top_k=2 leaves {2: 0.4, 4: 0.3} -> renormalized {2: 4/7, 4: 3/7}; top_p=0.6 needs both.
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.6)
    assert sample_support(TRUNCATION_LOGITS, params, num_draws=2000) == {2, 4}


def test_truncation_is_per_row_within_one_batch():
    rows = [
        SamplingParams(temperature=1.0, top_p=0.35),
        SamplingParams(temperature=1.0),  # no truncation, next to rows that truncate
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, min_p=0.3),
    ]
    num_draws = 1000
    logits = torch.tensor([TRUNCATION_LOGITS] * (len(rows) * num_draws))
    metadata = build(rows * num_draws, vocab_size=5)
    tokens = Sampler()(logits, metadata, default_generator=seeded(0)).sampled_token_ids
    tokens = tokens.view(num_draws, len(rows))
    supports = [set(tokens[:, row].tolist()) for row in range(len(rows))]
    assert supports == [{2}, {0, 1, 2, 3, 4}, {2, 4}, {2, 4, 0}]


# --- penalties ---------------------------------------------------------------------------


def test_apply_penalties_matches_hand_computed_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    pad = 4  # vocab_size
    prompt_token_ids = torch.tensor([[0, 1], [pad, pad]])
    output_token_ids = torch.tensor([[2, 2, 1], [3, pad, pad]])
    penalized = apply_penalties(
        logits,
        prompt_token_ids,
        output_token_ids,
        presence_penalties=torch.tensor([0.5, 0.0]),
        frequency_penalties=torch.tensor([0.25, 0.0]),
        repetition_penalties=torch.tensor([2.0, 1.0]),
    )
    expected = torch.tensor(
        [
            [
                2.0 / 2.0,  # prompt token, positive: divided by repetition penalty
                -1.0 * 2.0 - 0.5 - 0.25 * 1,  # in prompt and output once
                0.5 / 2.0 - 0.5 - 0.25 * 2,  # output twice
                3.0,  # never seen
            ],
            [2.0, -1.0, 0.5, 3.0],  # no penalties
        ]
    )
    torch.testing.assert_close(penalized, expected)


def test_repetition_penalty_over_prompt_flips_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    # Token 0 appears in the prompt: 3.0 / 2.0 = 1.5 < 2.0, so token 1 wins.
    metadata = build([SamplingParams(temperature=0.0, repetition_penalty=2.0)], 3, prompts=[[0]])
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [1]


def test_frequency_penalty_counts_output_occurrences():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    # Token 0 generated once: 3.0 - 0.6 = 2.4 > 2.0, still chosen.
    once = build([params], 3, outputs=[[0]])
    assert Sampler()(logits, once).sampled_token_ids.tolist() == [0]
    # Generated twice: 3.0 - 1.2 = 1.8 < 2.0, token 1 wins.
    twice = build([params], 3, outputs=[[0, 0]])
    assert Sampler()(logits, twice).sampled_token_ids.tolist() == [1]


def test_presence_penalty_ignores_prompt_tokens():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=1.5)
    in_prompt = build([params], 3, prompts=[[0]])
    assert Sampler()(logits, in_prompt).sampled_token_ids.tolist() == [0]
    in_output = build([params], 3, outputs=[[0]])  # 3.0 - 1.5 = 1.5 < 2.0
    assert Sampler()(logits, in_output).sampled_token_ids.tolist() == [1]


# --- logit bias and min_tokens -----------------------------------------------------------


def test_logit_bias_forces_a_token():
    logits = torch.tensor([[5.0, 0.0, -3.0, 1.0]] * 200)
    greedy = build([SamplingParams(temperature=0.0, logit_bias={2: 100.0})] * 200, 4)
    assert set(Sampler()(logits, greedy).sampled_token_ids.tolist()) == {2}
    random = build([SamplingParams(temperature=1.5, logit_bias={2: 100.0})] * 200, 4)
    tokens = Sampler()(logits, random, default_generator=seeded(0)).sampled_token_ids
    assert set(tokens.tolist()) == {2}


def test_negative_logit_bias_bans_a_token():
    logits = torch.tensor([[5.0, 0.0, 4.0]])
    metadata = build([SamplingParams(temperature=0.0, logit_bias={0: -100.0})], 3)
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [2]


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    eos = 0
    logits = torch.tensor([[9.0, 8.0, 1.0, 0.0]])  # EOS, then stop token 1, are most likely
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1])
    early = build([params], 4, outputs=[[2]], eos_token_id=eos)
    assert Sampler()(logits, early).sampled_token_ids.tolist() == [2]
    reached = build([params], 4, outputs=[[2, 3, 2]], eos_token_id=eos)
    assert Sampler()(logits, reached).sampled_token_ids.tolist() == [eos]


def test_min_tokens_does_not_suppress_eos_when_ignoring_eos():
    logits = torch.tensor([[9.0, 8.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    metadata = build([params], 3, outputs=[[]], eos_token_id=0)
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [0]


# --- logprobs ----------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0], [0.2, 0.1, 0.0, 0.3, 0.4]])
    params = [
        # Bias and penalty change the sampled token, not the reported distribution.
        SamplingParams(temperature=0.0, logit_bias={2: 10.0}, logprobs=3),
        SamplingParams(temperature=0.5, repetition_penalty=3.0, logprobs=1),
    ]
    metadata = build(params, 5, prompts=[[1], [4]])
    out = Sampler()(logits, metadata, default_generator=seeded(0))
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None
    sampled = out.sampled_token_ids
    assert sampled[0].item() == 2
    expected_sampled = expected.gather(1, sampled[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs.sampled_logprobs, expected_sampled)
    assert out.logprobs.top_logprobs.shape == (2, 3)  # K = max asked in the batch
    assert out.logprobs.top_token_ids.tolist()[0] == [1, 2, 0]
    assert out.logprobs.top_token_ids.tolist()[1] == [4, 3, 0]
    expected_top = expected.gather(1, out.logprobs.top_token_ids)
    torch.testing.assert_close(out.logprobs.top_logprobs, expected_top)


def test_top_logprobs_are_sorted_descending():
    logits = torch.randn(4, 64, generator=seeded(9))
    metadata = build([SamplingParams(temperature=1.0, logprobs=10)] * 4, 64)
    out = Sampler()(logits, metadata, default_generator=seeded(1))
    top = out.logprobs.top_logprobs
    assert torch.all(top[:, :-1] >= top[:, 1:])


def test_sampled_rank_counts_strictly_more_likely_tokens():
    logits = torch.tensor([[0.5, 3.0, 2.0, 1.0]] * 4)
    # Force each token in turn; its raw rank is fixed by the logits above.
    params = [SamplingParams(temperature=0.0, logit_bias={t: 100.0}, logprobs=0) for t in range(4)]
    out = Sampler()(logits, build(params, 4))
    assert out.sampled_token_ids.tolist() == [0, 1, 2, 3]
    assert out.logprobs.sampled_ranks.tolist() == [4, 1, 2, 3]
    assert out.logprobs.top_token_ids.shape == (4, 0)


def test_logprobs_zero_for_a_greedy_batch_still_returns_sampled_logprob():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    metadata = build([SamplingParams(temperature=0.0, logprobs=0)], 2)
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.tolist() == [1]
    torch.testing.assert_close(out.logprobs.sampled_logprobs, torch.tensor([math.log(0.75)]))
    assert out.logprobs.sampled_ranks.tolist() == [1]


# --- malformed input ---------------------------------------------------------------------


def test_rejects_logits_that_are_not_2d():
    metadata = build([SamplingParams()], 4)
    with pytest.raises(ValueError, match="2-D"):
        Sampler()(torch.zeros(4), metadata)


def test_rejects_row_count_mismatch():
    metadata = build([SamplingParams()] * 2, 4)
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(3, 4), metadata)


def test_rejects_vocab_size_mismatch():
    metadata = build([SamplingParams()], 4)
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler()(torch.zeros(1, 5), metadata)


def test_build_rejects_list_length_mismatch():
    with pytest.raises(ValueError, match="output_token_ids"):
        SamplingMetadata.build(
            [SamplingParams()] * 2,
            prompt_token_ids=[[], []],
            output_token_ids=[[]],
            generators=[None, None],
            eos_token_id=None,
            vocab_size=4,
            device=CPU,
        )


def test_build_rejects_logit_bias_outside_vocabulary():
    with pytest.raises(ValueError, match="logit_bias"):
        build([SamplingParams(logit_bias={10: 1.0})], 4)


@pytest.mark.parametrize("seed", range(4))
def test_top_k_top_p_from_candidates_keeps_the_exact_nucleus_on_a_real_sized_vocabulary(seed):
    """Rows settled among their 256 most likely tokens (peaked rows, a top-k past 256 that
    widens the cut, a grammar mask), among 4,096 (a nucleus of ~1-3 thousand tokens), and
    rows whose whole vocabulary is sorted (a nucleus of thousands more) keep exactly the
    tokens, and logits, that a float64 sort of every row keeps; rows without truncation come
    back unchanged."""
    from pdserve.engine.sample.logits_processors import (TOP_CANDIDATE_SIZES,
                                                         apply_top_k_top_p, sort_top_k_top_p)

    vocab = 49152
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([8.0, 6.0, 3.0, 5.0, 4.0, 1.0, 7.0, 2.5, 0.05]).unsqueeze(1)
    logits = torch.randn(9, vocab, generator=gen) * scale
    logits[6, torch.randperm(vocab, generator=gen)[:vocab - 100]] = float("-inf")  # grammar
    top_k = torch.tensor([0, 1000, 0, 50, 0, 0, 0, 0, 0])
    top_p = torch.tensor([0.9, 0.95, 0.8, 1.0, 1.0, 0.5, 0.99, 0.8, 0.95])
    got = apply_top_k_top_p(logits, top_k, top_p)
    exact = sort_top_k_top_p(logits.double(), torch.where(top_k > 0, top_k, vocab),
                             top_p.double())
    assert torch.equal(got.isfinite(), exact.isfinite())
    assert torch.equal(got[got.isfinite()], logits[exact.isfinite()])
    kept = got.isfinite().sum(dim=1)
    small, large = TOP_CANDIDATE_SIZES
    assert small < kept[2] <= large and small < kept[7] <= large  # the second size
    assert kept[5] > large and kept[8] > large  # sorted whole
    assert kept[1] <= 1000 and kept[3] == 50 and kept[6] <= 100
    assert torch.equal(got[4], logits[4])  # top_p 1.0, no top_k: untouched
    assert torch.equal(apply_top_k_top_p(logits, None, top_p)[[0, 2, 7]], got[[0, 2, 7]])


def test_top_k_top_p_of_no_rows_is_no_rows():
    """A verification step can hold no draft rows: nothing to cut, nothing raised."""
    from pdserve.engine.sample.logits_processors import apply_top_k_top_p

    empty = torch.empty(0, 49152)
    out = apply_top_k_top_p(empty, torch.empty(0, dtype=torch.int64), torch.empty(0))
    assert out.shape == (0, 49152)
