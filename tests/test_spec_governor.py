"""The speculation governor: drafting on or off per batch size by measured tokens/s, and
the engine staying lossless while it switches."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.spec_decode import governor as gov
from pdserve.engine.spec_decode.governor import SpecGovernor


def _drive(governor: SpecGovernor, steps: int, on_rate, off_rate, batch: int = 1,
           seed: int = 0) -> list[bool]:
    """Runs ``steps`` decide/propose/observe rounds where a drafted step emits at
    ``on_rate(i)`` tokens/s and a plain one at ``off_rate(i)`` (10 % noise); the decisions."""
    rng = random.Random(seed)
    decisions = []
    for i in range(steps):
        drafted = governor.decide(batch)
        decisions.append(drafted)
        rate = (on_rate(i) if drafted else off_rate(i)) * rng.uniform(0.9, 1.1)
        tokens = batch * (3 if drafted else 1)
        governor.proposed(0.1 * tokens / rate)
        governor.observe(batch, True, tokens, 0.9 * tokens / rate)
    return decisions


def test_drafts_first_then_keeps_the_faster_mode_and_probes_rarely():
    slower = _drive(SpecGovernor(), 3000, lambda i: 80.0, lambda i: 100.0)
    assert all(slower[:gov.WARMUP_SAMPLES])  # drafts first
    probes = gov.PROBE_LEN / gov.PROBE_EVERY[1]  # share of decisions probing, at least
    tail = slower[500:]
    assert sum(tail) / len(tail) < 1.2 * probes  # drafting measured slower: off but probes
    assert any(tail)  # ... which keep coming
    faster = _drive(SpecGovernor(), 3000, lambda i: 130.0, lambda i: 100.0)
    tail = faster[500:]
    assert sum(tail) / len(tail) > 1 - 1.2 * probes and not all(tail)


def test_follows_a_change_in_which_mode_pays():
    decisions = _drive(SpecGovernor(), 2000, lambda i: 150.0 if i < 1000 else 60.0,
                       lambda i: 100.0)
    assert sum(decisions[800:1000]) / 200 > 0.95
    # the next probe (at most PROBE_EVERY[1] decisions away) sees drafting lose
    after = decisions[1000 + gov.PROBE_EVERY[1] + 2 * gov.PROBE_LEN:]
    assert sum(after) / len(after) < 0.05


def test_a_bad_phase_does_not_turn_off_drafting_that_pays_on_average():
    """Acceptance comes in phases: 40 steps where drafting loses (80 tokens/s against 100),
    40 where it wins (200): on average (114 tokens/s over both) drafting pays, and it stays on through the bad
    phases (a governor that follows each phase turns off in a bad one and misses the
    good one that follows until its next probe)."""
    decisions = _drive(SpecGovernor(), 3000, lambda i: 80.0 if i // 40 % 2 == 0 else 200.0,
                       lambda i: 100.0)
    tail = decisions[200:]
    assert sum(tail) / len(tail) > 0.9


def test_batch_sizes_are_measured_apart():
    governor = SpecGovernor()
    for i in range(600):  # drafting pays at batch 1, not at batch 2
        for batch, on, off in ((1, 150.0, 100.0), (2, 150.0, 200.0)):
            drafted = governor.decide(batch)
            rate = on if drafted else off
            governor.proposed(0.0)
            governor.observe(batch, True, 10, 10 / rate)
    assert governor.rates(1)[1] > governor.rates(1)[0]
    assert governor.rates(2)[0] > governor.rates(2)[1]
    ones = [governor.decide(1) for _ in range(20)]
    twos = [governor.decide(2) for _ in range(20)]
    assert sum(ones) >= 17 and sum(twos) <= 3  # the choice, but for a probe


def test_steps_that_do_not_match_the_decision_are_not_counted():
    governor = SpecGovernor()
    governor.decide(2)
    governor.observe(3, True, 5, 0.01)  # a request joined: another batch size
    governor.decide(2)
    governor.observe(2, False, 5, 0.01)  # a prefill ran in the step
    governor.decide(2)
    governor.observe(2, True, 0, 0.01)  # nothing emitted
    assert governor.rates(2) == (None, None)
    governor.decide(2)
    governor.proposed(0.01)
    governor.observe(2, True, 4, 0.03)
    assert governor.rates(2) == (None, pytest.approx(100.0))


def test_config_resolves_when_the_governor_runs():
    assert EngineConfig(speculative_method="ngram").spec_adaptive
    assert not EngineConfig(speculative_method="none").spec_adaptive
    assert not EngineConfig(speculative_method="ngram", speculative_adaptive=False).spec_adaptive
    # "draft at every batch" is a request for drafts: the governor stays out of it
    assert not EngineConfig(speculative_method="ngram",
                            speculative_disable_by_batch_size=0).spec_adaptive


def test_engine_stays_lossless_while_the_governor_measures_both_modes(tiny_llama_checkpoint):
    """A real engine with the governor on: greedy tokens equal plain decoding's through
    the switches, and both modes got measured at batch 1."""
    prompt = [[5, 6, 7] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    path = str(tiny_llama_checkpoint[0])
    plain = LLM(path, dtype="float32", load_progress=False)
    expected = plain.generate(prompt, params, detokenize=False)[0].outputs[0].token_ids
    llm = LLM(path, dtype="float32", load_progress=False,
              speculative_method="ngram", num_speculative_tokens=4,
              speculative_disable_by_batch_size=4)
    got = llm.generate(prompt, params, detokenize=False)[0].outputs[0].token_ids
    assert got == expected
    governor = llm.engine.governor
    assert governor is not None and governor.num_decisions[1] >= gov.WARMUP_SAMPLES
    off, on = governor.rates(1)
    assert off is not None and on is not None and off > 0 and on > 0
    assert llm.engine.spec_stats.num_drafts > 0
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
