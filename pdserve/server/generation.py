"""Server-side generation of one request's ``n`` choices: submit to the router, turn token
deltas into text (incremental detokenization, stop strings), time TTFT/ITL, abort on exit.

``submit`` places every choice first (so "no worker" becomes a 503 before any response
byte is sent); ``events`` then yields :class:`ChoiceEvent` objects from all choices,
interleaved as they arrive. Leaving the iterator early (client gone) aborts every
unfinished choice in its worker, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, TypeVar

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.router import RequestHandle, Router
from pdserve.server.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.server.metrics import ServerMetrics

T = TypeVar("T")


@dataclass
class ChoiceEvent:
    """New output of one choice.

    Attributes:
        index: the choice index (0 .. n-1).
        text: new text (already trimmed at a stop string).
        token_ids: new token ids.
        logprobs: their logprobs when requested.
        finish_reason: ``stop``/``length`` on the choice's last event, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Interleave several async iterators as items arrive.

    The first exception of any stream is raised to the consumer; leaving early (or an
    exception) cancels every stream's pump task.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
            queue.put_nowait(done)
        except BaseException as exc:  # surfaced to the consumer below
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class ChoiceState:
    """One choice in flight: its router handle, its text state and progress.

    Attributes:
        handle: the choice's request at the router (each choice is its own request,
            ``{request_id}-{index}``).
        detokenizer: its token ids -> text deltas.
        stop: its stop-string matcher.
        stop_token_ids: tokens that end it without being output as text.
        num_tokens: tokens generated so far.
        done: set when its last delta arrives (finished or stopped); a choice not done
            when :meth:`Generation.events` exits is aborted.
    """

    handle: RequestHandle
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    stop_token_ids: frozenset[int] = frozenset()
    num_tokens: int = 0
    done: bool = False


@dataclass
class Generation:
    """A request's choices in flight. Iterate :meth:`events`; read usage afterwards."""

    router: Router
    metrics: ServerMetrics
    prompt_token_ids: list[int]
    choices: list[ChoiceState]
    start_s: float
    num_cached_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_reasons: list[str | None] = field(default_factory=list)
    #: prompt tokens 1.. scored by the model, when the request asked (first delta)
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt (shared by every choice)."""
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated so far, summed over the choices."""
        return sum(c.num_tokens for c in self.choices)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """All choices' events, interleaved as they arrive; aborts leftovers on exit."""
        try:
            async for ev in merge_streams([self._choice_events(i)
                                           for i in range(len(self.choices))]):
                yield ev
            self._record_success()
        finally:
            for c in self.choices:
                if not c.done:
                    self.router.abort(c.handle.request_id)

    async def _choice_events(self, index: int) -> AsyncIterator[ChoiceEvent]:
        c = self.choices[index]
        m = self.metrics
        async for delta in c.handle:
            now = time.monotonic()
            if self.first_token_s is None:
                self.first_token_s = now
                m.time_to_first_token.labels(m.model_name).observe(now - self.start_s)
            if index == 0 and c.num_tokens == 0:  # the first choice's, whichever came first
                self.num_cached_tokens = delta.num_cached_tokens
            elif index == 0 and self.last_token_s is not None:
                m.inter_token_latency.labels(m.model_name).observe(now - self.last_token_s)
            if index == 0:
                self.last_token_s = now
            if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = list(delta.prompt_logprobs)
            if delta.queue_time_s is not None and index == 0:
                m.request_queue_time.labels(m.model_name).observe(delta.queue_time_s)
            out, stopped = _text_delta(c, delta)
            finish = delta.finish_reason
            if stopped:
                self.router.abort(c.handle.request_id)
                finish = "stop"
            elif finish is not None:
                out += c.stop.flush()
            if finish is not None:
                c.done = True
                if finish == "abort":
                    finish = "stop"
            yield ChoiceEvent(index, out, list(delta.new_token_ids), delta.new_logprobs, finish)
            if finish is not None:
                self.finish_reasons.append(finish)
                return

    def _record_success(self) -> None:
        m = self.metrics
        name = m.model_name
        m.prompt_tokens.labels(name).inc(self.num_prompt_tokens)
        m.generation_tokens.labels(name).inc(self.num_completion_tokens)
        for reason in self.finish_reasons:
            m.request_success.labels(name, reason).inc()
        m.e2e_request_latency.labels(name).observe(time.monotonic() - self.start_s)


def _text_delta(c: ChoiceState, delta) -> tuple[str, bool]:
    """The text ``delta`` adds to choice ``c`` after its stop strings and tokens, and
    whether a stop string ended it. Tokens still under ``min_tokens`` go through the stop
    matcher apart from the rest (a delta may carry several tokens)."""
    before = c.num_tokens
    c.num_tokens += len(delta.new_token_ids)
    ids = delta.new_token_ids
    if delta.finish_reason == "stop" and ids and ids[-1] in c.stop_token_ids \
            and not c.stop.include_stop:  # a stop token's text is not output (vLLM)
        ids = ids[:-1]
    early = max(0, min(len(ids), c.stop.min_tokens - 1 - before))
    out = ""
    if early:  # cannot stop: fewer than min_tokens tokens
        out, _ = c.stop.process(c.detokenizer.add_tokens(ids[:early]), before + early)
    text = c.detokenizer.add_tokens(ids[early:])
    if delta.finished:
        text += c.detokenizer.flush()
    rest, stopped = c.stop.process(text, c.num_tokens)
    return out + rest, stopped


def submit(router: Router, metrics: ServerMetrics, tokenizer, request_id: str,
           prompt_token_ids: list[int], params: SamplingParams, stop: list[str],
           include_stop: bool = False) -> Generation:
    """Place all ``params.n`` choices on workers (when the first is prefilled remotely, the
    others wait for its KV on its decode worker: one prefill for all of them). ``stop``
    strings (and ``params.stop_token_ids``' text) end the text, included with
    ``include_stop``; they are checked once ``params.min_tokens`` tokens are out.

    Raises:
        NoWorkerAvailable: no worker can take them (nothing is left placed).
    """
    start = time.monotonic()
    choices: list[ChoiceState] = []
    try:
        for i in range(params.n):
            sub = dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            handle = router.add_request(f"{request_id}-{i}", prompt_token_ids, sub,
                                        sibling=choices[0].handle if choices else None)
            choices.append(ChoiceState(
                handle, IncrementalDetokenizer(tokenizer, prompt_token_ids),
                StopStringMatcher(stop, include_stop, params.min_tokens),
                frozenset(params.stop_token_ids)))
    except Exception:
        for c in choices:
            router.abort(c.handle.request_id)
        raise
    return Generation(router, metrics, list(prompt_token_ids), choices, start)
