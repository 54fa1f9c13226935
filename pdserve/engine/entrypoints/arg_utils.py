"""Command-line flags for :class:`EngineConfig`, shared by every ``pdserve`` subcommand."""

from __future__ import annotations

import argparse
import dataclasses
import re

from pdserve.engine.config import (
    DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE,
    DTYPES,
    KV_CACHE_DTYPES,
    SPECULATIVE_METHODS,
    EngineConfig,
)
from pdserve.engine.quantization.cli_args import (
    add_quantization_args,
    parse_skip_list,
    quantization_args_to_argv,
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags (names mirror vLLM's where the meaning is the same)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                   help="compute and KV cache dtype (auto: bfloat16)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (default: from the memory budget: 2 "
                        "GiB on CPU, 85%% of free memory on CUDA; give at most one of the three "
                        "sizes)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache size in bytes (all layers, K and V)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="KV cache size as a fraction of free device memory after the weights")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's context length)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests in a batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step (chunked prefill beyond it)")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="turn off prefix caching")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's default RNG")
    g.add_argument("--attention-backend", default="auto",
                   help="auto (triton on CUDA, else torch), torch, triton")
    g.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_CACHE_DTYPES),
                   help="KV cache element type (auto: the compute dtype; fp8: e4m3 with "
                        "per-block, per-head scales, half the bytes)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step through the eager model: no CUDA graphs (CUDA), "
                        "no fused decode kernel (CPU)")
    s = parser.add_argument_group("speculative decoding (decode workers)")
    s.add_argument("--speculative-method", default="none", choices=SPECULATIVE_METHODS,
                   help="draft-token proposer: n-gram prompt lookup, a smaller draft model, "
                        "or an EAGLE head; none turns speculation off")
    s.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per step (k); k + 1 positions are verified at once "
                        "(default: the method's: eagle 2, draft 4, ngram 4)")
    s.add_argument("--speculative-model", default=None,
                   help="draft model folder (method draft) or EAGLE head folder (method eagle; "
                        "\"default\" = the head shipped for the default model)")
    s.add_argument("--speculative-draft-confidence", type=float, default=0.0,
                   help="end a draft chain once the drafter's probability of the whole chain "
                        "(product over its tokens) falls below this (model drafters; 0 = "
                        "always draft k tokens)")
    s.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="draft nothing while at least this many requests are running (large "
                        "batches gain nothing from speculation); 0 = never (default: the "
                        "method's measured crossover: "
                        + ", ".join(f"{m} {n}" for m, n in
                                    DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE.items()) + ")")
    s.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="below that batch size, draft only where drafting measured more "
                        "tokens/s than plain decoding at the same batch size (probed again "
                        "now and then); --speculative-disable-by-batch-size 0 drafts always")
    add_quantization_args(g)


def engine_config_from_args(args: argparse.Namespace, model: str | None) -> EngineConfig:
    """Build the validated config; a ``--speculative-model`` is checked to be what
    ``--speculative-method`` loads (its config only), so ``serve`` fails before any worker
    starts.

    Raises:
        ValueError: naming the bad setting by its flag (``--num-kv-blocks``), as the user
            wrote it.
        FileNotFoundError: the speculative model folder or its config.json is missing.
    """
    try:
        config = _engine_config_from_args(args, model)
        check_speculative_model(config)
    except ValueError as exc:
        raise ValueError(flag_names(str(exc))) from None
    return config


def check_speculative_model(config: EngineConfig) -> None:
    """Check, from its config alone, that ``config.speculative_model`` is an EAGLE head
    folder (``--speculative-method eagle``; ``default``: the shipped head) or a model the
    engine loads (``draft``).

    Raises:
        FileNotFoundError: the path, or an EAGLE head's config.json, does not exist.
        ValueError: the config is not an EAGLE head's.
    """
    if config.speculative_method == "eagle":
        from pdserve.engine.spec_decode.eagle_config import EagleConfig
        from pdserve.engine.spec_decode.eagle_proposer import eagle_head_path

        EagleConfig.from_dir(eagle_head_path(config.speculative_model))
    elif config.speculative_method == "draft":
        from pdserve.engine.loader.default_model import ModelNotFoundError, resolve_model

        try:
            resolve_model(config.speculative_model)
        except ModelNotFoundError as exc:
            raise ModelNotFoundError(f"speculative {exc}") from None


def flag_names(message: str, flags: dict[str, str] | None = None) -> str:
    """Config field names in ``message`` written as the CLI flags that set them: the first
    word when it is a field, and any other field name holding a ``_`` (``max_model_len``).

    Args:
        flags: field -> flag; default: every ``EngineConfig`` field as ``--field-name``.
    """
    if flags is None:
        flags = {f.name: "--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineConfig)}
    first, sep, rest = message.partition(" ")
    rest = re.sub(r"\b[a-z]+(?:_[a-z]+)+\b", lambda m: flags.get(m.group(0), m.group(0)), rest)
    return flags.get(first, first) + sep + rest


def _engine_config_from_args(args: argparse.Namespace, model: str | None) -> EngineConfig:
    return EngineConfig(
        model=model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
        attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_model=args.speculative_model,
        speculative_draft_confidence=args.speculative_draft_confidence,
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
        speculative_adaptive=args.speculative_adaptive,
        quantization=args.quantization, quantization_skip=parse_skip_list(args.quantization_skip),
    )


def engine_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as an argv list, to hand to a worker process."""
    argv = ["--dtype", args.dtype, "--device", args.device, "--block-size", str(args.block_size),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--seed", str(args.seed), "--attention-backend", args.attention_backend,
            "--kv-cache-dtype", args.kv_cache_dtype]
    for flag, value in (("--num-kv-blocks", args.num_kv_blocks),
                        ("--kv-cache-memory-bytes", args.kv_cache_memory_bytes),
                        ("--kv-cache-memory-fraction", args.kv_cache_memory_fraction),
                        ("--max-model-len", args.max_model_len)):
        if value is not None:
            argv += [flag, str(value)]
    if not args.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    argv += ["--speculative-method", args.speculative_method,
             "--speculative-draft-confidence", str(args.speculative_draft_confidence)]
    if args.num_speculative_tokens is not None:
        argv += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    if args.speculative_disable_by_batch_size is not None:
        argv += ["--speculative-disable-by-batch-size", str(args.speculative_disable_by_batch_size)]
    if args.speculative_model:
        argv += ["--speculative-model", args.speculative_model]
    if not args.speculative_adaptive:
        argv.append("--no-speculative-adaptive")
    if args.enforce_eager:
        argv.append("--enforce-eager")
    argv += quantization_args_to_argv(args)
    return argv
