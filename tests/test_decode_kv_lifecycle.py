"""The decode side of a remote prefill as a state machine (pdserve/decode_worker/kv_lifecycle.py):
every (state, event) pair against a hand-written table, deadlines per state, and on a real
decode worker (SmolLM2, real KV inbox and sender thread on the inproc transport, the test
playing the router on a real zmq socket) a transfer that stalls past its deadline frees its
blocks, is reported, recomputes and completes with the greedy tokens, leaking no block."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from pdserve.decode_worker.kv_lifecycle import (
    STATE_DEADLINES, TRANSITIONS, KVDeadlines, KVEvent, KVState, RemoteKV)

S, E = KVState, KVEvent

# The specification, written out by hand: row = state, columns in EVENTS order; "-" = ignored.
EVENTS = [E.FIRST_TOKEN, E.KV_COMPLETE, E.INSTALLED, E.KV_BAD, E.DEADLINE, E.RESUME, E.ABORT]
SPEC = """
reserved     receiving  ready  -        failed  failed   recomputing  aborted
receiving    -          ready  -        failed  failed   recomputing  aborted
ready        ready      -      running  failed  failed   recomputing  aborted
running      -          -      -        -       -        -            -
failed       -          -      -        -       aborted  recomputing  aborted
recomputing  -          -      -        -       -        -            -
aborted      -          -      -        -       -        -            -
"""
EXPECTED = {(S(row[0]), event): (None if cell == "-" else S(cell))
            for row in (line.split() for line in SPEC.strip().splitlines())
            for event, cell in zip(EVENTS, row[1:])}


def test_the_spec_covers_every_state_and_event():
    assert set(EXPECTED) == {(s, e) for s in S for e in E}


@pytest.mark.parametrize("state,event", sorted(EXPECTED, key=lambda p: (p[0].value,
                                                                        p[1].value)))
def test_every_state_event_pair(state, event):
    entry = RemoteKV(num_prompt_tokens=10, state=state, entered_s=100.0)
    got = entry.fire(event, now_s=200.0)
    want = EXPECTED[(state, event)]
    assert got is want
    assert entry.state is (state if want is None else want)
    # a change of state restarts the clock; a self-transition or an ignored event does not
    assert entry.entered_s == (200.0 if want not in (None, state) else 100.0)
    assert ((state, event) in TRANSITIONS) == (want is not None)


def test_each_state_has_its_own_deadline_and_final_states_none():
    limits = KVDeadlines(reserved_s=1.0, receiving_s=2.0, ready_s=3.0, failed_s=4.0)
    want = {S.RESERVED: 1.0, S.RECEIVING: 2.0, S.READY: 3.0, S.FAILED: 4.0,
            S.RUNNING: None, S.RECOMPUTING: None, S.ABORTED: None}
    for state in S:
        entry = RemoteKV(num_prompt_tokens=1, state=state, entered_s=10.0)
        limit = want[state]
        assert entry.deadline_s(limits) == (None if limit is None else 10.0 + limit), state
    assert set(STATE_DEADLINES) == set(S)
    no_limit = RemoteKV(num_prompt_tokens=1, state=S.RECEIVING, entered_s=10.0)
    assert no_limit.deadline_s(KVDeadlines(receiving_s=0)) is None  # 0: no deadline
    with pytest.raises(ValueError, match="ready_s"):
        KVDeadlines(ready_s=-1)


def test_only_waiting_states_accept_kv_messages():
    assert {s for s in S if RemoteKV(1, state=s).accepts_kv} == {S.RESERVED, S.RECEIVING}


# --- on a real decode worker --------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    from pdserve.engine import LLM
    from pdserve.engine.loader import DEFAULT_MODEL

    return LLM(DEFAULT_MODEL, dtype="float32", load_progress=False, block_size=16,
               max_num_batched_tokens=256, num_kv_blocks=64,
               max_model_len=1024).engine


class RouterEnd:
    """The router's end of the worker's link: a real ROUTER socket and the real codec."""

    def __init__(self) -> None:
        from pdserve.messages import MessageCodec

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.codec = MessageCodec()

    def messages(self, timeout_s: float = 0.5) -> list:
        out = []
        while self.sock.poll(int(timeout_s * 1000)):
            _, data = self.sock.recv_multipart()
            out.append(self.codec.decode_to_router(data))
            timeout_s = 0.05
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _run_worker(worker) -> dict[str, list[int]]:
    """The worker loop's engine half: step until idle, tokens per request."""
    tokens: dict[str, list[int]] = {}
    while worker.engine.has_unfinished_requests:
        for d in worker.engine.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    return tokens


def _send_layers(worker, sender, rid: str, prompt: list[int], layers: range) -> None:
    """P's real sender thread pushes ``layers`` of a prompt's KV (random values: they are
    never decoded from) to the worker's inbox, then stops: a stalled transfer."""
    from pdserve.prefill_worker.kv_sender import KVJob

    eng = worker.engine
    n = eng.block_manager.num_blocks_for(len(prompt))
    shape = (1, 2, n, 16, eng.runner.kv_cache.shape[4], eng.runner.kv_cache.shape[5])
    for layer in layers:
        sender.submit(KVJob(rid, torch.randn(shape), len(prompt), worker.inbox.address,
                            layer_start=layer, num_layers=eng.arch.num_layers))


@pytest.fixture
def worker(engine):
    """(decode worker, the router's end of its link, a prefill worker's KV sender thread,
    the sender's reports)."""
    import queue

    from pdserve.decode_worker.worker import DecodeWorker
    from pdserve.prefill_worker.kv_sender import KVSenderThread

    router = RouterEnd()
    w = DecodeWorker(engine, router.address, "d-test", "m", kv_transport="inproc",
                     kv_deadlines=KVDeadlines(receiving_s=0.5, ready_s=0.5, failed_s=5.0))
    reports: queue.Queue = queue.Queue()
    sender = KVSenderThread("inproc", True, 5.0, lambda *a: reports.put(a))
    sender.transport = w.inbox.transport  # inproc: the receiver's queues live there
    yield w, router, sender, reports
    sender.close()
    w.close()
    w.ctx.destroy(linger=0)
    router.close()


def _prompt(seed: int, n: int = 200) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 5000, (n,), generator=g).tolist()


def test_a_stalled_receive_frees_its_blocks_and_the_request_recomputes(worker):
    from pdserve.engine import SamplingParams
    from pdserve.messages import ExpectRemoteKV, FirstToken, KVTransferFailed, ResumeLocally

    w, router, sender, reports = worker
    eng = w.engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = _prompt(1)
    eng.add_request("local", prompt, params)  # the answer a local prefill gives
    expected = _run_worker(w)["local"]
    free0 = eng.num_free_blocks

    w.handle(ExpectRemoteKV("r", prompt, params, time.time()))
    assert w.remote["r"].state is S.RESERVED
    assert eng.num_free_blocks == free0 - eng.block_manager.num_blocks_for(len(prompt))
    _send_layers(w, sender, "r", prompt, range(eng.arch.num_layers // 2))  # half, then silence
    w.handle(FirstToken("r", expected[0]))
    assert w.remote["r"].state is S.RECEIVING
    half = eng.arch.num_layers // 2
    deadline = time.monotonic() + 30
    while w.inbox.num_layers_received("r") < half and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.inbox.num_layers_received("r") == half  # layers held, waiting for the rest

    w.poll_extra()
    assert w.remote["r"].state is S.RECEIVING  # not yet past its 0.5 s
    time.sleep(0.6)
    w.poll_extra()
    assert w.remote["r"].state is S.FAILED
    assert eng.num_free_blocks == free0  # blocks back at once, before the router answers
    assert "r" not in w.inbox._partial
    failures = [m for m in router.messages() if isinstance(m, KVTransferFailed)]
    assert [(m.request_id, m.reason) for m in failures] == [("r", "timeout")]

    dropped = w.inbox.num_dropped  # the rest of the KV, late: dropped unread
    _send_layers(w, sender, "r", prompt, range(eng.arch.num_layers // 2, eng.arch.num_layers))
    deadline = time.monotonic() + 10
    while w.inbox.num_dropped == dropped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.inbox.num_dropped > dropped
    report = reports.get(timeout=10)  # P saw its push go through: D dropped it, unread
    assert (report[0], report[3]) == ("r", None)

    w.handle(ResumeLocally("r", [expected[0]]))  # the router's answer: recompute
    assert "r" not in w.remote
    assert [expected[0]] + _run_worker(w)["r"] == expected
    assert eng.num_free_blocks == free0 and not eng.requests  # nothing leaked


def test_abort_while_receiving_frees_the_blocks(worker):
    from pdserve.engine import SamplingParams
    from pdserve.messages import ExpectRemoteKV, FirstToken

    w = worker[0]
    eng = w.engine
    free0 = eng.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    w.handle(ExpectRemoteKV("a", _prompt(2), params, time.time()))
    w.handle(FirstToken("a", 42))
    assert eng.num_free_blocks < free0
    w.abort("a")
    assert "a" not in w.remote and "a" not in eng.requests
    assert eng.num_free_blocks == free0


def test_a_failed_engine_step_fails_its_requests_and_keeps_the_worker(worker, monkeypatch):
    """An engine step that raises (an engine bug, injected here) fails every request in the
    engine through the worker's own abort: each is reported; a remote one waiting for its
    KV leaves its lifecycle too (KV arriving later is dropped, never written into blocks
    that were freed); every block comes back and the next steps serve."""
    from pdserve.engine import SamplingParams
    from pdserve.messages import ExpectRemoteKV, GenerateRequest, RequestFailed

    w, router = worker[0], worker[1]
    eng = w.engine
    free0 = eng.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    w.handle(GenerateRequest("x", _prompt(3), params, time.time()))
    w._step()  # x prefilled: it holds blocks
    assert eng.num_free_blocks < free0
    w.handle(ExpectRemoteKV("r", _prompt(4), params, time.time()))
    router.messages()
    real_step = eng.step

    def failing_step():
        monkeypatch.setattr(eng, "step", real_step)  # once
        raise RuntimeError("injected engine bug")

    monkeypatch.setattr(eng, "step", failing_step)
    w._step()
    failed = [m for m in router.messages() if isinstance(m, RequestFailed)]
    assert sorted((m.request_id, m.is_client_error) for m in failed) == [("r", False),
                                                                           ("x", False)]
    assert not eng.requests and "r" not in w.remote
    assert eng.num_free_blocks == free0
    w.handle(GenerateRequest("y", _prompt(5), params, time.time()))
    assert len(_run_worker(w)["y"]) == 4  # the worker still serves
    assert eng.num_free_blocks == free0 and not eng.requests


def test_a_request_sent_again_replaces_the_copy_the_router_gave_up_on(worker):
    """After a stall the router takes the worker for dead and, once it is back, retries its
    requests there under the same ids, with the tokens already streamed: the retry replaces
    the old copy (it was refused as "already in use" and the client's stream failed)."""
    from pdserve.engine import SamplingParams
    from pdserve.messages import GenerateRequest, RequestFailed

    w, router = worker[0], worker[1]
    eng = w.engine
    free0 = eng.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    w.handle(GenerateRequest("x", _prompt(6), params, time.time()))
    w._step()
    w._step()
    streamed = list(eng.requests["x"].output_token_ids)
    assert streamed
    w.handle(GenerateRequest("x", _prompt(6), params, time.time(), output_token_ids=streamed))
    assert not [m for m in router.messages() if isinstance(m, RequestFailed)]
    assert eng.requests["x"].output_token_ids == streamed
    _run_worker(w)
    assert eng.num_free_blocks == free0 and not eng.requests


def test_inbox_kv_writes_and_engine_steps_take_turns(worker, monkeypatch):
    """An inbox thread's KV write waits while an engine step runs, and goes between steps:
    both hold the worker's KV write lock. On shared cores a long prompt's KV written beside
    the decode worker's steps slowed them several times (a two-prompt prefill step 0.39 s
    instead of ~0.09; W3, twelfth session)."""
    import threading

    from pdserve.engine import SamplingParams
    from pdserve.messages import GenerateRequest

    w = worker[0]
    eng = w.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    w.handle(GenerateRequest("s", _prompt(5), params, time.time()))
    real_step = eng.step
    could_write = []  # whether another thread got the lock, during each step

    def try_lock() -> None:
        got = w._kv_write_lock.acquire(blocking=False)
        could_write.append(got)
        if got:
            w._kv_write_lock.release()

    def observed_step():
        t = threading.Thread(target=try_lock)
        t.start()
        t.join()
        return real_step()
    monkeypatch.setattr(eng, "step", observed_step)
    w._step()
    assert could_write == [False]
    try_lock()  # between steps: free
    assert could_write == [False, True]
    w.abort("s")


def test_a_sender_taking_turns_pushes_only_while_it_holds_the_cores(worker, tmp_path):
    """A prefill worker's KV sender that takes the core turns (``take_turns``, as ``serve``
    sets it where prefill and decode share the cores) withholds a push while another party
    holds the cores, and pushes once they are free: the FP8 encode and the push go between
    the workers' steps, not beside them."""
    import queue

    from pdserve.core_turns import CoreTurns
    from pdserve.engine import SamplingParams
    from pdserve.messages import ExpectRemoteKV

    w, _, sender, reports = worker
    sender.take_turns(tmp_path)
    other = CoreTurns(tmp_path)  # the decode worker's handle, say: another open file
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = _prompt(7)
    w.handle(ExpectRemoteKV("t", prompt, params, time.time()))
    with other.turn():
        _send_layers(w, sender, "t", prompt, range(w.engine.arch.num_layers))
        with pytest.raises(queue.Empty):
            reports.get(timeout=0.5)  # held back: the cores are taken
    rid, num_bytes, _, error, _ = reports.get(timeout=10)
    assert (rid, error) == ("t", None) and num_bytes > 0
    w.abort("t")
    other.close()
