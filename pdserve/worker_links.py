"""A worker's connections to its routers: one zmq DEALER per router, so several API servers
(each with its own router) can share one pool of workers.

Every router the worker is given gets the worker's registration, heartbeats and prefix-cache
events; a request's own messages (tokens, KV handshakes, failures) go back only to the
router that sent the request. Routers share no state: each one sees the worker's whole load
in its heartbeats and its whole cache in its events.

``--router`` takes a comma-separated list of ``tcp://HOST:PORT`` addresses; a HOST that
resolves to several addresses (a Kubernetes headless Service, a DNS round robin) stands for
one router at each, and is resolved again every :data:`RESOLVE_INTERVAL_S` so routers that
come and go are followed.

A link whose connection closes (its router died) stops being registered, and the requests
that router sent are handed back to the worker to abort: no client waits on them any more,
and their KV blocks must not wait for ``max_tokens``. A router that comes back at the same
address is registered with again.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.messages import (
    Heartbeat,
    KVCacheEvents,
    KVReserveRefused,
    MessageCodec,
    PrefillDone,
    RequestFailed,
    StepOutputs,
)
from pdserve.security import ClusterKeys, secure_client

logger = logging.getLogger(__name__)

#: Seconds between DNS lookups of router host names.
RESOLVE_INTERVAL_S = 10.0
#: A send to a connected router that cannot be queued within this long is dropped (ms).
SEND_TIMEOUT_MS = 1000
#: Request-owner entries kept at most (oldest forgotten first; a request whose entry is
#: gone reports to the first router). A prefill worker forgets its requests only this way:
#: its first token and its KV-sent report may go in either order.
MAX_OWNERS = 1 << 14
#: Messages sent to every registered router rather than to a request's owner.
BROADCAST = (Heartbeat, KVCacheEvents)


def parse_router_addresses(spec: str) -> list[str]:
    """``--router`` value -> its addresses, in order, duplicates dropped.

    Raises:
        ValueError: an empty list or an empty entry.
    """
    addresses = [a.strip() for a in spec.split(",")]
    if not spec.strip() or any(not a for a in addresses):
        raise ValueError(f"--router: expected comma-separated zmq addresses, got {spec!r}")
    return list(dict.fromkeys(addresses))


def _dns_host(address: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` address when it is a name (not an IP literal,
    not ``*``); None otherwise."""
    if not address.startswith("tcp://") or ":" not in address[6:]:
        return None
    host = address[6:].rsplit(":", 1)[0].strip("[]")
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        return None if host == "*" else host


def resolve_router_addresses(addresses: list[str]) -> list[str]:
    """Expand each ``tcp://NAME:PORT`` whose NAME resolves to several IPv4/IPv6 addresses
    into one address per IP; names that do not resolve are kept as they are (zmq keeps
    trying them), as are IP literals and other schemes."""
    out: list[str] = []
    for address in addresses:
        host = _dns_host(address)
        if host is None:
            out.append(address)
            continue
        port = address.rsplit(":", 1)[1]
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError):
            out.append(address)
            continue
        ips = list(dict.fromkeys(info[4][0] for info in infos))
        if len(ips) <= 1:
            out.append(address)
        else:
            out.extend(f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"
                       for ip in ips)
    return list(dict.fromkeys(out))


@dataclass(eq=False)
class RouterLink:
    """One router connection.

    Attributes:
        address: the router's zmq address.
        sock: DEALER socket (identity: the worker id), ``ZMQ_IMMEDIATE`` so nothing is
            queued for a router that is not connected.
        monitor: PAIR socket with the connection events of ``sock``.
        is_registered: the router acknowledged our registration and has not asked again.
        last_register_s: ``time.monotonic()`` of the last registration sent.
        heartbeat_interval_s: the period this router asked for.
    """

    address: str
    sock: zmq.Socket
    monitor: zmq.Socket
    is_registered: bool = False
    last_register_s: float = 0.0
    heartbeat_interval_s: float = 1.0

    def close(self) -> None:
        """Close both sockets (the monitor first)."""
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.sock.close(0)


def open_dealer(ctx: zmq.Context, address: str, identity: str,
                cluster_keys: ClusterKeys | None) -> zmq.Socket:
    """A DEALER connected to ``address`` with our identity, CURVE keys, no linger, a send
    timeout, and ``ZMQ_IMMEDIATE`` (no queueing for a router that is not connected)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    secure_client(sock, cluster_keys)
    sock.connect(address)
    return sock


class RouterLinks:
    """The worker's links to every router it was given (see the module docstring).

    Thread-safety: :meth:`send` may be called from any thread (it holds a lock); the rest
    belongs to the worker's engine thread.

    Args:
        ctx: the worker's zmq context.
        spec: the ``--router`` value (comma-separated addresses or DNS names).
        worker_id: our identity on every router.
        cluster_keys: the deployment's CURVE keys, or None (unauthenticated).

    Raises:
        ValueError: ``spec`` names no address.
    """

    def __init__(self, ctx: zmq.Context, spec: str, worker_id: str,
                 cluster_keys: ClusterKeys | None) -> None:
        self.ctx = ctx
        self.worker_id = worker_id
        self.cluster_keys = cluster_keys
        self.configured = parse_router_addresses(spec)
        self.links: list[RouterLink] = []
        self.codec = MessageCodec()
        self.lock = threading.Lock()
        self.owners: OrderedDict[str, RouterLink] = OrderedDict()
        #: bumped whenever links are added or removed (the worker re-polls)
        self.version = 0
        self._resolved: list[str] | None = None
        self._stop = threading.Event()
        names = [a for a in self.configured if _dns_host(a) is not None]
        for address in resolve_router_addresses(self.configured) if names else self.configured:
            self._add(address)
        if names:
            threading.Thread(target=self._resolve_loop, name="router-dns", daemon=True).start()

    # -- the set of links ------------------------------------------------------------------
    def _add(self, address: str) -> None:
        sock = open_dealer(self.ctx, address, self.worker_id, self.cluster_keys)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.links.append(RouterLink(address, sock, monitor))
        self.version += 1

    def _resolve_loop(self) -> None:
        """Thread: look the router names up again every :data:`RESOLVE_INTERVAL_S`; the
        engine thread applies the result in :meth:`sync`."""
        while not self._stop.wait(RESOLVE_INTERVAL_S):
            self._resolved = resolve_router_addresses(self.configured)

    def sync(self) -> list[str]:
        """Apply the latest DNS answer: open links to new routers, close links to routers
        no longer listed. Returns the request ids whose router was dropped (to abort)."""
        resolved, self._resolved = self._resolved, None
        if resolved is None or resolved == [link.address for link in self.links]:
            return []
        orphans: list[str] = []
        for link in [link for link in self.links if link.address not in resolved]:
            logger.info("router %s is no longer listed; leaving it", link.address)
            orphans += self._drop_owned(link)
            with self.lock:
                self.links.remove(link)
                link.close()
            self.version += 1
        known = {link.address for link in self.links}
        for address in resolved:
            if address not in known:
                logger.info("router %s joined", address)
                self._add(address)
        return orphans

    def poll_sockets(self) -> list[tuple[zmq.Socket, RouterLink, bool]]:
        """``(socket, link, is_monitor)`` for every socket the worker should poll."""
        return ([(link.sock, link, False) for link in self.links]
                + [(link.monitor, link, True) for link in self.links])

    def on_monitor_event(self, link: RouterLink) -> list[str]:
        """Read one connection event of ``link``. A closed connection to a router we were
        registered with unregisters the link; returns the ids of the requests that router
        sent us (the caller aborts them)."""
        try:
            event = recv_monitor_message(link.monitor, zmq.NOBLOCK)
        except zmq.ZMQError:
            return []
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return []
        if link.last_register_s == float("inf"):  # it had told us to leave: it may return
            link.last_register_s = 0.0
        if not link.is_registered:
            return []
        link.is_registered = False
        orphans = self._drop_owned(link)
        logger.warning("lost the connection to router %s", link.address)
        return orphans

    def _drop_owned(self, link: RouterLink) -> list[str]:
        with self.lock:
            owned = [rid for rid, owner in self.owners.items() if owner is link]
            for rid in owned:
                del self.owners[rid]
        return owned

    @property
    def is_registered(self) -> bool:
        """Whether at least one router has acknowledged us."""
        return any(link.is_registered for link in self.links)

    @property
    def heartbeat_interval_s(self) -> float:
        """The shortest period any registered router asked for (1 s before any did)."""
        periods = [link.heartbeat_interval_s for link in self.links if link.is_registered]
        return min(periods) if periods else 1.0

    def addresses(self) -> str:
        """The routers' addresses, comma-separated (for log lines)."""
        return ",".join(link.address for link in self.links) or ",".join(self.configured)

    # -- owners ----------------------------------------------------------------------------
    def claim(self, request_id: str, link: RouterLink) -> None:
        """Record that ``link``'s router sent ``request_id``: its messages go back there."""
        if len(self.links) < 2:
            return
        with self.lock:
            self.owners[request_id] = link
            self.owners.move_to_end(request_id)
            while len(self.owners) > MAX_OWNERS:
                self.owners.popitem(last=False)

    def release(self, request_id: str) -> None:
        """Forget ``request_id``'s router (the request ended here)."""
        with self.lock:
            self.owners.pop(request_id, None)

    # -- sending ---------------------------------------------------------------------------
    def send_on(self, link: RouterLink, msg, *, block: bool = True) -> bool:
        """Send ``msg`` to one router; False when it could not be queued (not connected,
        or its queue stayed full for :data:`SEND_TIMEOUT_MS`; logged when ``block``)."""
        with self.lock:
            try:
                link.sock.send(self.codec.encode(msg), copy=False,
                               flags=0 if block else zmq.NOBLOCK)
                return True
            except zmq.Again:
                if block:
                    logger.warning("could not send %s to the router at %s within %d ms",
                                   type(msg).__name__, link.address, SEND_TIMEOUT_MS)
                return False

    def send(self, msg) -> None:
        """Send a message to the router(s) it concerns: heartbeats and cache events to every
        registered router, a request's messages to the router that sent the request (the
        first router when there is only one, or the owner is unknown)."""
        links = self.links
        if len(links) == 1:
            self.send_on(links[0], msg)
            return
        if isinstance(msg, BROADCAST):
            for link in links:
                if link.is_registered:
                    self.send_on(link, msg)
            return
        if isinstance(msg, StepOutputs):
            self._send_step_outputs(msg)
            return
        request_id = msg.delta.request_id if isinstance(msg, PrefillDone) else getattr(
            msg, "request_id", None)
        link = self._owner(request_id)
        if link is not None:
            self.send_on(link, msg)
        if isinstance(msg, (RequestFailed, KVReserveRefused)):
            self.release(request_id)

    def _owner(self, request_id: str | None) -> RouterLink | None:
        with self.lock:
            link = self.owners.get(request_id) if request_id is not None else None
        if link is None:
            return self.links[0] if self.links else None
        return link

    def _send_step_outputs(self, msg: StepOutputs) -> None:
        """Split one step's deltas by the router each request came from."""
        by_link: dict[int, tuple[RouterLink, list]] = {}
        for delta in msg.deltas:
            link = self._owner(delta.request_id)
            if link is None:
                continue
            by_link.setdefault(id(link), (link, []))[1].append(delta)
            if delta.finished:
                self.release(delta.request_id)
        for link, deltas in by_link.values():
            self.send_on(link, StepOutputs(msg.worker_id, deltas))

    def close(self) -> None:
        """Stop the DNS thread and close every link."""
        self._stop.set()
        with self.lock:
            for link in self.links:
                link.close()
            self.links = []
