"""The ``--quantization`` / ``--quantization-skip`` flags shared by every engine command."""

from __future__ import annotations

import argparse

from pdserve.engine.quantization.registry import QUANTIZATION_CHOICES


def add_quantization_args(group: argparse._ArgumentGroup) -> None:
    """Add the two flags to an engine argument group."""
    group.add_argument(
        "--quantization", default=None, choices=QUANTIZATION_CHOICES,
        help="weight quantization (default: as the checkpoint declares; none dequantizes "
             "a quantized checkpoint; gguf keeps a .gguf file's blocks packed; fp8 and "
             "rtn-int4/rtn-int8 quantize a dense checkpoint at load)")
    group.add_argument(
        "--quantization-skip", default="",
        help="comma-separated layers kept in 16-bit, e.g. lm_head,layers.0 "
             "(dotted name components; q_proj/gate_proj match their fused layer)")


def parse_skip_list(value: str) -> tuple[str, ...]:
    """``"lm_head, layers.0"`` -> ``("lm_head", "layers.0")``.

    Raises:
        ValueError: an empty or malformed entry (``a,,b``, ``layers.``).
    """
    if not value:
        return ()
    items = tuple(v.strip() for v in value.split(","))
    for item in items:
        if not item or item.startswith(".") or item.endswith(".") or " " in item:
            raise ValueError(f"--quantization-skip: bad layer pattern {item!r} in {value!r}")
    return items


def quantization_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The two flags as argv for a worker process."""
    argv = []
    if args.quantization is not None:
        argv += ["--quantization", args.quantization]
    if args.quantization_skip:
        argv += ["--quantization-skip", args.quantization_skip]
    return argv
