"""Chunked prefill cuts a prompt longer than the step budget into even chunks (the fewest
steps that hold what is left, each rounded up to 32 rows; every step evens the rest again),
within whatever budget a step has left."""

from __future__ import annotations

import torch

from pdserve.engine import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler


def request(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), SamplingParams(), 4, (0,), torch.device("cpu"))


def chunks(scheduler: Scheduler, req: Request) -> list[int]:
    """Every step's share of ``req`` until its prompt is computed (no sampling)."""
    sizes = []
    while req.num_computed_tokens < req.num_prompt_tokens:
        out = scheduler.schedule()
        (mine,) = [s for s in out.scheduled if s.request is req]
        assert mine.num_new_tokens > 0
        sizes.append(mine.num_new_tokens)
        req.num_computed_tokens += mine.num_new_tokens
    return sizes


def scheduler(budget: int = 2048) -> Scheduler:
    return Scheduler(BlockManager(1024, 16, False), max_num_seqs=8,
                     max_num_batched_tokens=budget)


def test_a_prompt_that_fits_one_step_goes_whole():
    s = scheduler()
    r = request("a", 2048)
    s.add_request(r)
    assert chunks(s, r) == [2048]


def test_a_longer_prompt_goes_in_even_chunks_of_the_fewest_steps():
    for n, want in [(3000, [1504, 1496]), (2049, [1056, 993]), (5000, [1696, 1664, 1640]),
                    (4096, [2048, 2048])]:
        s = scheduler()
        r = request("a", n)
        s.add_request(r)
        assert chunks(s, r) == want, n
        assert sum(want) == n and max(want) <= 2048


def test_an_even_chunk_still_fits_the_budget_left_by_others():
    s = scheduler()
    first, long = request("first", 1000), request("long", 3000)
    s.add_request(first)
    s.add_request(long)
    out = s.schedule()  # 1,000 for the first prompt, 1,048 left of 2,048
    assert [x.num_new_tokens for x in out.scheduled] == [1000, 1048]
    long.num_computed_tokens += 1048
    first.num_computed_tokens = first.num_prompt_tokens
    assert chunks(s, long)[0] == 1952  # the 1,952 left fit one step


def test_beside_decodes_a_prefill_goes_in_chunks_of_at_most_long_prefill_chunk():
    """A decode worker's rule (``long_prefill_chunk``): while requests decode, each prefill
    chunk is at most the cap (the decodes wait for it), and a short prompt that arrives
    meanwhile is admitted in the same step with the budget left; with no decode, the
    prompt takes the whole budget again."""
    s = scheduler()
    s.long_prefill_chunk = 256
    dec, long, short = request("dec", 8), request("long", 1000), request("short", 40)
    s.add_request(dec)
    s.schedule()
    dec.num_computed_tokens = 8
    dec.append_output_token(1)  # sampled: it decodes from here
    s.add_request(long)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [
        ("dec", 1), ("long", 256)]  # 1,000 in four even chunks of 250, rounded up to 32
    long.num_computed_tokens += 256
    s.add_request(short)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [
        ("dec", 1), ("long", 256), ("short", 40)]
    long.num_computed_tokens += 256
    s.finish(dec, dec.status)  # no decode left: the rest of the prompt in one step
    s.finish(short, short.status)
    assert [x.num_new_tokens for x in s.schedule().scheduled] == [488]
