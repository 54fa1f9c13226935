"""Where a KV receiver listens and which address it tells prefill workers.

On one machine the receiver listens on loopback. Across machines (containers, pods, network
namespaces) it must listen on an interface the prefill workers reach and advertise that
interface's address, not ``0.0.0.0``::

    --kv-host 127.0.0.1   bind tcp://127.0.0.1:PORT, advertise it         (one machine)
    --kv-host 10.0.0.4    bind tcp://10.0.0.4:PORT,  advertise it         (a known address)
    --kv-host auto        bind tcp://0.0.0.0:PORT,   advertise the local address of the
                          route towards the router (the address peers see us by)
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

#: ``--kv-host`` value that binds every interface and advertises the route to the router.
AUTO_HOST = "auto"


@dataclass(frozen=True)
class KVListenAddress:
    """``bind``: the zmq address to bind; ``advertise_host``: the host to publish instead of
    the bound one, or None to publish the bound address as it is."""

    bind: str
    advertise_host: str | None


def split_tcp_address(address: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` -> ``(HOST, PORT)`` (PORT may be ``*``).

    Raises:
        ValueError: not a ``tcp://host:port`` address.
    """
    if not address.startswith("tcp://") or ":" not in address[len("tcp://"):]:
        raise ValueError(f"expected tcp://HOST:PORT, got {address!r}")
    host, port = address[len("tcp://"):].rsplit(":", 1)
    return host.strip("[]"), port


def replace_tcp_host(address: str, host: str) -> str:
    """``tcp://OLD:PORT`` -> ``tcp://HOST:PORT``; other schemes (``ipc://``) unchanged."""
    if not address.startswith("tcp://"):
        return address
    _, port = split_tcp_address(address)
    return f"tcp://{host}:{port}"


def local_address_towards(address: str) -> str:
    """The local IP address the kernel would use to reach ``tcp://HOST:PORT``.

    Resolves HOST (a DNS name such as a compose service or Kubernetes Service works) and
    asks for the route with a connected UDP socket; no packet is sent.

    Raises:
        ValueError: ``address`` is not ``tcp://``, or HOST does not resolve / is unreachable.
    """
    host, port = split_tcp_address(address)
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except (OSError, IndexError) as exc:
        raise ValueError(f"no route towards {address}: {exc}") from None


def kv_listen_address(kv_host: str, kv_port: int, router_address: str) -> KVListenAddress:
    """Bind address and advertised host of a decode worker's KV receiver.

    Args:
        kv_host: an IP address to bind and advertise, or :data:`AUTO_HOST`.
        kv_port: TCP port; 0 picks a free one.
        router_address: the router's ``tcp://HOST:PORT`` (used by :data:`AUTO_HOST`).

    Raises:
        ValueError: ``kv_port`` out of range, or no route towards the router.
    """
    if not 0 <= kv_port < 65536:
        raise ValueError(f"kv_port: must be in 0..65535, got {kv_port}")
    port = str(kv_port) if kv_port else "*"
    if kv_host == AUTO_HOST:
        return KVListenAddress(f"tcp://0.0.0.0:{port}", local_address_towards(router_address))
    return KVListenAddress(f"tcp://{kv_host}:{port}", None)
