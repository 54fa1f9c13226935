"""The commands that run a serving cluster's processes: ``serve`` (API server and workers
in one go), ``server`` (API server and router only), ``decode-worker`` and
``prefill-worker`` (each registers with a router), with the flag groups they share."""

from __future__ import annotations

import argparse

from pdserve.server.tools.parsers import TOOL_PARSERS


def _cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.engine.entrypoints.arg_utils import engine_args_to_argv, engine_config_from_args
    from pdserve.launcher import run_serve

    from pdserve.launcher import routing_config_from_args

    engine_config_from_args(args, args.model)  # validate here, before any process starts
    restart_policy_from_args(args)
    routing_config_from_args(args)
    if args.num_prefill < 0 or args.num_decode < 1:
        raise ValueError("--num-prefill must be >= 0 and --num-decode >= 1")
    if not 1 <= args.api_servers <= 64:
        raise ValueError(f"--api-servers must be in 1..64, got {args.api_servers}")
    argv = engine_args_to_argv(args)
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    return run_serve(args, argv, restart_policy_from_args(args))


#: RestartPolicy field -> the ``serve`` flag that sets it
_RESTART_FLAGS = {"max_restarts": "--max-worker-restarts",
                  "window_s": "--worker-restart-window",
                  "initial_backoff_s": "--worker-restart-backoff",
                  "max_backoff_s": "--max-worker-restart-backoff"}


def restart_policy_from_args(args: argparse.Namespace):
    """``serve``'s supervision flags as a :class:`~pdserve.supervisor.RestartPolicy`.

    Raises:
        ValueError: naming the flag that is out of range.
    """
    from pdserve.supervisor import RestartPolicy

    try:
        return RestartPolicy(max_restarts=args.max_worker_restarts,
                             window_s=args.worker_restart_window,
                             initial_backoff_s=args.worker_restart_backoff,
                             max_backoff_s=args.max_worker_restart_backoff)
    except ValueError as exc:
        message = str(exc)
        for name, flag in _RESTART_FLAGS.items():
            message = message.replace(f"{name} ", f"{flag} ").replace(f"{name})", f"{flag})")
        raise ValueError(message) from None


def _cmd_server(args: argparse.Namespace) -> int:
    from pdserve.launcher import routing_config_from_args, run_server

    routing_config_from_args(args)  # validate before loading anything
    return run_server(args)


def _cmd_decode_worker(args: argparse.Namespace) -> int:
    from pdserve.launcher import run_decode_worker

    return run_decode_worker(args)


def _cmd_prefill_worker(args: argparse.Namespace) -> int:
    from pdserve.launcher import run_prefill_worker

    return run_prefill_worker(args)


def _add_kv_args(p: argparse.ArgumentParser, role: str) -> None:
    g = p.add_argument_group("KV transfer")
    g.add_argument("--kv-transport", default="zmq", choices=["zmq", "ucx"],
                   help="transport pushing KV from prefill to decode workers")
    g.add_argument("--kv-transfer-timeout", type=float, default=10.0,
                   help="seconds each stage of a KV transfer may take")
    if role == "decode":
        g.add_argument("--kv-host", default="127.0.0.1",
                       help="address the KV receiver binds and advertises to prefill "
                            "workers; 'auto': all interfaces, advertising the local address "
                            "of the route to the router (containers, pods, namespaces)")
        g.add_argument("--kv-port", type=int, default=0,
                       help="port of the KV receiver (0: a free one)")
    if role in ("serve", "prefill"):
        g.add_argument("--kv-transfer-dtype", default="fp8",
                       choices=["fp8", "fp8-hadamard", "auto"],
                       help="fp8: e4m3 with per-block, per-head scales; fp8-hadamard: the "
                            "same after a Hadamard rotation along head_dim (undone on "
                            "receipt; same bytes, lower error: see the README); auto: the "
                            "cache dtype, exact")
        g.add_argument("--kv-transfer-hidden-dtype", default="bfloat16",
                       choices=["bfloat16", "float16", "float32", "auto", "none"],
                       help="with --speculative-method eagle: the dtype in which each "
                            "prompt's hidden states (the EAGLE head's input) follow its KV, "
                            "so the decode worker's head sees the prompt as after a local "
                            "prefill (auto: the model's dtype; none: not sent, and the head "
                            "drafts without the prompt: fewer drafts accepted)")


def add_routing_args(p: argparse.ArgumentParser) -> None:
    """Add the "routing" group: which prompts go to a prefill worker, and what happens when
    their KV transfer fails (``serve``, ``server`` and ``local-cluster``)."""
    g = p.add_argument_group("routing")
    g.add_argument("--routing", default="threshold",
                   choices=["threshold", "predicted", "length"],
                   help="threshold: prompts with --prefill-threshold uncached tokens or more "
                        "go to a prefill worker; predicted: for those, the path (decode "
                        "worker itself or a prefill worker) with the lower predicted time to "
                        "first token, from the workers' measured rates and queues, the stall "
                        "a local prefill causes the decode worker's requests and the prompts "
                        "expected to arrive meanwhile (the threshold applies while no rate "
                        "is measured yet); length: prompts with --prefill-threshold tokens "
                        "or more, cached or not, go to a prefill worker")
    g.add_argument("--prefill-threshold", type=int, default=512,
                   help="prompts with at least this many tokens not cached on the decode "
                        "worker go to a prefill worker (length: tokens, cached or not; "
                        "predicted: the floor below which a prompt stays local)")
    g.add_argument("--kv-failure-policy", default="recompute", choices=["recompute", "fail"],
                   help="when a KV transfer fails: recompute on the decode worker, or fail")
    g.add_argument("--migration-timeout", type=float, default=120.0,
                   help="seconds a request whose decode worker died waits for another one "
                        "(e.g. the restarted one) before it fails; 0: fail at once when no "
                        "decode worker is left")
    g.add_argument("--max-migrations", type=int, default=10, metavar="N",
                   help="times one request may move to another decode worker after the one "
                        "running it died; past it the request fails (a request that crashes "
                        "every worker it lands on must not take them all down)")


def _add_supervision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("supervision (restarting workers that exit while serving)")
    g.add_argument("--max-worker-restarts", type=int, default=5, metavar="N",
                   help="restarts of one worker allowed within --worker-restart-window; past "
                        "them it stays down (0: never restart; default: 5)")
    g.add_argument("--worker-restart-window", type=float, default=600.0, metavar="SECONDS",
                   help="the sliding window --max-worker-restarts counts over (default: 600)")
    g.add_argument("--worker-restart-backoff", type=float, default=1.0, metavar="SECONDS",
                   help="delay before restarting a worker; it doubles with each exit within "
                        "60 s of the last restart, and starts over once a worker stayed up "
                        "60 s (default: 1)")
    g.add_argument("--max-worker-restart-backoff", type=float, default=30.0,
                   metavar="SECONDS", help="the cap on that delay (default: 30)")


def _add_auth_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    g = p.add_argument_group("cluster authentication (CURVE on every zmq socket)")
    g.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help="file holding the cluster secret (>= 16 bytes), the same on the "
                        "server and every worker (else $PDSERVE_CLUSTER_SECRET_FILE or "
                        "$PDSERVE_CLUSTER_SECRET)" + ("; default for serve: a random one "
                                                      "made at start" if serve else ""))
    p.add_argument("--shutdown-grace-period", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, finish in-flight requests for up to this long (new "
                        "ones get 503 with Retry-After) before stopping; a second signal "
                        "stops at once (default: 30, the Kubernetes manifests' "
                        "terminationGracePeriodSeconds)")
    g.add_argument("--insecure-no-auth", action="store_true",
                   help="run the router/worker sockets without authentication or "
                        "encryption (anyone who can reach them can join the cluster)")


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients send as `model` (default: derived from the model)")


# argparse names a type function in its "invalid <name> value" errors: keep these names.
def _cpu_list(value: str) -> tuple[int, ...]:
    from pdserve.cpu_affinity import parse_cpu_list

    try:
        return parse_cpu_list(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(value: str) -> int:
    port = int(value)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {port}")
    return port


def _add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP server binds")
    p.add_argument("--port", type=_port, default=8000, help="HTTP port")
    p.add_argument("--api-key", default=None,
                   help="require this bearer token on /v1 (or set PDSERVE_API_KEY; "
                        "default: no token)")
    p.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read from the model's text (tool_choice auto)")
    p.add_argument("--router-address", default=None,
                   help="zmq address the router binds (default: serve: a free loopback "
                        "port; server: tcp://0.0.0.0:5557)")
    p.add_argument("--max-num-inflight", type=int, default=1024,
                   help="requests in flight above which new ones get 503 with Retry-After")
    p.add_argument("--max-waiting-per-worker", type=int, default=512,
                   help="requests queued on a decode worker beyond those it runs; past it "
                        "new requests get 503 with Retry-After at once (default: 512)")
    p.add_argument("--first-token-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="a request still without its first token after this long (queued "
                        "behind others, then prefilled), or a migrated one without a token "
                        "from its new decode worker, ends with a 503 error instead of "
                        "waiting on; 0 waits for ever (default: 600)")


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``serve`` to the subcommands ``sub``: HTTP, worker-count, core-placement,
    routing, KV-transfer, authentication and engine flags."""
    from pdserve.engine.entrypoints.arg_utils import add_engine_args

    p = sub.add_parser("serve", help="serve the OpenAI API: API server + prefill and decode "
                                      "workers")
    _add_model_arg(p)
    _add_http_args(p)
    p.add_argument("--num-prefill", type=int, default=1, help="prefill worker processes")
    p.add_argument("--num-decode", type=int, default=1, help="decode worker processes")
    p.add_argument("--api-servers", type=int, default=1, metavar="N",
                   help="API server processes, each with its own router, sharing --port "
                        "(SO_REUSEPORT) and the workers (each registers with every router)")
    p.add_argument("--colocated", action="store_true",
                   help="one decode worker that prefills everything itself")
    p.add_argument("--decode-cpus", type=_cpu_list, default=None,
                   help="cores every decode worker runs on, one torch thread each (default: "
                        "the available cores split among the decode workers)")
    p.add_argument("--prefill-cpus", type=_cpu_list, default=None,
                   help="cores every prefill worker runs on, one torch thread each (default: "
                        "the available cores split among the prefill workers, with one "
                        "thread fewer than cores when decode workers share them)")
    p.add_argument("--no-core-turns", dest="core_turns", action="store_false",
                   help="workers on the same cores step side by side (by default, when "
                        "every worker runs on the same cores, they take turns at model "
                        "steps, each on every core)")
    p.add_argument("--no-worker-metrics", dest="worker_metrics", action="store_false",
                   help="leave the workers' own series out of /metrics (by default each "
                        "worker serves them on a free loopback port and /metrics adds them, "
                        "labelled worker=<worker id>)")
    _add_supervision_args(p)
    add_routing_args(p)
    _add_kv_args(p, "serve")
    _add_auth_args(p, serve=True)
    add_engine_args(p)
    p.set_defaults(func=_cmd_serve)


def add_server_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``server`` to the subcommands ``sub``: the API server and router, without
    engine flags (the workers that connect bring their own)."""
    p = sub.add_parser("server", help="API server + router only; workers connect to it")
    _add_model_arg(p)
    _add_http_args(p)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-transfer-timeout", type=float, default=10.0,
                   help="seconds a request may wait for a decode worker to reserve KV")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind --port with SO_REUSEPORT, so several API servers on this "
                        "host share it (the kernel spreads connections over them); it "
                        "starts listening once a decode worker has registered")
    p.add_argument("--worker-metrics", action="store_true",
                   help="/metrics also carries the series of every worker that serves its "
                        "own (--metrics-port), fetched on each scrape and labelled "
                        "worker=<worker id>; off by default, where Prometheus scrapes the "
                        "workers itself (compose, Kubernetes)")
    add_routing_args(p)
    _add_auth_args(p)
    p.set_defaults(func=_cmd_server)


def add_worker_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``decode-worker`` and ``prefill-worker`` to the subcommands ``sub``; they differ
    only in their KV-transfer flags (the decode side binds a receiver, the prefill side
    picks the wire dtype)."""
    from pdserve.engine.entrypoints.arg_utils import add_engine_args

    for kind, func, role in (("decode-worker", _cmd_decode_worker, "decode"),
                             ("prefill-worker", _cmd_prefill_worker, "prefill")):
        p = sub.add_parser(kind, help=f"a {role} worker that registers with a router")
        _add_model_arg(p)
        p.add_argument("--router", required=True,
                       help="router address, e.g. tcp://127.0.0.1:5557, or several, "
                            "comma-separated, to serve several API servers; a host name "
                            "that resolves to several addresses (a headless Service) "
                            "counts as one router at each")
        p.add_argument("--worker-id", default=None, help="unique worker name (default: "
                       "role-host-pid)")
        p.add_argument("--metrics-port", type=int, default=None,
                       help="serve this worker's Prometheus /metrics on this port (0: a free "
                            "one; default: none); the worker tells the router where, so an "
                            "API server with --worker-metrics shows its series too")
        p.add_argument("--metrics-host", default="127.0.0.1",
                       help="address the /metrics server binds")
        p.add_argument("--cpus", type=_cpu_list, default=None,
                       help="cores to run on, e.g. 0-3,6 (default: every core this process "
                            "may use)")
        p.add_argument("--threads", type=int, default=None,
                       help="torch threads (default: one per core of --cpus)")
        p.add_argument("--core-turns", default=None, metavar="DIR",
                       help="take turns at model steps with the workers given the same "
                            "directory (workers on the same cores; serve sets it)")
        _add_kv_args(p, role)
        _add_auth_args(p)
        add_engine_args(p)
        p.set_defaults(func=func)
