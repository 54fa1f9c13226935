"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Each step has a token budget (``max_num_batched_tokens``). Running decodes are scheduled
first (one token each), then running prefills (a prompt longer than the budget in even
chunks, as few as hold it; at most ``long_prefill_chunk`` beside decodes), then waiting
requests in arrival order while the budget, ``max_num_seqs`` and free blocks allow. A
request gets blocks for all of its current tokens when admitted; decodes then grow one slot
at a time. When a decode cannot get a block, the newest running request is preempted: its
blocks are freed and it goes back to the front of the waiting queue to be recomputed.

Speculative decoding: a decode carrying ``k`` draft tokens is scheduled as ``1 + k`` tokens
(the last sampled token plus the drafts, all verified in one pass). Drafts are dropped (a
plain decode) when the budget or the free blocks cannot cover them; they never cause
preemption (the drafter reserves the slots its own K/V needs when it proposes). In the
batch, plain decodes come first, then verifying decodes, then prefills.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens ``[num_computed, num_computed + num_new)``."""

    request: Request
    num_new_tokens: int
    #: draft tokens verified this step (included in ``num_new_tokens``, after the real ones)
    spec_token_ids: list[int] = field(default_factory=list)
    #: ``[num_spec_tokens, vocab]`` fp32 draft distribution, None for point-mass drafts
    spec_draft_probs: torch.Tensor | None = None

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens verified this step (the tail of ``num_new_tokens``)."""
        return len(self.spec_token_ids)

    @property
    def is_sampling(self) -> bool:
        """True when this chunk reaches the request's last token, so a token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    """What one step computes; decodes (one new token) come first.

    ``num_prefill_tokens`` counts the prompt (or recomputed) tokens the step runs, a
    one-token prefill that rides the decode path (counted in ``num_decodes``) included.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        """True when nothing is scheduled (no forward runs)."""
        return not self.scheduled


class Scheduler:
    """Decides each step's batch. See the module docstring for the policy.

    Args:
        block_manager: the KV block pool.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_chunk: int | None = None  # a prefill's most tokens beside decodes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        """Requests holding blocks and scheduled each step (decoding or prefilling)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (new or preempted)."""
        return len(self.waiting)

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        """Queue a request to be prefilled (FCFS)."""
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Join a request whose prompt is already computed (its KV arrived from a prefill
        worker, blocks allocated) to the running batch; it decodes from the next step."""
        self.running.append(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_draft_computed = 0
        request.spec_token_ids = []
        request.spec_draft_probs = None
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        """The next step's batch, in the order of the module docstring; may preempt."""
        out = SchedulerOutput()
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        budget = self._schedule_decodes(out, decoding, self.max_num_batched_tokens)
        cap = min(self.max_num_batched_tokens, decoding and self.long_prefill_chunk or 1 << 62)
        self._admit_waiting(out, self._schedule_prefill_chunks(out, prefilling, budget, cap), cap)
        return out

    def _schedule_decodes(self, out: SchedulerOutput, decoding: list[Request],
                          budget: int) -> int:
        """Decodes, plain ones first, then those verifying drafts; returns the budget left.
        A decode that finds no block preempts the newest running request (maybe itself)."""
        bm = self.block_manager
        verifying: list[ScheduledRequest] = []
        for req in decoding:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            spec = req.spec_token_ids[: budget - 1]
            probs = None if req.spec_draft_probs is None else req.spec_draft_probs[: len(spec)]
            req.spec_token_ids, req.spec_draft_probs = [], None
            num_new = 1 + len(spec)
            if spec and not bm.can_append(req, num_new):
                spec, probs, num_new = [], None, 1
            while not bm.can_append(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            bm.append_slots(req, num_new)
            if spec:
                verifying.append(ScheduledRequest(req, num_new, spec, probs))
            else:
                out.scheduled.append(ScheduledRequest(req, 1))
            budget -= num_new
        out.num_decodes = len(out.scheduled)
        out.scheduled.extend(verifying)
        return budget

    def _chunk(self, req: Request, budget: int, cap: int) -> int:
        """Tokens of ``req``'s prefill to run now: all left if they fit ``cap``, else an even
        share of the fewest steps (rounded up to 32 rows, the GEMM padding), at most ``budget``
        (2-core Xeon, 3,000 tokens: 2,048 + 952 took 700-721 ms, 1,504 + 1,496 660-690)."""
        left = req.num_tokens - req.num_computed_tokens
        steps = -(-left // cap)
        return min(left, budget, cap, (-(-left // steps) + 31) // 32 * 32)

    def _schedule_prefill_chunks(self, out: SchedulerOutput, prefilling: list[Request],
                                 budget: int, cap: int) -> int:
        """The next chunk of each running prefill; returns the budget left."""
        for req in prefilling:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            num_new = self._chunk(req, budget, cap)
            out.scheduled.append(ScheduledRequest(req, num_new))
            out.num_prefill_tokens += num_new
            budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, cap: int) -> None:
        """Admit waiting requests in order while budget, ``max_num_seqs`` and blocks allow
        (none in a step that preempted)."""
        bm = self.block_manager
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            if not bm.can_allocate(req):
                break
            self.waiting.popleft()
            bm.allocate(req)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_s is None:
                req.first_scheduled_s = time.monotonic()
            if req.num_cached_tokens == 0 and req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            self.running.append(req)
            num_new = self._chunk(req, budget, cap)
            scheduled = ScheduledRequest(req, num_new)
            if num_new == 1 and out.num_decodes == len(out.scheduled):  # no verifying ones
                out.num_decodes += 1  # a one-token prefill can ride the decode path
            out.scheduled.append(scheduled)
            out.num_prefill_tokens += num_new
            budget -= num_new

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished, drop from the queues and free its blocks at once."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
