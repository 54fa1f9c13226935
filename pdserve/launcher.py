"""Process entry points behind ``pdserve serve | server | decode-worker``."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import functools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pdserve.cpu_affinity import (apply_worker_cpus, available_cpus, format_cpu_list,
                                  plan_worker_cpus)
from pdserve.child_processes import spawn_worker, stop_processes
from pdserve.core_turns import CoreTurns, core_turns_argv, prefill_step_tokens
from pdserve.front_doors import reuse_port_socket, start_api_servers
from pdserve.supervisor import RestartPolicy, SupervisedWorker, WorkerSupervisor

logger = logging.getLogger(__name__)

#: Seconds ``serve`` waits for its worker to load the model and register.
WORKER_READY_TIMEOUT_S = 600.0


def served_model_name(model: str | None, path: Path) -> str:
    """The name clients send as ``model`` when ``--served-model-name`` is not given:
    the default model's name, else the checkpoint folder's name or the .gguf file's stem."""
    from pdserve.engine.loader import DEFAULT_MODEL

    if model in (None, "default", DEFAULT_MODEL):
        return DEFAULT_MODEL
    return path.stem if path.suffix == ".gguf" else path.name


def _exit_on_sigterm(signum: int, frame) -> None:  # noqa: ARG001
    """SIGTERM -> ``SystemExit(0)``, so that ``finally`` blocks (stopping workers) run.

    uvicorn handles SIGTERM itself while serving, shuts down, then raises the signal again
    with the handler it found installed: with the default one the process would die right
    there, skipping ``stop_processes`` in ``run_serve``.
    """
    raise SystemExit(0)


def cluster_keys_from_args(args: argparse.Namespace, *, ephemeral: bool = False):
    """The CURVE keys a process uses (:mod:`pdserve.security`), or None with
    ``--insecure-no-auth``. ``ephemeral``: with no secret configured, make a random one
    (``pdserve serve``, whose workers are its own children) instead of failing.

    Raises:
        ClusterSecretError: (a ValueError) no secret, an unreadable file, one too short.
    """
    from pdserve.security import ClusterKeys, load_cluster_keys

    if args.insecure_no_auth:
        if args.cluster_secret_file:
            raise ValueError("--insecure-no-auth and --cluster-secret-file exclude each other")
        logger.warning("cluster authentication is off (--insecure-no-auth): anyone who can "
                       "reach the router and KV ports can join this cluster")
        return None
    keys = load_cluster_keys(args.cluster_secret_file, required=not ephemeral)
    return keys if keys is not None else ClusterKeys.generate()


def build_server_state(args: argparse.Namespace, router_address: str, cluster_keys=None):
    """Resolve the model, load its tokenizer, create router + metrics."""
    from pdserve.engine.config import ModelArchConfig
    from pdserve.engine.loader import load_checkpoint, load_tokenizer, resolve_model
    from pdserve.router.router import Router
    from pdserve.server.metrics import ServerMetrics
    from pdserve.server.state import ServerState

    path = resolve_model(args.model)
    arch = ModelArchConfig.from_hf_config(load_checkpoint(path).hf_config)
    name = args.served_model_name or served_model_name(args.model, path)
    tokenizer = load_tokenizer(path)
    metrics = ServerMetrics(name)
    routing = routing_config_from_args(args)
    router = Router(router_address, routing, metrics, max_num_inflight=args.max_num_inflight,
                    cluster_keys=cluster_keys)
    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY") or None
    return ServerState(
        router=router, tokenizer=tokenizer, model_name=name,
        default_max_model_len=args.max_model_len or arch.max_position_embeddings,
        metrics=metrics, api_key=api_key, tool_parser=args.tool_call_parser,
        scrape_worker_metrics=args.worker_metrics,
    )


#: RoutingConfig field -> the flag that sets it (for error messages)
_ROUTING_FLAGS = {"prefill_threshold": "--prefill-threshold", "policy": "--routing",
                  "migration_timeout_s": "--migration-timeout",
                  "max_migrations": "--max-migrations",
                  "kv_failure_policy": "--kv-failure-policy",
                  "reserve_timeout_s": "--kv-transfer-timeout",
                  "first_token_timeout_s": "--first-token-timeout",
                  "max_waiting_per_worker": "--max-waiting-per-worker"}


def routing_config_from_args(args: argparse.Namespace):
    """The routing flags of ``serve``/``server`` as a
    :class:`~pdserve.router.requests.RoutingConfig`.

    Raises:
        ValueError: naming the flag that is out of range.
    """
    from pdserve.router.requests import RoutingConfig

    try:
        # --colocated: no prefill worker exists, so every prompt is local by design (not
        # a "fallback" for want of one)
        threshold = sys.maxsize if getattr(args, "colocated", False) else args.prefill_threshold
        return RoutingConfig(prefill_threshold=threshold, policy=args.routing,
                             migration_timeout_s=args.migration_timeout,
                             max_migrations=args.max_migrations,
                             kv_failure_policy=args.kv_failure_policy,
                             reserve_timeout_s=args.kv_transfer_timeout,
                             first_token_timeout_s=args.first_token_timeout,
                             max_waiting_per_worker=args.max_waiting_per_worker)
    except ValueError as exc:  # name the flag, not the field
        message = str(exc)
        for name, flag in _ROUTING_FLAGS.items():
            message = re.sub(rf"\b{name}\b", flag, message)
        raise ValueError(message) from None


def draining_server(config, state, grace_s: float):
    """A uvicorn server whose first SIGTERM/SIGINT drains instead of stopping.

    The first signal sets ``state.draining`` (new requests get 503 with ``Retry-After``,
    ``/health`` turns 503), waits until the router has no request in flight or
    ``grace_s`` has passed, then lets uvicorn shut down (open responses get
    ``timeout_graceful_shutdown`` more to flush). A second signal stops at once.
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if state.draining or grace_s <= 0:  # stop now: end what runs, with an error
                state.draining = True
                self._loop.call_soon_threadsafe(self._end_inflight)
                self._loop.call_soon_threadsafe(self._loop.call_later, 0.3, self._stop_now)
                return
            state.draining = True
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

        def _end_inflight(self) -> None:
            """Fail every request still in flight: streams get an error event and
            ``[DONE]``, and the workers get their aborts while the router still runs."""
            state.router.fail_all("the server is shutting down")

        def _stop_now(self) -> None:
            self.should_exit = True
            self.force_exit = True

        async def _drain(self) -> None:
            n = state.router.num_inflight
            print(f"pdserve: draining: {n} request{'s' * (n != 1)} in flight, up to "
                  f"{grace_s:.0f} s", file=sys.stderr, flush=True)
            deadline = time.monotonic() + grace_s
            while state.router.num_inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if state.router.num_inflight:
                print(f"pdserve: grace period over with {state.router.num_inflight} "
                      "requests in flight; ending them", file=sys.stderr, flush=True)
                self._end_inflight()
                await asyncio.sleep(0.5)  # let their error events go out
            self.should_exit = True

        async def serve(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

    return DrainingServer(config)


async def _wait_for_workers(state, server, task: asyncio.Task,
                            workers: list[subprocess.Popen]) -> bool:
    """Wait until every worker registered; False (the server stopped) when one exits first,
    the server stops or ``WORKER_READY_TIMEOUT_S`` passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WORKER_READY_TIMEOUT_S
    state.num_workers_expected = len(workers)  # /health is 503 until they registered
    # registered, then died (dropped or not): the supervisor's, not a start-up failure
    registered = state.router.registry.ever_registered
    while len(registered) < len(workers):
        if any(w.poll() is not None for w in workers):
            print("pdserve: a worker exited during start-up; see its log above", file=sys.stderr)
            break
        if task.done() or loop.time() > deadline:
            if not task.done():
                print(f"pdserve: {len(workers) - len(registered)} of {len(workers)} "
                      f"workers did not register within "
                      f"{WORKER_READY_TIMEOUT_S:.0f} s; see their logs above",
                      file=sys.stderr)
            break
        await asyncio.sleep(0.2)
    else:
        return True
    server.should_exit = True
    await task
    return False


async def _serve_http(state, host: str, port: int, supervisor: WorkerSupervisor | None,
                      grace_s: float = 30.0, sock: socket.socket | None = None) -> int:
    """Serve until stopped (on ``sock`` when given: a port shared by several API servers);
    with a ``supervisor`` (``serve``), first wait for its workers to register, then let it
    restart those that exit while serving."""
    import uvicorn

    from pdserve.server.app import KEEP_ALIVE_S, build_app

    app = build_app(state)
    server = draining_server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                            timeout_graceful_shutdown=5,
                                            timeout_keep_alive=KEEP_ALIVE_S), state, grace_s)
    task = asyncio.create_task(server.serve(sockets=None if sock is None else [sock]))
    if supervisor is not None and not await _wait_for_workers(
            state, server, task, [w.proc for w in supervisor.workers if w.role != "api"]):
        return 0 if state.draining else 1  # stopped by a signal, or a start-up failure
    print(f"pdserve: serving {state.model_name} at http://{host}:{port}/v1", flush=True)
    watcher = asyncio.create_task(supervisor.run()) if supervisor is not None else None
    try:
        await task
    finally:
        if watcher is not None:
            watcher.cancel()
    return 0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int, reuse_port: bool = False) -> None:
    """Raises ValueError when ``host:port`` cannot be bound (checked before any loading;
    ``reuse_port``: bound with ``SO_REUSEPORT``, as API servers sharing the port do)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _start_workers(args: argparse.Namespace, engine_argv: list[str], router_address: str,
                   keys) -> list[SupervisedWorker]:
    """Start ``serve``'s decode then prefill workers, each in a slot that can start it again
    (same command line, a new worker id); with ``--worker-metrics`` (the default) each serves
    its own ``/metrics`` on a free loopback port, which the API server merges into its own."""
    num_prefill = 0 if args.colocated else args.num_prefill
    num_decode = 1 if args.colocated else args.num_decode
    kv_argv = ["--kv-transport", args.kv_transport,
               "--kv-transfer-timeout", str(args.kv_transfer_timeout)]
    if args.worker_metrics:  # each serves its /metrics on a free loopback port
        kv_argv += ["--metrics-host", "127.0.0.1", "--metrics-port", "0"]
    prefill_plans, decode_plans = plan_worker_cpus(
        available_cpus(), num_prefill, num_decode, args.prefill_cpus, args.decode_cpus,
        core_turns=args.core_turns)
    kv_argv += core_turns_argv(prefill_plans + decode_plans, args.core_turns)
    slots = []
    for role, plans, role_argv in (
            ("decode", decode_plans, []),
            ("prefill", prefill_plans, ["--kv-transfer-dtype", args.kv_transfer_dtype,
                                        "--kv-transfer-hidden-dtype",
                                        args.kv_transfer_hidden_dtype])):
        for i, plan in enumerate(plans):
            start = functools.partial(spawn_worker, f"{role}-worker", args.model, router_address,
                                      engine_argv + kv_argv + plan.argv() + role_argv,
                                      cluster_keys=keys)
            base_id = f"{role}-{os.getpid()}-{i}"
            slots.append(SupervisedWorker(role, base_id, start, start(base_id)))
    return slots


def run_serve(args: argparse.Namespace, engine_argv: list[str],
              restart_policy: RestartPolicy | None = None) -> int:
    """``pdserve serve``: API server + router here; prefill and decode workers as child
    processes (``--num-prefill``/``--num-decode``; ``--colocated``: one decode worker),
    restarted under ``restart_policy`` (default: :class:`RestartPolicy`'s) when they exit;
    with ``--api-servers N``, N - 1 more API servers on the same port
    (:mod:`pdserve.front_doors`)."""
    check_port_free(args.host, args.port)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    router_address = args.router_address or f"tcp://127.0.0.1:{_free_port('127.0.0.1')}"
    keys = cluster_keys_from_args(args, ephemeral=True)
    state = build_server_state(args, router_address, keys)
    sock, routers, slots = None, [state.router.address], []
    if args.api_servers > 1:
        sock = reuse_port_socket(args.host, args.port)
        extra, slots = start_api_servers(args, keys)
        routers += extra
    slots = _start_workers(args, engine_argv, ",".join(routers), keys) + slots
    supervisor = WorkerSupervisor(slots, restart_policy or RestartPolicy(),
                                  is_stopping=lambda: state.draining,
                                  on_restart=state.metrics.observe_worker_restart,
                                  on_exit=state.router.recovery.on_worker_exit)
    try:
        return asyncio.run(_serve_http(state, args.host, args.port, supervisor,
                                       args.shutdown_grace_period, sock))
    finally:
        stop_processes(supervisor.processes)


def run_server(args: argparse.Namespace) -> int:
    """``pdserve server``: API server + router only; workers connect to ``--router-address``
    (``--reuse-port``: share the HTTP port with other API servers)."""
    check_port_free(args.host, args.port, args.reuse_port)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    keys = cluster_keys_from_args(args)
    state = build_server_state(args, args.router_address or "tcp://0.0.0.0:5557", keys)
    sock = reuse_port_socket(args.host, args.port) if args.reuse_port else None
    state.listen_when_ready = sock is not None  # joins the port's group when it can serve
    print(f"pdserve: router listening at {state.router.address}", flush=True)
    return asyncio.run(_serve_http(state, args.host, args.port, None,
                                   args.shutdown_grace_period, sock))


def _run_worker(args: argparse.Namespace, make_worker) -> int:
    """Load the engine, build the worker with ``make_worker(engine, worker_id, model_name)``,
    serve its ``/metrics`` when ``--metrics-port`` is set, and run it until stopped."""
    from pdserve.engine.entrypoints.arg_utils import engine_config_from_args
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.worker_metrics import WorkerMetricsServer

    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise ValueError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    role = "decode" if args.command == "decode-worker" else "prefill"
    keys = cluster_keys_from_args(args)  # before loading: a missing secret fails fast
    applied = apply_worker_cpus(args.cpus, args.threads)
    logger.info("%s worker on cores %s with %d torch threads", role,
                format_cpu_list(applied.cpus), applied.num_threads)
    config = engine_config_from_args(args, args.model)
    if role == "prefill":  # one token per request: no speculation; no CUDA graphs (KV streams)
        config = dataclasses.replace(config, speculative_method="none", speculative_model=None,
                                     speculative_draft_confidence=0.0,
                                     speculative_disable_by_batch_size=0,
                                     max_num_batched_tokens=prefill_step_tokens(
                                         config.max_num_batched_tokens, args.core_turns))
    engine = LLMEngine(config)
    name = args.served_model_name or served_model_name(args.model, engine.model_path)
    worker_id = args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
    worker = make_worker(engine, worker_id, name, keys)
    worker.drain_s, worker.core_turns = args.shutdown_grace_period, CoreTurns.of(args.core_turns)
    if role == "prefill" and worker.core_turns is not None:
        worker.share_cores_with_decode()
    metrics_server = None
    if args.metrics_port is not None:
        try:
            metrics_server = WorkerMetricsServer(worker, args.metrics_host, args.metrics_port)
        except OSError as exc:
            worker.close()
            raise ValueError(f"cannot serve /metrics on {args.metrics_host}:"
                             f"{args.metrics_port}: {exc.strerror}") from None
        worker.metrics_address = metrics_server.url  # the router learns it at registration
    try:
        worker.run()
    finally:
        if metrics_server is not None:
            metrics_server.close()
    return 0


def run_decode_worker(args: argparse.Namespace) -> int:
    """``pdserve decode-worker``: load the engine, register with the router, serve."""
    from pdserve.decode_worker.worker import DecodeWorker
    from pdserve.kvtransfer.addressing import kv_listen_address
    from pdserve.worker_links import parse_router_addresses

    listen = kv_listen_address(args.kv_host, args.kv_port,
                               parse_router_addresses(args.router)[0])
    return _run_worker(args, lambda engine, worker_id, name, keys: DecodeWorker(
        engine, args.router, worker_id, name, kv_transport=args.kv_transport,
        kv_transfer_timeout_s=args.kv_transfer_timeout, kv_address=listen.bind,
        kv_advertise_host=listen.advertise_host, cluster_keys=keys))


def run_prefill_worker(args: argparse.Namespace) -> int:
    """``pdserve prefill-worker``: load the engine, register with the router, prefill."""
    from pdserve.prefill_worker.worker import PrefillWorker

    return _run_worker(args, lambda engine, worker_id, name, keys: PrefillWorker(
        engine, args.router, worker_id, name, kv_transport=args.kv_transport,
        kv_transfer_dtype=args.kv_transfer_dtype,
        kv_transfer_timeout_s=args.kv_transfer_timeout, cluster_keys=keys,
        eagle_model=args.speculative_model if args.speculative_method == "eagle" else None,
        hidden_dtype=args.kv_transfer_hidden_dtype))
