"""Linux network namespaces joined by veth pairs on a bridge: one "host" per role.

    ns NAME-api   eth0 10.77.0.10 ─┐
    ns NAME-p0    eth0 10.77.0.20 ─┤   ns NAME-hub: bridge br0 (no address), one veth per
    ns NAME-p1    eth0 10.77.0.21 ─┤   host; nothing is created in the caller's namespace
    ns NAME-d0    eth0 10.77.0.30 ─┘

Needs root (CAP_NET_ADMIN) and ``ip`` (iproute2). Every veth is created directly inside
its namespaces, so the caller's namespace never sees an interface or an address.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

#: CLONE_NEWNET, for setns(2).
_CLONE_NEWNET = 0x40000000
#: Seconds an ``ip`` command may take.
IP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Host:
    """One namespace of the topology: ``namespace`` holds ``eth0`` at ``address``."""

    role: str  # "api", "prefill" or "decode"
    namespace: str
    address: str


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``.

    Raises:
        RuntimeError: ``check`` and the command failed (its stderr in the message).
    """
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def list_namespaces() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    """Pids of the processes living in ``namespace`` (empty if it does not exist)."""
    out = ip("netns", "pids", namespace, check=False).stdout
    return [int(p) for p in out.split()]


def hub_namespace(name: str) -> str:
    """The namespace holding cluster ``name``'s bridge."""
    return f"{name}-hub"


def create_topology(name: str, hosts: list[Host], prefix_len: int = 24) -> None:
    """Create the hub with its bridge and one namespace per host, wired and up.

    Raises:
        RuntimeError: an ``ip`` command failed (a namespace of that name exists, no
            permission, ...); what was created so far is left for :func:`delete_topology`.
    """
    hub = hub_namespace(name)
    ip("netns", "add", hub)
    ip("-n", hub, "link", "add", "br0", "type", "bridge")
    ip("-n", hub, "link", "set", "br0", "up")
    ip("-n", hub, "link", "set", "lo", "up")
    for i, host in enumerate(hosts):
        ip("netns", "add", host.namespace)
        port = f"h{i}"
        ip("link", "add", "eth0", "netns", host.namespace, "type", "veth",
           "peer", "name", port, "netns", hub)
        ip("-n", hub, "link", "set", port, "master", "br0")
        ip("-n", hub, "link", "set", port, "up")
        ip("-n", host.namespace, "addr", "add", f"{host.address}/{prefix_len}", "dev", "eth0")
        ip("-n", host.namespace, "link", "set", "eth0", "up")
        ip("-n", host.namespace, "link", "set", "lo", "up")


def delete_topology(name: str, namespaces: list[str]) -> None:
    """Delete ``namespaces`` and the hub (their veths and bridge go with them); missing ones
    are skipped."""
    existing = set(list_namespaces())
    for ns in [*namespaces, hub_namespace(name)]:
        if ns in existing:
            ip("netns", "del", ns, check=False)


def interface_bytes(namespace: str, dev: str = "eth0") -> tuple[int, int]:
    """``(rx_bytes, tx_bytes)`` of ``dev`` inside ``namespace``."""
    base = ["netns", "exec", namespace, "cat"]
    rx = ip(*base, f"/sys/class/net/{dev}/statistics/rx_bytes").stdout
    tx = ip(*base, f"/sys/class/net/{dev}/statistics/tx_bytes").stdout
    return int(rx), int(tx)


def run_in_namespace(namespace: str, fn: Callable[[], T]) -> T:
    """Call ``fn()`` on a fresh thread that joined ``namespace``: sockets it opens live
    there (setns(2) changes only the calling thread). Re-raises what ``fn`` raised.

    Raises:
        OSError: the namespace cannot be joined.
    """
    result: dict[str, object] = {}

    def target() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                result["error"] = OSError(err, f"setns({namespace}): {os.strerror(err)}")
                return
        finally:
            os.close(fd)
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]  # type: ignore[return-value]
