"""``pdserve local-cluster``: the api, prefill and decode roles as processes, each in its
own network namespace (root only); ``--down`` removes them."""

from __future__ import annotations

import argparse

from pdserve.cli.serve import add_routing_args


def _cmd_local_cluster(args: argparse.Namespace) -> int:
    from pdserve.cluster import local
    from pdserve.engine.entrypoints.arg_utils import engine_args_to_argv

    if args.down:
        deleted = local.down(args.name)
        print(f"pdserve: cluster {args.name} down ({len(deleted)} namespaces removed)")
        return 0
    server_argv = ["--routing", args.routing, "--prefill-threshold", str(args.prefill_threshold),
                   "--kv-failure-policy", args.kv_failure_policy,
                   "--migration-timeout", str(args.migration_timeout),
                   "--max-migrations", str(args.max_migrations)]
    if args.max_model_len:
        server_argv += ["--max-model-len", str(args.max_model_len)]
    engine_argv = engine_args_to_argv(args) + ["--kv-transport", args.kv_transport]
    state = local.up(args.name, args.num_prefill, args.num_decode, args.model, engine_argv,
                     server_argv, timeout_s=args.ready_timeout, subnet=args.subnet,
                     num_api=args.num_api)
    others = "".join(f"\n  also http://{h.address}:{local.API_PORT}/v1 inside namespace "
                     f"{h.namespace}" for h in state.apis[1:])
    print(f"pdserve: cluster {args.name} ready; API at {state.base_url}/v1 inside namespace "
          f"{state.api.namespace}{others}, e.g.\n  ip netns exec {state.api.namespace} curl -s "
          f"{state.base_url}/v1/models\nlogs: {local.state_dir(args.name)}; stop with "
          f"`pdserve local-cluster --down --name {args.name}`")
    return 0


def add_local_cluster_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``local-cluster`` to the subcommands ``sub``: namespace layout, routing and
    engine flags (passed on to every role)."""
    from pdserve.engine.entrypoints.arg_utils import add_engine_args

    p = sub.add_parser("local-cluster", help="run api, prefill and decode roles as processes, "
                       "each in its own network namespace joined by veth pairs (root only)")
    p.add_argument("model", nargs="?", default=None,
                   help="model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--name", default="pdc", help="cluster name: prefix of its namespaces")
    p.add_argument("--down", action="store_true", help="stop the cluster and remove its "
                   "namespaces")
    p.add_argument("--num-api", type=int, default=1, help="API server namespaces, each with "
                   "its own router; every worker registers with all of them")
    p.add_argument("--num-prefill", type=int, default=2, help="prefill namespaces")
    p.add_argument("--num-decode", type=int, default=1, help="decode namespaces")
    p.add_argument("--subnet", default="10.77.0", help="first three octets of the /24 used "
                   "inside the namespaces")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for every role to be ready")
    p.add_argument("--kv-transport", default="zmq", choices=["zmq", "ucx"])
    add_routing_args(p)
    add_engine_args(p)
    p.set_defaults(func=_cmd_local_cluster)
