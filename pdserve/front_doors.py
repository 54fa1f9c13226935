"""Several front doors on one machine: ``pdserve serve --api-servers N``.

N API server processes, each with its own router, share one HTTP port and one pool of
workers:

- **one port**: every API server binds the port with ``SO_REUSEPORT``, and the kernel
  spreads incoming connections over them (Linux);
- **one pool**: each worker is given every router's address and registers with, and
  heartbeats to, each of them (:mod:`pdserve.worker_links`); a request's messages go back
  to the router that sent it. Routers share nothing else: each sees the workers' whole load
  and prefix cache in what the workers report.

``serve`` itself is the first API server; it starts the other N - 1 as ``pdserve server``
children on fixed loopback router ports, supervised like the workers, so a restarted one
binds the same router address and the workers register with it again. A killed API
server's clients lose their connections; the others go on serving, and the workers abort
the dead router's requests (its connection closed), so their KV blocks come back.

Kubernetes runs the same shape without this module: the API servers are a Deployment with
several replicas behind a Service, and the workers' ``--router`` names a headless Service
that resolves to every replica (``deploy/k8s``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import socket
import subprocess

logger = logging.getLogger(__name__)

#: ``server`` flags ``serve --api-servers`` does not copy to its extra API servers (it sets
#: them itself, or they only make sense for one process).
_OWN_FLAGS = {"router_address", "host", "port", "reuse_port", "model", "help",
              "cluster_secret_file", "insecure_no_auth"}


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEADDR`` and ``SO_REUSEPORT``, not
    yet listening (uvicorn's ``serve(sockets=...)`` listens on it).

    Raises:
        ValueError: the address cannot be bound (taken without ``SO_REUSEPORT``, or a
            platform without it).
    """
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("several API servers on one port need SO_REUSEPORT (Linux)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(False)
    return sock


async def wait_for_decode_worker(state) -> None:
    """Return once a decode worker accepts requests on ``state.router`` (or the server is
    stopping).

    A ``--reuse-port`` API server shares its port with others, and the kernel hands each
    new connection to any listening member of the group. One that listened before its
    router had a worker would answer 503 to its share of the connections while the others
    serve, so its socket stays bound but not listening until this returns (the app's
    startup; after a restart too, until the workers have registered again).
    """
    while not state.router.registry.accepting("decode") and not state.draining:
        await asyncio.sleep(0.1)


def server_argv(args: argparse.Namespace) -> list[str]:
    """The flags of ``args`` (a parsed ``serve`` command line) that ``pdserve server`` also
    takes, as a ``server`` command line: the same model name, API key, routing, deadlines
    and authentication settings for every API server."""
    from pdserve.cli.serve import add_server_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_server_parser(sub)
    argv: list[str] = []
    for action in sub.choices["server"]._actions:
        if not action.option_strings or action.dest in _OWN_FLAGS:
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def spawn_api_server(args: argparse.Namespace, router_address: str, cluster_keys,
                     api_id: str) -> subprocess.Popen:
    """Start one extra API server: ``pdserve server`` on ``args``' host and port (shared,
    ``--reuse-port``) with its router at ``router_address``, as a child that dies with us.
    The cluster secret travels in its environment, as for the workers."""
    from pdserve.child_processes import spawn_pdserve

    logger.info("starting API server %s (router %s)", api_id, router_address)
    return spawn_pdserve(["server", *([args.model] if args.model else []), "--host", args.host,
                          "--port", str(args.port), "--reuse-port", "--router-address",
                          router_address, *server_argv(args)], cluster_keys)


def start_api_servers(args: argparse.Namespace, cluster_keys) -> tuple[list[str], list]:
    """Start ``args.api_servers - 1`` extra API servers, each in a supervised slot that
    restarts it on the same router address. Returns their router addresses (for the
    workers' ``--router``) and the slots (:class:`~pdserve.supervisor.SupervisedWorker`,
    role ``"api"``)."""
    from pdserve.launcher import _free_port
    from pdserve.supervisor import SupervisedWorker

    addresses, slots = [], []
    for i in range(1, args.api_servers):
        address = f"tcp://127.0.0.1:{_free_port('127.0.0.1')}"
        start = functools.partial(_start_slot, args, address, cluster_keys)
        base_id = f"api-{os.getpid()}-{i}"
        addresses.append(address)
        slots.append(SupervisedWorker("api", base_id, start, start(base_id)))
    return addresses, slots


def _start_slot(args: argparse.Namespace, address: str, cluster_keys,
                api_id: str) -> subprocess.Popen:
    """A supervisor slot's start function (the id of a restart changes, the address not)."""
    return spawn_api_server(args, address, cluster_keys, api_id)
