"""What decode and prefill workers share: the router connection, registration, heartbeats
from their own thread, and the engine loop that never blocks on a socket while busy."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import nullcontext

import zmq

from pdserve.core_turns import CoreTurns
from pdserve.engine.llm_engine import LLMEngine
from pdserve.memory import IdleTrimmer
from pdserve.messages import (
    AbortRequests,
    ExpectRemoteKV,
    GenerateRequest,
    Heartbeat,
    KVCacheEvents,
    MessageCodec,
    PrefillRequest,
    RegisterAck,
    RegisterWorker,
    RequestFailed,
    ReregisterRequest,
    ShutdownWorker,
)
from pdserve.security import ClusterKeys
from pdserve.worker_links import RouterLink, RouterLinks, open_dealer
from pdserve.worker_metrics import KVTransferTotals

logger = logging.getLogger(__name__)

#: Re-send the registration this often until the router acknowledges it.
REGISTER_RETRY_S = 1.0
#: Longest idle wait on the sockets, so periodic checks (deadlines) still run.
IDLE_POLL_S = 0.05
#: Messages that start a request here: its later messages go back to the router that sent it.
REQUEST_STARTS = (GenerateRequest, ExpectRemoteKV, PrefillRequest)
#: Say so when the router has not acknowledged the registration after this long (s).
REGISTER_WARN_S = 10.0
#: Default seconds a worker told to stop (SIGTERM) keeps serving its running requests.
DEFAULT_DRAIN_S = 30.0


class EngineWorker:
    """Base of the worker processes.

    Subclasses set ``role`` and implement :meth:`handle` for their own messages, and may
    override :meth:`poll_extra` (other work each loop) and :meth:`after_step`.

    Args:
        engine: the loaded engine.
        router_address: zmq address of the router's ROUTER socket, or several,
            comma-separated (one per API server; DNS names that resolve to several
            addresses count as several: :mod:`pdserve.worker_links`).
        worker_id: unique name; the zmq identity.
        model_name: served model name reported to the router.
        heartbeat_interval_s: load report period.
        cluster_keys: the deployment's CURVE keys (:mod:`pdserve.security`); None runs
            unauthenticated (``--insecure-no-auth``).
    """

    role = "decode"
    #: send the prefix cache's changes to the router (:class:`KVCacheEvents`): the decode
    #: workers, whose cache the router's routing counts on
    reports_cache_events = False

    def __init__(self, engine: LLMEngine, router_address: str, worker_id: str,
                 model_name: str, heartbeat_interval_s: float = 1.0,
                 cluster_keys: ClusterKeys | None = None) -> None:
        self.engine = engine
        self.cluster_keys = cluster_keys
        self.router_address = router_address
        self.worker_id = worker_id
        self.model_name = model_name
        self.heartbeat_interval_s = heartbeat_interval_s
        self.codec = MessageCodec()
        self.ctx = zmq.Context()
        self.links = RouterLinks(self.ctx, router_address, worker_id, cluster_keys)
        self.should_stop = False
        #: set by the first SIGTERM/SIGINT: finish running requests, take nothing new
        self.draining = False
        self.drain_s = DEFAULT_DRAIN_S
        self.num_requests_served = 0
        #: where this worker's /metrics is served, sent with its registration (None: not)
        self.metrics_address: str | None = None
        #: steps taken in turns with workers on the same cores (``--core-turns``)
        self.core_turns: CoreTurns | None = None
        # run()'s clocks (time.monotonic()): its start and the end of a drain
        self._run_started_s = 0.0
        self._drain_until_s = 0.0
        self._is_unregistered_warned = False
        # _receive_messages' poller over the links' sockets, rebuilt when the links change
        self._poller = zmq.Poller()
        self._polled: dict[zmq.Socket, tuple[RouterLink, bool]] = {}
        self._poller_version = -1

    # -- overridable -----------------------------------------------------------------------
    def registration_extras(self) -> dict:
        """Role-specific fields added to the :class:`RegisterWorker` message (none here)."""
        return {}

    def handle(self, msg) -> None:
        """Role-specific messages."""
        logger.warning("unexpected message %s", type(msg).__name__)

    def poll_extra(self) -> None:
        """Called once per loop iteration (after draining the socket)."""

    #: Called while waiting for the cores (core turns): takes in messages, says whether a new
    #: prompt waits (the holder pauses sooner, :mod:`pdserve.core_turns`); None: no checks.
    new_prompt_waits = None

    def after_step(self, deltas) -> None:
        """Called with each step's deltas."""

    def kv_transfer_totals(self) -> KVTransferTotals:
        """Cumulative KV-transfer counters (for ``/metrics``; read from another thread)."""
        return KVTransferTotals()

    def has_work(self) -> bool:
        """Whether the engine has unfinished requests: a draining worker stops once it has
        none, and an idle one hands freed memory back to the OS after a while."""
        return self.engine.has_unfinished_requests

    # -- plumbing --------------------------------------------------------------------------
    @property
    def is_registered(self) -> bool:
        """Whether at least one router has acknowledged this worker."""
        return self.links.is_registered

    def send(self, msg) -> None:
        """Send to the router(s) ``msg`` concerns (:meth:`RouterLinks.send`; thread-safe:
        worker threads may report too)."""
        self.links.send(msg)

    def _register(self, link: RouterLink) -> None:
        """Send our registration to one router without waiting (not connected: retried)."""
        self.links.send_on(link, RegisterWorker(
            worker_id=self.worker_id, role=self.role, model_name=self.model_name,
            max_model_len=self.engine.max_model_len, block_size=self.engine.config.block_size,
            num_kv_blocks=self.engine.block_manager.num_blocks, pid=os.getpid(),
            metrics_address=self.metrics_address,
            enable_prefix_caching=self.engine.config.enable_prefix_caching,
            **self.registration_extras(),
        ), block=False)

    def load(self) -> Heartbeat:
        """A snapshot of the engine's load (plain counters, safe to read from a thread)."""
        bm = self.engine.block_manager
        sched = self.engine.scheduler
        spec = self.engine.spec_stats
        return Heartbeat(
            worker_id=self.worker_id, num_running=sched.num_running,
            num_waiting=sched.num_waiting, num_free_blocks=bm.num_free_blocks,
            kv_cache_usage=bm.usage, num_preemptions=sched.num_preemptions,
            num_prefix_hit_tokens=bm.num_prefix_hit_tokens,
            num_prefix_queried_tokens=bm.num_prefix_queried_tokens,
            num_requests_served=self.num_requests_served,
            num_spec_drafts=spec.num_drafts, num_spec_draft_tokens=spec.num_draft_tokens,
            num_spec_accepted_tokens=spec.num_accepted_tokens,
            num_spec_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos),
            draining=self.draining,
            num_prefill_tokens_queued=self.engine.prefill_stats.num_prefill_tokens_queued,
            prefill_tokens_per_s=self.engine.prefill_stats.prefill_tokens_per_s,
            num_prompt_tokens_computed=self.engine.prefill_stats.num_prefill_tokens_computed,
        )

    def _heartbeat_loop(self) -> None:
        """Thread: report load every ``heartbeat_interval_s`` to every router that
        registered us, on sockets of its own, so a long engine step never makes the worker
        look dead."""
        socks: dict[str, zmq.Socket] = {}
        codec = MessageCodec()
        try:
            while not self.should_stop:
                links = [link for link in list(self.links.links) if link.is_registered]
                for address in set(socks) - {link.address for link in self.links.links}:
                    socks.pop(address).close(0)  # a router no longer listed
                if links:
                    data = codec.encode(self.load())
                for link in links:
                    sock = socks.get(link.address)
                    if sock is None:
                        sock = socks[link.address] = open_dealer(
                            self.ctx, link.address, f"{self.worker_id}/heartbeat",
                            self.cluster_keys)
                    try:
                        sock.send(data, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # the router is unreachable; it will drop us, we re-register
                time.sleep(self.links.heartbeat_interval_s)
        except zmq.ZMQError:  # the context is closing: the worker is stopping
            pass
        finally:
            for sock in socks.values():
                sock.close(0)

    def _handle_raw(self, data: bytes, link: RouterLink) -> None:
        """Decode and act on one message from ``link``'s router (never raises)."""
        try:
            msg = self.codec.decode_to_worker(data)
        except Exception as exc:  # malformed bytes must not kill the worker
            logger.warning("dropping malformed message: %s", exc)
            return
        if isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.abort(rid)
        elif isinstance(msg, RegisterAck):
            link.is_registered = True
            self._is_unregistered_warned = True  # a router answered: no first-contact hint
            link.heartbeat_interval_s = msg.heartbeat_interval_s
            self.heartbeat_interval_s = self.links.heartbeat_interval_s
            if self.reports_cache_events:  # a router that knows nothing of our cache yet
                self.engine.block_manager.request_cache_snapshot()
        elif isinstance(msg, ReregisterRequest):
            link.is_registered = False
        elif isinstance(msg, ShutdownWorker):
            self._on_shutdown(link)
        else:
            if isinstance(msg, REQUEST_STARTS):
                self.links.claim(msg.request_id, link)
            try:
                self.handle(msg)
            except Exception:  # one bad message must not take the worker down
                logger.exception("failed to handle %s", type(msg).__name__)
                request_id = getattr(msg, "request_id", None)
                if request_id is not None:
                    self.abort(request_id)
                    self.send(RequestFailed(request_id, "the worker could not take this "
                                                        "request", is_client_error=False))

    def _on_shutdown(self, link: RouterLink) -> None:
        """A router told us to exit: we do when it is our only router; with several, only
        that one is leaving, and we stop reporting to it until it registers us again."""
        if len(self.links.links) <= 1:
            self.should_stop = True
            link.is_registered = False  # its connection closing next is no loss
            return
        logger.info("router %s is shutting down; serving the others", link.address)
        link.is_registered = False
        link.last_register_s = float("inf")  # until the connection drops and comes back

    def _abort_orphans(self, request_ids: list[str]) -> None:
        """Abort the requests of a router that is gone (no client waits on them)."""
        live = [rid for rid in request_ids if rid in self.engine.requests]
        if live:
            logger.warning("%s worker %s: aborting %d requests of a router that is gone",
                           self.role, self.worker_id, len(live))
        for rid in request_ids:
            self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Drop ``request_id`` from the engine (the router asked, or handling it failed)."""
        self.links.release(request_id)
        self.engine.abort_request(request_id)

    def _step(self) -> None:
        try:
            with (self.core_turns.turn(self.new_prompt_waits) if self.core_turns is not None
                  else nullcontext()):
                if self.core_turns is not None:  # what came while we waited joins this step
                    self._receive_messages()
                    self.poll_extra()
                deltas = self.engine_step()
        except Exception:  # an engine bug fails the batch, not the worker
            logger.exception("engine step failed; failing its requests")
            for rid in list(self.engine.requests):  # told to its router, then aborted as
                self.send(RequestFailed(rid, "internal engine error", is_client_error=False))
                self.abort(rid)  # the router would (a decode worker's lock and states too)
            return
        self.after_step(deltas)

    def engine_step(self):
        """One engine step, its deltas (the decode worker caps some, see there)."""
        return self.engine.step()

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT or a :class:`ShutdownWorker` message.

        The first signal starts a drain: the worker tells the router (its heartbeats say
        ``draining``, so nothing new is routed to it), finishes its running requests for up
        to :attr:`drain_s` seconds, then stops; a second signal stops it at once.
        """
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        heartbeats = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeats.start()
        self._run_started_s = time.monotonic()
        announced = False
        trimmer = IdleTrimmer()
        while not self.should_stop:
            if self.draining and not announced:  # the routers route nothing new here
                self.send(self.load())
                announced = True
            now = time.monotonic()
            self._abort_orphans(self.links.sync())  # routers that joined or left (DNS)
            for link in self.links.links:
                if not link.is_registered and now - link.last_register_s >= REGISTER_RETRY_S:
                    self._retry_registration(link, now)
            self._receive_messages()
            self.poll_extra()
            if self.engine.has_unfinished_requests:
                self._step()
            else:
                trimmer.tick(self.has_work(), now)
            self._send_cache_events()
            if self.draining and self._is_drain_over():
                break
        self._shut_down(heartbeats)

    def _on_stop_signal(self, signum, frame) -> None:  # noqa: ARG002
        """SIGTERM/SIGINT: the first starts a drain, a second (or one before the router has
        acknowledged us) stops at once."""
        if self.draining or not self.is_registered:
            self.should_stop = True
            return
        self.draining = True
        self._drain_until_s = time.monotonic() + self.drain_s
        logger.info("%s worker %s draining: finishing %d running requests (up to "
                    "%.0f s)", self.role, self.worker_id,
                    len(self.engine.requests), self.drain_s)

    def _retry_registration(self, link: RouterLink, now: float) -> None:
        """Send the registration to ``link``'s router again; once, when no router has
        answered since the start and :data:`REGISTER_WARN_S` have passed, say what usually
        keeps a router from answering (a router lost later, e.g. at shutdown, is logged
        where the connection drops)."""
        self._register(link)
        link.last_register_s = now
        waited_s = now - self._run_started_s
        if (not self._is_unregistered_warned and not self.is_registered
                and waited_s > REGISTER_WARN_S):
            self._is_unregistered_warned = True
            logger.warning(
                "%s worker %s: the router at %s has not answered in %.0f s; is it "
                "running and reachable, and do both sides use the same cluster "
                "secret (or both --insecure-no-auth)?", self.role, self.worker_id,
                self.links.addresses(), waited_s)

    def _receive_messages(self, wait: bool = True) -> None:
        """Handle every message and connection event waiting on the routers' sockets; when
        the engine is idle (and ``wait``), wait up to :data:`IDLE_POLL_S` for the first one."""
        if self._poller_version != self.links.version:
            self._poller = zmq.Poller()
            self._polled = {}
            for sock, link, is_monitor in self.links.poll_sockets():
                self._poller.register(sock, zmq.POLLIN)
                self._polled[sock] = (link, is_monitor)
            self._poller_version = self.links.version
        idle = wait and not self.engine.has_unfinished_requests
        timeout_ms = int(IDLE_POLL_S * 1000) if idle else 0
        while ready := self._poller.poll(timeout_ms):
            for sock, _ in ready:
                link, is_monitor = self._polled[sock]
                if is_monitor:
                    self._abort_orphans(self.links.on_monitor_event(link))
                else:
                    self._handle_raw(sock.recv(), link)
            timeout_ms = 0

    def _is_drain_over(self) -> bool:
        """Whether a draining worker should stop: nothing left to run, or the drain period
        is over (said in a warning naming the requests cut short)."""
        if not self.has_work():
            return True
        if time.monotonic() > self._drain_until_s:
            logger.warning("%s worker %s: drain period over with %d requests still "
                           "running; stopping", self.role, self.worker_id,
                           len(self.engine.requests))
            return True
        return False

    def _shut_down(self, heartbeats: threading.Thread) -> None:
        """Leave the cluster: stop the heartbeat thread, release the role's resources, close
        the router socket and the zmq context."""
        logger.info("%s worker %s stopping", self.role, self.worker_id)
        self.should_stop = True  # ends the heartbeat thread (a drain leaves the loop early)
        self.close()
        heartbeats.join(timeout=2 * self.heartbeat_interval_s)
        self.links.close()
        self.ctx.term()

    def _send_cache_events(self) -> None:
        """Tell the router what entered and left the prefix cache since the last call
        (decode workers; on the engine's thread, which owns the block manager)."""
        if not (self.reports_cache_events and self.is_registered):
            return
        reset, events = self.engine.block_manager.drain_cache_events()
        if events or reset:
            self.send(KVCacheEvents(self.worker_id, [stored for stored, _ in events],
                                    [block_hash for _, block_hash in events], reset))

    def close(self) -> None:
        """Release role-specific resources (transports, threads)."""
