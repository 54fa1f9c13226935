"""KV-transfer fidelity per wire codec, measured on the model's next-token distributions.

For each held-out Brown-corpus passage (``--num-tokens`` tokens) the engine prefills the
first ``--num-prefix`` tokens as a prefill worker does (``export_kv``), the exported KV
crosses a wire codec (encode then decode, the bytes the wire would carry), and is installed
in fresh paged-cache blocks; the model then scores the continuation teacher-forced (one
forward over the continuation tokens, attending to the installed prefix through the paged
cache). The reference is the same scoring with the ``exact`` codec. Per codec, over every
scored token (continuation tokens after the first, whose distribution the prefill computed):

- perplexity ratio ``exp(mean NLL_codec) / exp(mean NLL_exact)``;
- per-token ``KL(reference || codec)`` in nats: mean and P99;
- top-1 agreement with the reference's argmax;
- greedy flips: positions whose argmax differs; for each, the reference's top-2 gap
  (logprob of its top token minus its second, nats). A flip at a gap near 0 is a near-tie
  any perturbation can flip; a flip at a large gap is the codec's fault.

Codecs (:data:`CODECS`): ``exact`` (the KV's own dtype over the wire), ``bf16`` (rounded to
bf16: the wire with ``--kv-transfer-dtype auto`` on a bf16 model), ``fp8`` (the shipped wire
codec, :func:`pdserve.kvtransfer.wire.encode_kv` with ``use_fp8``: e4m3, one fp32 scale per
(layer, K/V, block, KV head)), ``int8`` (a reference, not a wire format: symmetric int8 with
the same scales), ``fp8-hadamard`` (``--kv-transfer-dtype fp8-hadamard``: the fp8
wire after an orthonormal Hadamard rotation along head_dim, undone on receipt; same
bytes). Deliberately broken codecs
(:data:`BROKEN_CODECS`: ``fp8-scales-x2``, ``zeros``) check that the bounds catch a fault.

    python bench/kv_accuracy.py [--dtypes float32,bfloat16] [--num-passages 20]
        [--num-tokens 600] [--num-prefix 392] [--codecs exact,bf16,fp8,int8,fp8-hadamard]
        [--out bench/results/kv-fidelity-DATE-CPU]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

#: Acceptance bounds of issue 22 (fp8 against the exact KV).
MAX_PPL_RATIO_EXCESS = 0.01
MAX_FLIP_GAP_NATS = 0.1
MAX_KL_VS_BF16 = 10.0

Codec = Callable[[torch.Tensor], torch.Tensor]


# -- codecs: kv [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] -> same -----
def _through_wire(kv: torch.Tensor, use_fp8: bool, rotation: str = "none") -> torch.Tensor:
    """Encode ``kv`` as one wire message, decode it, return it in ``kv.dtype``."""
    from pdserve.kvtransfer.wire import decode_header, decode_kv, encode_header, encode_kv

    enc = encode_kv("r", kv, layer_start=0, num_tokens=1, use_fp8=use_fp8, rotation=rotation)
    header = decode_header(encode_header(enc.header))
    payload, scales = (buf.tobytes() for buf in enc.buffers)
    return decode_kv(header, payload, scales).to_dtype(kv.dtype)


def exact_wire(kv: torch.Tensor) -> torch.Tensor:
    """The KV in its own dtype over the wire (bit-exact)."""
    return _through_wire(kv, use_fp8=False)


def bf16_wire(kv: torch.Tensor) -> torch.Tensor:
    """The KV rounded to bf16 and sent as bf16; returned in ``kv.dtype``."""
    return _through_wire(kv.to(torch.bfloat16), use_fp8=False).to(kv.dtype)


def fp8_wire(kv: torch.Tensor) -> torch.Tensor:
    """The shipped FP8 wire codec (e4m3, per (layer, K/V, block, KV head) fp32 scales)."""
    return _through_wire(kv, use_fp8=True)


def int8_reference(kv: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with one scale per (layer, K/V, block, KV head); returns kv.dtype."""
    x = kv.float()
    scale = x.abs().amax(dim=(3, 5), keepdim=True).clamp_min(1e-30) / 127
    return (torch.round(x / scale) * scale).to(kv.dtype)


def fp8_hadamard_wire(kv: torch.Tensor) -> torch.Tensor:
    """The FP8 wire after a Hadamard rotation along head_dim, undone on receipt
    (``--kv-transfer-dtype fp8-hadamard``; same bytes)."""
    return _through_wire(kv, use_fp8=True, rotation="hadamard")


def fp8_scales_x2(kv: torch.Tensor) -> torch.Tensor:
    """Broken on purpose: the fp8 wire with every scale doubled on receipt."""
    from pdserve.fp8 import dequantize_blocks, quantize_blocks

    codes, scales = quantize_blocks(kv)
    return dequantize_blocks(codes, scales * 2, kv.dtype)


def zeros(kv: torch.Tensor) -> torch.Tensor:
    """Broken on purpose: an all-zero KV of ``kv``'s shape and dtype."""
    return torch.zeros_like(kv)


CODECS: dict[str, Codec] = {"exact": exact_wire, "bf16": bf16_wire, "fp8": fp8_wire,
                            "int8": int8_reference, "fp8-hadamard": fp8_hadamard_wire}
BROKEN_CODECS: dict[str, Codec] = {"fp8-scales-x2": fp8_scales_x2, "zeros": zeros}
ALL_CODECS: dict[str, Codec] = {**CODECS, **BROKEN_CODECS}


# -- passages, prefill, teacher-forced scoring ----------------------------------------------
def load_passages(tokenizer, num_passages: int, num_tokens: int) -> list[list[int]]:
    """The first ``num_tokens`` tokens of each of the first held-out Brown files (those
    pdserve's EAGLE training never reads) that have that many.

    Raises ValueError if fewer than ``num_passages`` files qualify.
    """
    from pdserve.offline.eagle.data import (fetch_brown_corpus, read_brown_files,
                                            split_brown_files)

    files = read_brown_files(fetch_brown_corpus())
    _, held_out = split_brown_files(list(files))
    passages = []
    for name in held_out:
        ids = tokenizer.encode(" ".join(files[name]))
        if len(ids) >= num_tokens:
            passages.append(ids[:num_tokens])
        if len(passages) == num_passages:
            return passages
    raise ValueError(f"only {len(passages)} held-out files have {num_tokens} tokens")


def prefill_kv(engine, prefix: list[int]) -> torch.Tensor:
    """The prefix's KV as a prefill worker exports it.

    Returns [num_layers, 2, ceil(len(prefix) / block_size), block_size, num_kv_heads,
    head_dim] in the engine's compute dtype.
    """
    from pdserve.engine import SamplingParams

    engine.add_request("__prefill__", prefix, SamplingParams(temperature=0.0, max_tokens=1),
                       export_kv=True)
    while engine.has_unfinished_requests:
        engine.step()
    return engine.pop_exported_kv("__prefill__")


@torch.inference_mode()
def score_continuation(engine, kv: torch.Tensor, token_ids: list[int],
                       num_prefix: int) -> torch.Tensor:
    """Log-probabilities the model gives after each continuation token, given ``kv``.

    ``kv`` (as :func:`prefill_kv` returns, possibly codec-perturbed) is written into fresh
    blocks of ``engine``'s paged cache as the decode worker writes received KV; then one
    forward over ``token_ids[num_prefix:]`` (positions ``num_prefix ..``) attends to it.

    Returns [len(token_ids) - num_prefix - 1, vocab_size] fp32 log-softmax; row ``i``
    predicts ``token_ids[num_prefix + 1 + i]``.
    Raises ValueError if the engine lacks free blocks.
    """
    from pdserve.engine.attention import AttentionInputs
    from pdserve.engine.request import Request
    from pdserve.engine.sampling_params import SamplingParams

    runner, bm = engine.runner, engine.block_manager
    n = len(token_ids)
    req = Request("__score__", token_ids, SamplingParams(max_tokens=1), 1, (), runner.device)
    if bm.num_free_blocks < bm.num_blocks_for(n):
        raise ValueError("not enough free KV blocks to score the passage")
    bm.allocate(req)
    try:
        bs, bt = bm.block_size, req.block_table
        runner.write_kv_blocks(bt[:kv.shape[2]], kv, num_tokens=num_prefix)
        positions = list(range(num_prefix, n))
        attn = AttentionInputs(
            slot_mapping=torch.tensor([bt[p // bs] * bs + p % bs for p in positions],
                                      dtype=torch.int64, device=runner.device),
            query_lens=[n - num_prefix], seq_lens=[n], block_tables=[bt], num_decodes=0,
            block_size=bs)
        hidden, _ = runner.forward(token_ids[num_prefix:], positions, attn)
        logits = runner.compute_logits(hidden[:-1])        # [n - num_prefix - 1, V] fp32
        return torch.log_softmax(logits.float(), dim=-1)
    finally:
        bm.free(req)


# -- measures -------------------------------------------------------------------------------
def kl_per_token(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """``KL(ref || other)`` per row, nats: [rows] fp64 from two [rows, V] log-softmaxes."""
    ref = ref_logprobs.double()
    return (ref.exp() * (ref - logprobs.double())).sum(-1).clamp_min(0.0)


@dataclass
class CodecScores:
    """One codec's per-token measures, accumulated over passages (lists of floats)."""

    nll: list[float] = field(default_factory=list)      # -log p(actual token), nats
    kl: list[float] = field(default_factory=list)       # KL(reference || codec), nats
    num_agree: int = 0                                   # argmax equal to the reference's
    flip_gaps: list[float] = field(default_factory=list)  # reference top-2 gap at flips

    def add(self, ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> None:
        """Add one passage: ``ref``/``got`` [rows, V] fp32 log-softmax, ``targets`` [rows]
        int64 (the actual next tokens)."""
        self.nll += (-got.gather(1, targets[:, None])[:, 0]).tolist()
        self.kl += kl_per_token(ref, got).tolist()
        top2 = ref.topk(2, dim=-1).values                  # [rows, 2]
        agree = ref.argmax(-1) == got.argmax(-1)
        self.num_agree += int(agree.sum())
        self.flip_gaps += (top2[:, 0] - top2[:, 1])[~agree].tolist()


@dataclass(frozen=True)
class CodecSummary:
    """A codec's figures against the exact KV (nats; ``ppl_ratio`` unitless)."""

    codec: str
    num_tokens: int
    perplexity: float
    ppl_ratio: float
    mean_kl: float
    p99_kl: float
    top1_agreement: float
    num_flips: int
    max_flip_gap: float | None       # None without flips
    flip_gaps: tuple[float, ...]

    def meets_bounds(self) -> bool:
        """Perplexity within 1 % of the exact KV's and every flip at a near-tie."""
        return (abs(self.ppl_ratio - 1) <= MAX_PPL_RATIO_EXCESS
                and (self.max_flip_gap is None or self.max_flip_gap < MAX_FLIP_GAP_NATS))


def summarize(name: str, scores: CodecScores, ref: CodecScores) -> CodecSummary:
    """Reduce accumulated per-token measures to :class:`CodecSummary` figures."""
    kl = torch.tensor(scores.kl, dtype=torch.float64)
    ppl = math.exp(sum(scores.nll) / len(scores.nll))
    ref_ppl = math.exp(sum(ref.nll) / len(ref.nll))
    gaps = sorted(scores.flip_gaps)
    return CodecSummary(
        codec=name, num_tokens=len(scores.nll), perplexity=ppl, ppl_ratio=ppl / ref_ppl,
        mean_kl=float(kl.mean()), p99_kl=float(torch.quantile(kl, 0.99)),
        top1_agreement=scores.num_agree / len(scores.nll), num_flips=len(gaps),
        max_flip_gap=gaps[-1] if gaps else None, flip_gaps=tuple(round(g, 4) for g in gaps))


def measure(engine, passages: list[list[int]], num_prefix: int,
            codecs: list[str]) -> dict[str, CodecSummary]:
    """Every codec in ``codecs`` (names in :data:`ALL_CODECS`) against ``exact`` over
    ``passages`` (token id lists, each longer than ``num_prefix + 1``)."""
    scores = {name: CodecScores() for name in ["exact", *codecs]}
    for tokens in passages:
        kv = prefill_kv(engine, tokens[:num_prefix])
        targets = torch.tensor(tokens[num_prefix + 1:], dtype=torch.int64)
        ref = score_continuation(engine, exact_wire(kv), tokens, num_prefix)
        scores["exact"].add(ref, ref, targets)
        for name in codecs:
            if name != "exact":
                got = score_continuation(engine, ALL_CODECS[name](kv), tokens, num_prefix)
                scores[name].add(ref, got, targets)
    return {name: summarize(name, s, scores["exact"]) for name, s in scores.items()}


# -- report ---------------------------------------------------------------------------------
def wire_bytes_per_token(name: str, arch_dtype: torch.dtype, engine) -> float:
    """Wire bytes per prompt token for a codec (payload + scales, block-amortized)."""
    cache = engine.runner.kv_cache                      # [L, 2, blocks, bs, H, D]
    num_layers, _, _, bs, heads, dim = cache.shape
    per_value = {"exact": torch.finfo(arch_dtype).bits // 8, "bf16": 2}.get(name, 1)
    scales = 0 if name in ("exact", "bf16") else num_layers * 2 * heads * 4 / bs
    return num_layers * 2 * heads * dim * per_value + scales


def table(summaries: dict[str, CodecSummary], dtype: str, engine) -> str:
    """A markdown table of one dtype's figures."""
    rows = [f"| model dtype | codec | wire B/token | tokens | perplexity | ppl ratio | "
            f"mean KL (nats) | P99 KL | top-1 agree | flips | flips at gap >= "
            f"{MAX_FLIP_GAP_NATS} | max flip gap |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries.values():
        gap = "-" if s.max_flip_gap is None else f"{s.max_flip_gap:.3f}"
        nbytes = wire_bytes_per_token(s.codec, getattr(torch, dtype), engine)
        num_wide = sum(g >= MAX_FLIP_GAP_NATS for g in s.flip_gaps)
        rows.append(f"| {dtype} | {s.codec} | {nbytes:.0f} | {s.num_tokens} | "
                    f"{s.perplexity:.4f} | {s.ppl_ratio:.5f} | {s.mean_kl:.2e} | "
                    f"{s.p99_kl:.2e} | {100 * s.top1_agreement:.2f} % | {s.num_flips} | "
                    f"{num_wide} | {gap} |")
    return "\n".join(rows)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" elsewhere)."""
    path = Path("/proc/cpuinfo")
    text = path.read_text() if path.exists() else ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name")), "unknown")


def main(argv: list[str] | None = None) -> dict[str, dict[str, CodecSummary]]:
    """Run the measurement per dtype; print tables; write ``results-<dtypes>.json`` and
    ``tables-<dtypes>.md`` under ``--out`` if given. Returns dtype -> codec -> summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--num-passages", type=int, default=20)
    p.add_argument("--num-tokens", type=int, default=600)
    p.add_argument("--num-prefix", type=int, default=392)
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    codecs = args.codecs.split(",")
    unknown = sorted(set(codecs) - set(ALL_CODECS))
    if unknown:
        p.error(f"unknown codec(s) {unknown}; choose from {sorted(ALL_CODECS)}")
    if not 0 < args.num_prefix < args.num_tokens - 1:
        p.error("--num-prefix must be in [1, --num-tokens - 2]")

    from pdserve.engine import LLM

    results, texts = {}, [f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}"]
    for dtype in args.dtypes.split(","):
        llm = LLM(None, dtype=dtype, enable_prefix_caching=False, load_progress=False)
        passages = load_passages(llm.tokenizer, args.num_passages, args.num_tokens)
        t0 = time.perf_counter()
        results[dtype] = measure(llm.engine, passages, args.num_prefix, codecs)
        texts.append(f"\nSmolLM2-135M-Instruct {dtype}: {len(passages)} held-out Brown "
                     f"passages x {args.num_tokens} tokens, prefix {args.num_prefix}, "
                     f"{time.perf_counter() - t0:.0f} s\n\n"
                     + table(results[dtype], dtype, llm.engine))
        del llm
    print("\n".join(texts))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = args.dtypes.replace(",", "-")
        (args.out / f"tables-{tag}.md").write_text("\n".join(texts) + "\n")
        (args.out / f"results-{tag}.json").write_text(json.dumps(
            {"cpu": cpu_model(), "args": {k: str(v) for k, v in vars(args).items()},
             "results": {d: {c: asdict(s) for c, s in r.items()} for d, r in results.items()}},
            indent=1))
    return results


if __name__ == "__main__":
    main()
