"""Authentication between pdserve's processes: CURVE on every zmq socket, keyed by one secret.

Every router <-> worker socket and the zmq KV path run zmq's CURVE mechanism (CurveZMQ,
RFC 26/CURVEZMQ: Curve25519 key exchange, then every frame encrypted and authenticated).
All keys derive from one **cluster secret** the deployment provides, so there is nothing
to distribute but that secret::

    server key pair = Curve25519(HMAC-SHA256(secret, "pdserve/curve/server/v1"))
    client key pair = Curve25519(HMAC-SHA256(secret, "pdserve/curve/client/v1"))

Bound sockets (the router, a decode worker's KV port) are CURVE servers and check each
connecting peer's public key with a ZAP handler (RFC 27/ZAP): only the client key derived
from the secret is admitted. A peer without the secret cannot finish the handshake (it
does not know the server's key, or its own key is refused), so it can neither register
nor send a single message; each refusal is logged once per peer address and counted.

Where the secret comes from, first found wins: ``--cluster-secret-file PATH``, the file
named by ``PDSERVE_CLUSTER_SECRET_FILE``, the value of ``PDSERVE_CLUSTER_SECRET``.
``pdserve serve`` on one machine makes a random one and hands it to the workers it starts
through their environment.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
#: Shortest secret accepted (bytes after stripping surrounding whitespace).
MIN_SECRET_BYTES = 16
#: ZAP domain of pdserve's CURVE servers.
ZAP_DOMAIN = "pdserve"


class ClusterSecretError(ValueError):
    """No usable cluster secret: missing, unreadable or too short (the message says which)."""


def _keypair(secret: bytes, label: bytes) -> tuple[bytes, bytes]:
    """A Curve25519 key pair (z85 public, z85 secret) derived from ``secret`` and ``label``."""
    raw = hmac.new(secret, label, hashlib.sha256).digest()  # 32 bytes: a X25519 scalar
    secret_z85 = z85.encode(raw)
    return zmq.curve_public(secret_z85), secret_z85


@dataclass(frozen=True)
class ClusterKeys:
    """The CURVE keys of one deployment, all derived from its secret.

    Attributes:
        secret: the cluster secret (bytes, at least :data:`MIN_SECRET_BYTES`).
        server_public / server_secret: z85 keys of every bound socket.
        client_public / client_secret: z85 keys of every connecting socket.
    """

    secret: bytes = field(repr=False)
    server_public: bytes = field(init=False)
    server_secret: bytes = field(init=False, repr=False)
    client_public: bytes = field(init=False)
    client_secret: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_BYTES:
            raise ClusterSecretError(f"the cluster secret must be at least {MIN_SECRET_BYTES} "
                                     f"bytes, got {len(self.secret)}")
        server = _keypair(self.secret, b"pdserve/curve/server/v1")
        client = _keypair(self.secret, b"pdserve/curve/client/v1")
        object.__setattr__(self, "server_public", server[0])
        object.__setattr__(self, "server_secret", server[1])
        object.__setattr__(self, "client_public", client[0])
        object.__setattr__(self, "client_secret", client[1])

    @classmethod
    def generate(cls) -> ClusterKeys:
        """Keys from a fresh random secret (``pdserve serve``'s ephemeral set)."""
        return cls(secrets.token_urlsafe(32).encode())

    def child_env(self) -> dict[str, str]:
        """Environment entries that hand this secret to a child process."""
        return {SECRET_ENV: self.secret.decode("utf-8", "surrogateescape")}

    def sign(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 over ``parts`` (length-prefixed, so no two part lists collide)."""
        mac = hmac.new(self.secret, b"pdserve/token/v1", hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.digest()


def load_cluster_keys(secret_file: str | None = None, *, required: bool = True
                      ) -> ClusterKeys | None:
    """The deployment's keys from ``secret_file``, ``$PDSERVE_CLUSTER_SECRET_FILE`` or
    ``$PDSERVE_CLUSTER_SECRET`` (first found; surrounding whitespace stripped).

    Returns:
        The keys, or None when no secret is configured and ``required`` is False.

    Raises:
        ClusterSecretError: no secret while ``required``; a named file that cannot be read;
            a secret shorter than :data:`MIN_SECRET_BYTES`.
    """
    path = secret_file or os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ClusterSecretError(f"cannot read the cluster secret file {path}: "
                                     f"{exc.strerror or exc}") from None
        return ClusterKeys(secret)
    value = os.environ.get(SECRET_ENV)
    if value:
        # the same bytes as a file holding the same text (UTF-8); any bytes round-trip
        return ClusterKeys(value.strip().encode("utf-8", "surrogateescape"))
    if required:
        raise ClusterSecretError(
            "no cluster secret: pass --cluster-secret-file PATH or set "
            f"{SECRET_FILE_ENV} or {SECRET_ENV} (the same secret on the server and on "
            "every worker; e.g. `openssl rand -base64 32 > secret`), or run without "
            "authentication with --insecure-no-auth")
    return None


#: Longest a connection may take to finish its handshake before libzmq drops it (its default,
#: 30 s, let a flood of idle unauthenticated connections hold ~20,000 of the API server's
#: file descriptors; a CURVE handshake between hosts takes milliseconds).
HANDSHAKE_TIMEOUT_MS = 5000


def secure_server(sock: zmq.Socket, keys: ClusterKeys | None) -> None:
    """Make a socket that binds a CURVE server (before ``bind``); no-op without keys."""
    if keys is None:
        return
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    # with no ZAP handler (not started yet, or stopped) refuse everyone, never admit all
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def secure_client(sock: zmq.Socket, keys: ClusterKeys | None) -> None:
    """Make a socket that connects a CURVE client (before ``connect``); no-op without keys."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class _Admission:
    """ZAP credentials provider: admits the cluster's client key only."""

    def __init__(self, keys: ClusterKeys, on_refused: Callable[[str, str], None]) -> None:
        self.keys = keys
        self.on_refused = on_refused
        self.address = ""

    def callback(self, domain: str, key: bytes) -> bool:  # noqa: ARG002 (pyzmq's signature)
        if hmac.compare_digest(key, self.keys.client_public):
            return True
        self.on_refused(self.address, "unknown_key")
        return False


class _Authenticator(ThreadAuthenticator):
    """pyzmq's thread authenticator, telling the provider which address is asking."""

    provider: _Admission | None = None

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if self.provider is not None and len(msg) > 3:
            self.provider.address = msg[3].decode("utf-8", "replace")
        await super().handle_zap_message(msg)


class PeerGate:
    """The ZAP handler of one zmq context: which peers its CURVE servers admit.

    One per context (ZAP is per context). Refusals are logged once per peer address and
    passed to ``on_refused(address, reason)`` every time (metrics): ``unknown_key`` for a
    peer that knows the server's key but not the client key, and, for sockets passed to
    :meth:`watch`, ``handshake_failed`` for one that does not even know the server's key
    or speaks plain zmq (libzmq reports only the bound endpoint for those).

    Args:
        ctx: the context whose bound sockets use :func:`secure_server`.
        keys: the cluster keys.
        on_refused: called for each refused connection attempt.
    """

    def __init__(self, ctx: zmq.Context, keys: ClusterKeys,
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        self._on_refused = on_refused
        self._logged: set[tuple[str, str]] = set()
        self.num_refused = 0
        # ZAP is per libzmq context: a handler on a plain (thread) shadow of ``ctx`` serves
        # its sockets whether ``ctx`` is asyncio or not, and no event loop can starve it.
        self.auth = _Authenticator(zmq.Context.shadow(ctx.underlying),
                                   log=logging.getLogger("pdserve.zap"))
        self.auth.provider = _Admission(keys, self._refused)
        self.auth.start()
        self.auth.configure_curve_callback(domain=ZAP_DOMAIN,
                                           credentials_provider=self.auth.provider)
        self._watchers: list[tuple[zmq.Socket, threading.Thread]] = []
        self._stopping = threading.Event()

    def watch(self, sock: zmq.Socket) -> None:
        """Count failed CURVE handshakes on ``sock`` (a bound :func:`secure_server` socket)."""
        address = f"inproc://pdserve-handshakes-{id(sock)}"
        sock.monitor(address, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        pair = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        pair.connect(address)
        thread = threading.Thread(target=self._watch_loop, args=(pair,), daemon=True,
                                  name="pdserve-handshakes")
        thread.start()
        self._watchers.append((sock, thread))

    def _watch_loop(self, pair: zmq.Socket) -> None:
        try:
            while not self._stopping.is_set():
                if not pair.poll(200):
                    continue
                event = recv_monitor_message(pair)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    break
                endpoint = event.get("endpoint", b"")
                self._refused(endpoint.decode("utf-8", "replace")
                              if isinstance(endpoint, bytes) else str(endpoint),
                              "handshake_failed")
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            pair.close(0)

    def _refused(self, address: str, reason: str) -> None:
        self.num_refused += 1
        if (address, reason) not in self._logged:
            self._logged.add((address, reason))
            if reason == "handshake_failed":
                logger.warning("a peer failed the CURVE handshake on %s (no cluster secret, "
                               "a different one, or plain zmq); further failures there are "
                               "only counted", address)
            else:
                logger.warning("refused a connection from %s: its CURVE key is not this "
                               "cluster's (wrong cluster secret); further refusals from it "
                               "are only counted", address or "an unknown address")
        if self._on_refused is not None:
            try:
                self._on_refused(address, reason)
            except Exception:  # a metrics hook must not break authentication
                logger.exception("refusal hook failed")

    def stop(self) -> None:
        """Stop the ZAP handler and the handshake watchers (before closing the sockets)."""
        self._stopping.set()
        for sock, thread in self._watchers:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            thread.join(timeout=1.0)
        self._watchers.clear()
        self.auth.stop()
