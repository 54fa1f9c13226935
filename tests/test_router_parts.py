"""The router's parts without workers: the routing policy over an in-memory registry, the
remote-prefill state machine (every transition, every ignored pair, each state's
deadline), and the router's handlers driven by encoded worker messages, with what it
would send recorded instead of sent (its socket is bound on loopback but no worker
connects)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time

import pytest

from pdserve.engine.block_manager import chain_block_hashes
from pdserve.engine.outputs import RequestDelta
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import (
    AbortRequests,
    ExpectRemoteKV,
    FirstToken,
    GenerateRequest,
    Heartbeat,
    KVCacheEvents,
    KVReserved,
    KVReserveRefused,
    KVSent,
    KVTransferFailed,
    MessageCodec,
    PrefillDone,
    PrefillRequest,
    RegisterWorker,
    ResumeLocally,
    StepOutputs,
)
from pdserve.router.policy import (
    FALLBACK,
    LOCAL,
    REMOTE_PREFILL,
    LengthPolicy,
    PredictedTTFTPolicy,
    RouteRequest,
    ThresholdPolicy,
)
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import WorkerRegistry
from pdserve.router.remote_prefill import (
    STATE_DEADLINES,
    TRANSITIONS,
    RemoteEvent,
    RemotePrefill,
    RemoteState,
)
from pdserve.router.router import Router, RoutingConfig, WorkerFailed

BLOCK = 16


def register(registry: WorkerRegistry, worker_id: str, role: str = "decode",
             kv_address: str | None = "tcp://127.0.0.1:1", running: int = 0,
             draining: bool = False, rate: float = 0.0, queued: int = 0):
    """A worker with a heartbeat: ``rate`` prefill tokens/s (0 unknown), ``queued`` prompt
    tokens waiting for their prefill."""
    worker = registry.register(RegisterWorker(
        worker_id=worker_id, role=role, model_name="m", max_model_len=4096,
        block_size=BLOCK, num_kv_blocks=256, pid=1, kv_address=kv_address))
    registry.heartbeat(Heartbeat(worker_id, running, 0, 100, 0.0, draining=draining,
                                 num_prefill_tokens_queued=queued,
                                 prefill_tokens_per_s=rate))
    return worker


class View:
    """A ClusterView over a registry and per-worker prefix indexes, as the router keeps."""

    def __init__(self) -> None:
        self.registry = WorkerRegistry()
        self.indexes: dict[str, PrefixIndex] = {}

    def accepting(self, role: str):
        return self.registry.accepting(role)

    def num_cached_tokens(self, worker, prompt):
        index = self.indexes.get(worker.worker_id)
        return 0 if index is None else index.num_cached_tokens(prompt)

    def cache(self, worker_id: str, prompt: list[int]) -> None:
        hashes = chain_block_hashes(prompt, BLOCK, [])
        self.indexes.setdefault(worker_id, PrefixIndex(BLOCK)).apply([True] * len(hashes),
                                                                     hashes)


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# -- policy --------------------------------------------------------------------------------
def test_threshold_policy_routes_by_uncached_length_and_load():
    view = View()
    policy = ThresholdPolicy(prefill_threshold=100)
    assert policy.route(RouteRequest("r", prompt(10)), view) is None  # no decode worker
    register(view.registry, "d0", running=3)
    register(view.registry, "d1", running=1)
    short = policy.route(RouteRequest("r", prompt(99)), view)
    assert (short.kind, short.decode.worker_id) == (LOCAL, "d1")  # least loaded
    # long, but no prefill worker: the decode worker prefills it
    assert policy.route(RouteRequest("r", prompt(100)), view).kind == FALLBACK
    register(view.registry, "p0", role="prefill", kv_address=None)
    long = policy.route(RouteRequest("r", prompt(100)), view)
    assert (long.kind, long.decode.worker_id) == (REMOTE_PREFILL, "d1")
    # prompt logprobs are computed where the prompt runs: always local
    assert policy.route(RouteRequest("r", prompt(500), True), view).kind == LOCAL


def test_threshold_policy_counts_only_uncached_tokens_and_prefers_the_holder():
    view = View()
    policy = ThresholdPolicy(prefill_threshold=100)
    register(view.registry, "d0")
    register(view.registry, "d1")
    register(view.registry, "p0", role="prefill", kv_address=None)
    history = prompt(480)
    view.cache("d1", history)
    follow_up = history + prompt(60, start=1000)  # 540 tokens, 480 of them on d1
    route = policy.route(RouteRequest("r", follow_up), view)
    assert (route.kind, route.decode.worker_id, route.num_cached_tokens) == (LOCAL, "d1", 480)
    # a worker without a KV address cannot receive pushed KV: fall back
    register(view.registry, "d1", kv_address=None)
    view.indexes.clear()
    assert policy.route(RouteRequest("r", prompt(300)), view).kind in (REMOTE_PREFILL,
                                                                       FALLBACK)


def test_length_policy_sends_a_long_prompt_away_even_when_cached():
    view = View()
    register(view.registry, "d0")
    register(view.registry, "p0", role="prefill", kv_address=None)
    history = prompt(480)
    view.cache("d0", history)
    follow_up = history + prompt(60, start=1000)
    assert ThresholdPolicy(100).route(RouteRequest("r", follow_up), view).kind == LOCAL
    route = LengthPolicy(100).route(RouteRequest("r", follow_up), view)
    assert (route.kind, route.num_cached_tokens) == (REMOTE_PREFILL, 480)
    assert LengthPolicy(100).route(RouteRequest("r", prompt(99)), view).kind == LOCAL
    assert RoutingConfig(policy="length").policy == "length"


def test_threshold_policy_skips_draining_workers_and_checks_its_threshold():
    view = View()
    register(view.registry, "d0", draining=True)
    assert ThresholdPolicy().route(RouteRequest("r", prompt(5)), view) is None
    register(view.registry, "d1")
    assert ThresholdPolicy().route(RouteRequest("r", prompt(5)), view).decode.worker_id == "d1"
    with pytest.raises(ValueError, match="prefill_threshold"):
        ThresholdPolicy(prefill_threshold=0)


def test_predicted_policy_routes_as_the_threshold_while_rates_are_unknown():
    view = View()
    policy = PredictedTTFTPolicy(prefill_threshold=100)
    register(view.registry, "d0", rate=1000.0, running=8)
    register(view.registry, "p0", role="prefill", kv_address=None)  # no rate yet
    # by cost a 50-token prompt would go remote (8 running requests wait 50 ms each)
    assert policy.route(RouteRequest("r", prompt(50)), view).kind == LOCAL
    assert policy.route(RouteRequest("r", prompt(100)), view).kind == REMOTE_PREFILL
    with pytest.raises(ValueError, match="prefill_threshold"):
        PredictedTTFTPolicy(prefill_threshold=0)


def test_predicted_policy_weighs_queues_rates_and_the_decode_workers_stall():
    """Costs by hand: local = (queued + uncached) / rate_D + running * uncached / rate_D;
    remote = (queued_P + prompt) / rate_P."""
    view = View()
    policy = PredictedTTFTPolicy(prefill_threshold=100)
    register(view.registry, "d0", rate=1000.0, running=0)
    register(view.registry, "p0", role="prefill", kv_address=None, rate=1000.0, queued=2000)
    # idle decode worker, busy prefill worker: 1,000 tokens local 1.0 s < remote 3.0 s
    assert policy.route(RouteRequest("r", prompt(1000)), view).kind == LOCAL
    # 4 running requests: local 1.0 + 4 * 1.0 = 5.0 s > remote 3.0 s
    register(view.registry, "d0", rate=1000.0, running=4)
    route = policy.route(RouteRequest("r", prompt(1000)), view)
    assert (route.kind, route.prefill.worker_id) == (REMOTE_PREFILL, "p0")
    # a faster, idle second prefill worker is the one chosen
    register(view.registry, "p1", role="prefill", kv_address=None, rate=4000.0)
    assert policy.route(RouteRequest("r", prompt(1000)), view).prefill.worker_id == "p1"
    # the router's own count of tokens it sent since the last heartbeat is a queue too
    view.registry.workers["p1"].prefill_backlog["earlier"] = 40_000
    assert policy.route(RouteRequest("r", prompt(1000)), view).prefill.worker_id == "p0"
    # prompt logprobs stay local whatever the cost
    assert policy.route(RouteRequest("r", prompt(1000), True), view).kind == LOCAL
    # below the threshold a prompt stays local whatever the cost: 90 tokens behind 30,000
    # queued on D (30.1 s) against an idle prefill worker (0.09 s)
    register(view.registry, "d0", rate=1000.0, running=4, queued=30_000)
    assert policy.route(RouteRequest("r", prompt(90)), view).kind == LOCAL
    assert policy.route(RouteRequest("r", prompt(100)), view).kind == REMOTE_PREFILL


def test_predicted_policy_keeps_a_cached_history_local_and_counts_the_link():
    view = View()
    policy = PredictedTTFTPolicy(prefill_threshold=100)
    register(view.registry, "d0", rate=1000.0, running=4)
    p0 = register(view.registry, "p0", role="prefill", kv_address=None, rate=1000.0)
    history = prompt(960)
    view.cache("d0", history)
    follow_up = history + prompt(40, start=5000)
    # local: (0 + 40) / 1000 + 4 * 0.04 = 0.2 s; remote: 1000 / 1000 = 1.0 s
    route = policy.route(RouteRequest("r", follow_up), view)
    assert (route.kind, route.num_cached_tokens) == (LOCAL, 960)
    # a fresh 1,000-token prompt: local 5.0 s, remote 1.0 s plus the link
    assert policy.route(RouteRequest("r", prompt(1000, 9000)), view).kind == REMOTE_PREFILL
    p0.observe_transfer(num_bytes=10_000_000, num_tokens=1000, push_s=2.5)  # 4 MB/s
    # remote: 1.0 + 1000 * 10 kB / 4 MB/s = 3.5 s; still below local 5.0 s
    assert policy.route(RouteRequest("r", prompt(1000, 9000)), view).kind == REMOTE_PREFILL
    p0.observe_transfer(num_bytes=10_000_000, num_tokens=1000, push_s=20.0)
    # link now 4 + 0.2 * (0.5 - 4) = 3.3 MB/s average: 1.0 + 3.03 s = 4.03 s, still remote
    assert 3.2e6 < p0.kv_bytes_per_s < 3.4e6
    p0.kv_bytes_per_s = 1e6  # remote 1.0 + 10 s: local wins
    assert policy.route(RouteRequest("r", prompt(1000, 9000)), view).kind == LOCAL


def test_predicted_policy_charges_a_prefill_for_the_prompts_arriving_during_it():
    """A local prefill of T seconds on an idle decode worker also holds up the prompts
    arriving meanwhile (rate lam): lam * T**2 / 2 more; so do the requests the router sent
    it since its last heartbeat."""
    view = View()
    policy = PredictedTTFTPolicy(prefill_threshold=100)
    d0 = register(view.registry, "d0", rate=500.0)
    register(view.registry, "p0", role="prefill", kv_address=None, rate=1000.0, queued=1500)
    # 1,000 tokens: local 2.0 s against remote (1,500 + 1,000) / 1,000 = 2.5 s
    assert policy.route(RouteRequest("r", prompt(1000)), view).kind == LOCAL
    for i in range(5):  # 5 short prompts just sent to d0: 5 / 10 s (the shortest span)
        d0.queue_prefill(f"s{i}", 20)
        d0.queue_prefill(f"s{i}", 20)  # counted once per request
    assert d0.arrival_rate() == pytest.approx(0.5)
    d0.prefill_backlog.clear()  # their prefill is done; the arrivals still count
    # local 2.0 + 0.5 * 2.0**2 / 2 = 3.0 s > 2.5 s
    assert policy.route(RouteRequest("r", prompt(1000)), view).kind == REMOTE_PREFILL
    now = time.monotonic()
    d0.prefill_arrivals_s = collections.deque([now - 61.0] * 5)  # out of the window
    assert d0.arrival_rate(now) == 0.0
    assert policy.route(RouteRequest("r", prompt(1000)), view).kind == LOCAL
    # the heartbeat says idle, but the router has sent d0 a request since: it waits 2.0 s
    d0.inflight.add("sent-since")
    assert policy.route(RouteRequest("r", prompt(1000)), view).kind == REMOTE_PREFILL


def test_routing_config_names_a_known_policy():
    with pytest.raises(ValueError, match="policy"):
        RoutingConfig(policy="fastest")
    assert RoutingConfig(policy="predicted").policy == "predicted"


# -- state machine -------------------------------------------------------------------------
def machine(state: RemoteState, now: float = 100.0) -> RemotePrefill:
    return RemotePrefill([1, 2, 3], SamplingParams(), state=state, entered_s=now)


@pytest.mark.parametrize("state,event", list(itertools.product(RemoteState, RemoteEvent)))
def test_every_state_event_pair_moves_by_the_table_or_changes_nothing(state, event):
    remote = machine(state)
    expected = TRANSITIONS.get((state, event))
    assert remote.accepts(event) == (expected is not None)
    assert remote.fire(event, now_s=200.0) is expected
    assert remote.state is (state if expected is None else expected)
    # entering a new state restarts its deadline; staying (or ignoring) keeps it
    assert remote.entered_s == (200.0 if expected not in (None, state) else 100.0)


def test_the_handshake_paths_reach_hand_off_or_recompute():
    for events in ([RemoteEvent.RESERVED, RemoteEvent.FIRST_TOKEN, RemoteEvent.KV_SENT],
                   [RemoteEvent.RESERVED, RemoteEvent.KV_SENT, RemoteEvent.FIRST_TOKEN]):
        remote = machine(RemoteState.RESERVING)
        for event in events:
            assert remote.fire(event) is not None
        assert remote.state is RemoteState.HANDED_OFF
        assert remote.fire(RemoteEvent.PREFILL_WORKER_LOST) is None  # P no longer matters
        assert remote.fire(RemoteEvent.KV_FAILED) is RemoteState.RECOMPUTING  # D's report
    # once recomputing, P's late messages change nothing
    remote = machine(RemoteState.RECOMPUTING)
    for event in RemoteEvent:
        assert remote.fire(event) is None
    # every state is reachable from RESERVING
    reachable, frontier = {RemoteState.RESERVING}, [RemoteState.RESERVING]
    while frontier:
        state = frontier.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src is state and dst not in reachable:
                reachable.add(dst)
                frontier.append(dst)
    assert reachable == set(RemoteState)


def test_each_state_has_its_deadline_from_the_routing_config():
    cfg = RoutingConfig(reserve_timeout_s=5, first_token_timeout_s=30, kv_timeout_s=7)
    assert set(STATE_DEADLINES) == set(RemoteState)
    expected = {RemoteState.RESERVING: 105.0, RemoteState.PREFILLING: 130.0,
                RemoteState.AWAITING_FIRST_TOKEN: 130.0, RemoteState.AWAITING_KV: 107.0,
                RemoteState.HANDED_OFF: None, RemoteState.RECOMPUTING: None}
    for state, deadline in expected.items():
        assert machine(state).deadline_s(cfg) == deadline
    no_limit = RoutingConfig(first_token_timeout_s=0)
    assert machine(RemoteState.PREFILLING).deadline_s(no_limit) is None


# -- the router's handlers -----------------------------------------------------------------
class Harness:
    """A Router whose outgoing messages are recorded; workers speak through encoded
    frames (the same path as the socket loop)."""

    def __init__(self, **routing) -> None:
        self.router = Router("tcp://127.0.0.1:0", RoutingConfig(prefill_threshold=64,
                                                                **routing))
        self.sent: list[tuple[str, object]] = []
        self.router.send = lambda wid, msg: self.sent.append((wid, msg))
        self.codec = MessageCodec()
        for wid, role in (("d0", "decode"), ("p0", "prefill")):
            self.recv(wid, RegisterWorker(
                worker_id=wid, role=role, model_name="m", max_model_len=4096,
                block_size=BLOCK, num_kv_blocks=256, pid=1,
                kv_address="tcp://127.0.0.1:1" if role == "decode" else None))
            self.recv(wid, Heartbeat(wid, 0, 0, 100, 0.0))
        self.sent.clear()

    def recv(self, sender: str, msg) -> None:
        self.router.inbox.on_frames([sender.encode(), self.codec.encode(msg)])

    def take(self) -> list[tuple[str, str]]:
        out = [(wid, type(msg).__name__) for wid, msg in self.sent]
        self.sent.clear()
        return out

    def close(self) -> None:
        self.router.socket.close()


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


def delta(rid: str, tokens: list[int], finished: bool = False) -> RequestDelta:
    return RequestDelta(request_id=rid, new_token_ids=tokens,
                        finish_reason="length" if finished else None)


def start_remote(h: Harness, rid: str = "r1"):
    start = 1000 * (len(h.router.handles) + sum(map(ord, rid)))  # a prompt of its own
    handle = h.router.add_request(rid, prompt(100, start), SamplingParams(max_tokens=4))
    assert handle.route == REMOTE_PREFILL and h.take() == [("d0", "ExpectRemoteKV")]
    return handle


def drain(handle) -> list:
    out = []
    while not handle.queue.empty():
        out.append(handle.queue.get_nowait())
    return out


def test_local_request_streams_and_ends_without_aborts(harness):
    handle = harness.router.add_request("r0", prompt(10), SamplingParams(max_tokens=2))
    assert handle.route == LOCAL and harness.take() == [("d0", "GenerateRequest")]
    harness.recv("d0", StepOutputs("d0", [delta("r0", [5])]))
    harness.recv("d0", StepOutputs("d0", [delta("r0", [6], finished=True)]))
    assert [d.new_token_ids for d in drain(handle)] == [[5], [6]]
    assert "r0" not in harness.router.handles and harness.take() == []
    assert not harness.router.registry.workers["d0"].inflight


def test_remote_prefill_happy_path_in_both_orders(harness):
    for rid, kv_first in (("a", False), ("b", True)):
        handle = start_remote(harness, rid)
        remote = handle.remote
        harness.recv("d0", KVReserved(rid, 0))
        assert remote.state is RemoteState.PREFILLING
        assert harness.take() == [("p0", "PrefillRequest")]
        steps = [lambda: harness.recv("p0", KVSent("p0", rid, 1000, 0.01)),
                 lambda: harness.recv("p0", PrefillDone("p0", delta(rid, [7]), 0.1))]
        for step in (reversed(steps) if not kv_first else steps):
            step()
        assert remote.state is RemoteState.HANDED_OFF
        assert harness.take() == [("d0", "FirstToken")]
        harness.recv("d0", StepOutputs("d0", [delta(rid, [8], finished=True)]))
        assert [d.new_token_ids for d in drain(handle)] == [[7], [8]]
        assert rid not in harness.router.handles and harness.take() == []


def test_first_token_that_ends_the_request_releases_the_reservation(harness):
    handle = start_remote(harness)
    harness.recv("d0", KVReserved("r1", 0))
    harness.take()
    harness.recv("p0", PrefillDone("p0", delta("r1", [7], finished=True), 0.1))
    assert [d.new_token_ids for d in drain(handle)] == [[7]]
    assert harness.take() == [("d0", "AbortRequests")]  # P owes nothing more


def test_kv_failure_recomputes_after_the_first_token_and_ignores_late_messages(harness):
    handle = start_remote(harness)
    harness.recv("d0", KVReserved("r1", 0))
    harness.recv("p0", PrefillDone("p0", delta("r1", [7]), 0.1))
    harness.take()
    harness.recv("d0", KVTransferFailed("d0", "r1", "checksum"))
    assert handle.remote.state is RemoteState.RECOMPUTING
    (wid, msg), = harness.sent
    assert wid == "d0" and isinstance(msg, ResumeLocally) and msg.output_token_ids == [7]
    harness.take()
    harness.recv("p0", KVSent("p0", "r1", 1000, 0.01))  # late: ignored
    harness.recv("d0", KVTransferFailed("d0", "r1", "timeout"))
    assert handle.remote.state is RemoteState.RECOMPUTING and harness.take() == []


def test_kv_failure_under_the_fail_policy_ends_the_request():
    h = Harness(kv_failure_policy="fail")
    try:
        handle = start_remote(h)
        h.recv("d0", KVReserved("r1", 0))
        h.take()
        h.recv("p0", KVSent("p0", "r1", 0, 0.01, error="connection refused"))
        (exc,) = drain(handle)
        assert isinstance(exc, WorkerFailed) and "connection refused" in str(exc)
        # P still owed the first token: both workers are told to drop it
        assert sorted(h.take()) == [("d0", "AbortRequests"), ("p0", "AbortRequests")]
    finally:
        h.close()


def test_prefill_worker_lost_recomputes_even_when_its_kv_already_arrived(harness):
    handle = start_remote(harness)
    harness.recv("d0", KVReserved("r1", 0))
    harness.recv("p0", KVSent("p0", "r1", 1000, 0.01))
    assert handle.remote.state is RemoteState.AWAITING_FIRST_TOKEN
    harness.take()
    harness.router.recovery.on_worker_lost(harness.router.registry.workers.pop("p0"))
    assert handle.remote.state is RemoteState.RECOMPUTING
    assert harness.take() == [("p0", "AbortRequests"), ("d0", "ResumeLocally")]


def test_reservation_refused_for_capacity_retries_until_its_deadline():
    async def scenario():
        h = Harness(reserve_timeout_s=0.3)
        try:
            handle = start_remote(h)
            h.recv("d0", KVReserveRefused("r1", "full", is_capacity=True))
            await asyncio.sleep(0.15)
            assert h.take() == [("d0", "ExpectRemoteKV")]  # asked again
            await asyncio.sleep(0.2)  # past the deadline of the state (entered once)
            h.recv("d0", KVReserveRefused("r1", "full", is_capacity=True))
            await asyncio.sleep(0.1)
            (exc,) = drain(handle)
            assert isinstance(exc, WorkerFailed) and "reserve" in str(exc)
            assert "r1" not in h.router.handles
        finally:
            h.close()
    asyncio.run(scenario())


def test_state_deadlines_end_or_recompute(harness):
    handle = start_remote(harness, "slow-reserve")
    now = time.monotonic()
    harness.router.recovery.check_deadlines(now + harness.router.routing.reserve_timeout_s + 1)
    (exc,) = drain(handle)
    assert isinstance(exc, WorkerFailed) and "reserve" in str(exc)
    harness.take()
    handle = start_remote(harness, "slow-kv")
    harness.recv("d0", KVReserved("slow-kv", 0))
    harness.recv("p0", PrefillDone("p0", delta("slow-kv", [7]), 0.1))
    harness.take()
    harness.router.recovery.check_deadlines(time.monotonic() + harness.router.routing.kv_timeout_s + 1)
    assert handle.remote.state is RemoteState.RECOMPUTING
    assert harness.take() == [("d0", "ResumeLocally")]


def test_abort_and_messages_about_others_requests(harness):
    handle = start_remote(harness)
    harness.recv("d0", KVReserved("r1", 0))
    harness.take()
    # a decode worker that does not serve r1 cannot speak for it
    harness.recv("d1", RegisterWorker(worker_id="d1", role="decode", model_name="m",
                                      max_model_len=4096, block_size=BLOCK,
                                      num_kv_blocks=256, pid=1))
    harness.take()
    local = harness.router.add_request("r2", prompt(8, 70_000), SamplingParams(max_tokens=4))
    assert local.worker_id == "d1"  # the less loaded one
    harness.take()
    # one message: a delta for d0's request (dropped, counted) and one for its own
    harness.recv("d1", StepOutputs("d1", [delta("r1", [9], finished=True),
                                          delta("r2", [5])]))
    assert "r1" in harness.router.handles and drain(handle) == []
    assert [d.new_token_ids for d in drain(local)] == [[5]]
    harness.router.abort("r1")
    assert sorted(harness.take()) == [("d0", "AbortRequests"), ("p0", "AbortRequests")]
    harness.router.abort("r1")  # twice: nothing more
    assert harness.take() == [] and drain(handle) == []


def test_messages_the_router_never_receives_are_dropped(harness):
    harness.recv("d0", GenerateRequest("x", [1], SamplingParams(), 0.0))
    harness.recv("d0", ExpectRemoteKV("x", [1], SamplingParams(), 0.0))
    harness.recv("d0", FirstToken("x", 1))
    harness.recv("d0", PrefillRequest("x", [1], SamplingParams(), 0.0, "d0", "tcp://x:1"))
    harness.recv("d0", AbortRequests(["x"]))
    assert harness.take() == [] and harness.router.is_healthy is False  # never started


@pytest.mark.parametrize("field,value", [("block_size", 0), ("max_model_len", -1),
                                         ("role", "bogus"), ("num_kv_blocks", -5)])
def test_a_registration_with_impossible_values_is_dropped(harness, field, value):
    """A peer with the secret once made every request fail with block_size 0 or cap every
    context at -1 tokens (the router takes the smallest max_model_len)."""
    fields = dict(worker_id="d9", role="decode", model_name="m", max_model_len=4096,
                  block_size=BLOCK, num_kv_blocks=256, pid=1)
    harness.recv("d9", RegisterWorker(**{**fields, field: value}))
    assert "d9" not in harness.router.registry.workers and harness.take() == []
    harness.recv("d9", RegisterWorker(**fields))
    assert "d9" in harness.router.registry.workers


# -- the decode worker's cache as the router sees it ----------------------------------------
def cache_events(prompt_ids: list[int], stored: bool = True, reset: bool = False,
                 worker: str = "d0") -> KVCacheEvents:
    hashes = chain_block_hashes(prompt_ids, BLOCK, [])
    return KVCacheEvents(worker, [stored] * len(hashes), hashes, reset)


def test_a_routed_prompt_counts_as_cached_only_once_the_worker_reports_it(harness):
    """Routing a long prompt to D records nothing: a second identical request goes remote
    too (D has no K/V yet, or prefix caching off) until D's cache events say it holds the
    blocks; an eviction event takes them away again, a snapshot replaces the set."""
    router = harness.router
    d0 = router.registry.workers["d0"]
    long = prompt(300)
    router.add_request("a", long, SamplingParams(max_tokens=4))
    assert router.num_cached_tokens(d0, long) == 0
    router.add_request("b", long, SamplingParams(max_tokens=4))
    assert [h.route for h in router.handles.values()] == [REMOTE_PREFILL, REMOTE_PREFILL]
    harness.recv("d0", cache_events(long))
    assert router.num_cached_tokens(d0, long) == 288  # 18 full blocks; one token computed
    router.add_request("c", long, SamplingParams(max_tokens=4))
    assert router.handles["c"].route == LOCAL
    harness.recv("d0", cache_events(long[:160], stored=False))  # the first 10 blocks evicted
    assert router.num_cached_tokens(d0, long) == 0
    harness.recv("d0", cache_events(long[:64], reset=True))  # a snapshot: 4 blocks
    assert router.num_cached_tokens(d0, long) == 64


def test_cache_events_from_others_are_not_applied(harness):
    router = harness.router
    d0 = router.registry.workers["d0"]
    long = prompt(300)
    harness.recv("p0", cache_events(long, worker="p0"))  # a prefill worker's cache: ignored
    harness.recv("p0", cache_events(long, worker="d0"))  # an impostor: dropped
    harness.recv("d9", cache_events(long, worker="d9"))  # unregistered: dropped
    assert router.num_cached_tokens(d0, long) == 0
    harness.recv("d0", KVCacheEvents("d0", [True], [1, 2]))  # malformed: lengths differ
    assert router.num_cached_tokens(d0, long) == 0


def test_predicted_routing_sends_to_the_chosen_prefill_worker_and_tracks_backlogs():
    h = Harness(policy="predicted")
    try:
        assert isinstance(h.router.policy, PredictedTTFTPolicy)
        h.recv("p1", RegisterWorker(worker_id="p1", role="prefill", model_name="m",
                                    max_model_len=4096, block_size=BLOCK, num_kv_blocks=256,
                                    pid=1))
        for wid, running, rate in (("d0", 4, 1000.0), ("p0", 0, 100.0), ("p1", 0, 1000.0)):
            h.recv(wid, Heartbeat(wid, running, 0, 100, 0.0, prefill_tokens_per_s=rate))
        h.take()
        handle = h.router.add_request("r1", prompt(1000), SamplingParams(max_tokens=4))
        assert handle.route == REMOTE_PREFILL and h.take() == [("d0", "ExpectRemoteKV")]
        h.recv("d0", KVReserved("r1", 0))
        assert h.take() == [("p1", "PrefillRequest")]  # the policy's choice, not p0
        p1 = h.router.registry.workers["p1"]
        assert p1.prefill_backlog == {"r1": 1000} and p1.num_prefill_tokens_queued == 1000
        h.recv("p1", PrefillDone("p1", delta("r1", [7]), 0.5))
        assert p1.prefill_backlog == {}
        h.recv("p1", KVSent("p1", "r1", 2_000_000, 1.5, push_s=0.5))
        assert (p1.kv_bytes_per_token, p1.kv_bytes_per_s) == (2000.0, 4e6)
        assert p1.remote_overhead_s > 0  # routed -> first token, beyond P's own 0.5 s
        # a short prompt stays on an idle d0: its tokens count as d0's backlog until its
        # first delta
        h.recv("d0", Heartbeat("d0", 0, 0, 100, 0.0, prefill_tokens_per_s=1000.0))
        local = h.router.add_request("r2", prompt(8, 50_000), SamplingParams(max_tokens=4))
        d0 = h.router.registry.workers["d0"]
        assert local.route == LOCAL and d0.prefill_backlog == {"r2": 8}
        h.recv("d0", StepOutputs("d0", [delta("r2", [1])]))
        assert d0.prefill_backlog == {}
    finally:
        h.close()


# -- migration ------------------------------------------------------------------------------
def register_decode(h: Harness, wid: str) -> None:
    h.recv(wid, RegisterWorker(worker_id=wid, role="decode", model_name="m",
                               max_model_len=4096, block_size=BLOCK, num_kv_blocks=256, pid=1,
                               kv_address="tcp://127.0.0.1:1"))


def test_a_request_whose_only_decode_worker_died_waits_for_the_next_one(harness):
    """The supervisor reports d0's exit: r1 (two tokens streamed) waits without an error;
    when a decode worker registers it is resubmitted there after those two tokens, and the
    new worker's tokens reach the same stream."""
    handle = harness.router.add_request("r1", prompt(8), SamplingParams(max_tokens=6))
    harness.recv("d0", StepOutputs("d0", [delta("r1", [11, 12])]))
    harness.take()
    harness.router.recovery.on_worker_exit("d0")
    assert harness.take() == [] and "r1" in harness.router.recovery.orphans
    harness.recv("d0", StepOutputs("d0", [delta("r1", [99])]))  # a late word from d0
    register_decode(harness, "d1")
    sent = [(wid, msg) for wid, msg in harness.sent if isinstance(msg, GenerateRequest)]
    assert [(wid, msg.output_token_ids) for wid, msg in sent] == [("d1", [11, 12])]
    assert harness.router.recovery.orphans == {} and handle.worker_id == "d1"
    harness.recv("d1", StepOutputs("d1", [delta("r1", [13, 14, 15, 16], finished=True)]))
    assert [d.new_token_ids for d in drain(handle)] == [[11, 12], [13, 14, 15, 16]]
    assert "r1" not in harness.router.handles


def test_a_waiting_request_ends_with_an_error_past_the_migration_timeout():
    h = Harness(migration_timeout_s=5.0)
    try:
        handle = h.router.add_request("r1", prompt(8), SamplingParams(max_tokens=6))
        h.router.recovery.on_worker_exit("d0")
        h.router.recovery.check_deadlines(time.monotonic() + 4.0)
        assert "r1" in h.router.handles and drain(handle) == []
        h.router.recovery.check_deadlines(time.monotonic() + 6.0)
        [error] = drain(handle)
        assert isinstance(error, WorkerFailed) and "within 5 s" in str(error)
        assert h.router.handles == {} and h.router.recovery.orphans == {}
    finally:
        h.close()


def test_without_a_migration_timeout_a_request_with_no_decode_worker_left_fails_at_once():
    h = Harness(migration_timeout_s=0)
    try:
        handle = h.router.add_request("r1", prompt(8), SamplingParams(max_tokens=6))
        h.router.recovery.on_worker_exit("d0")
        [error] = drain(handle)
        assert isinstance(error, WorkerFailed) and "d0" in str(error)
        for bad in (-1, float("nan"), float("inf")):  # NaN would never time out
            with pytest.raises(ValueError, match="migration_timeout_s"):
                RoutingConfig(migration_timeout_s=bad)
    finally:
        h.close()


def test_a_migrated_request_waits_for_its_new_workers_first_token_only_so_long():
    """r1 streamed two tokens on d0, then moved to d1 (d0 died). Its first-token deadline
    (5 s) starts again at the migration: d1 sending nothing ends it with an error naming
    the migration, where before it would have waited for ever (it already had tokens)."""
    h = Harness(first_token_timeout_s=5.0)
    try:
        handle = h.router.add_request("r1", prompt(8), SamplingParams(max_tokens=6))
        h.recv("d0", StepOutputs("d0", [delta("r1", [11, 12])]))
        register_decode(h, "d1")
        h.router.recovery.on_worker_exit("d0")
        assert handle.worker_id == "d1"
        h.router.recovery.check_deadlines(time.monotonic() + 4.0)
        assert "r1" in h.router.handles
        h.router.recovery.check_deadlines(time.monotonic() + 6.0)
        *tokens, error = drain(handle)
        assert [t.new_token_ids for t in tokens] == [[11, 12]]
        assert isinstance(error, WorkerFailed) and "after a migration within 5 s" in str(error)
        assert h.router.handles == {}
    finally:
        h.close()


def test_a_migrated_request_whose_new_worker_streams_has_no_deadline():
    h = Harness(first_token_timeout_s=5.0)
    try:
        handle = h.router.add_request("r1", prompt(8), SamplingParams(max_tokens=600))
        register_decode(h, "d1")
        h.router.recovery.on_worker_exit("d0")
        h.recv("d1", StepOutputs("d1", [delta("r1", [11])]))
        h.router.recovery.check_deadlines(time.monotonic() + 60.0)
        assert h.router.handles == {"r1": handle} and not any(
            isinstance(item, Exception) for item in drain(handle))
    finally:
        h.close()


def test_a_request_held_for_a_worker_missing_from_the_registry_moves_on():
    """The safety net under every exit: should a decode worker ever leave the registry
    without its requests being moved, the next deadline check moves them (here to d1)."""
    h = Harness()
    try:
        handle = h.router.add_request("r1", prompt(8), SamplingParams(max_tokens=6))
        h.recv("d0", StepOutputs("d0", [delta("r1", [11])]))
        register_decode(h, "d1")
        del h.router.registry.workers["d0"]  # gone, its requests untouched
        h.sent.clear()
        h.router.recovery.check_deadlines()
        [(wid, msg)] = h.sent
        assert (wid, type(msg), msg.output_token_ids) == ("d1", GenerateRequest, [11])
        assert handle.worker_id == "d1" and handle.num_migrations == 1
    finally:
        h.close()
