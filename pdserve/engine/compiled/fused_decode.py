"""The decode step's forward as one fused CPU call, where the model and the step allow it.

:class:`FusedCpuDecode` is built at load for a Llama-family model (Llama, Qwen2, Qwen3) in
bf16 on a CPU with AVX2/FMA/F16C and a bf16 KV cache; it hands the decoder stack, weights
by reference, to the kernel of :mod:`pdserve.engine.kernels.cpu_decode` (which says why it
exists and what it computes). The model runner asks :meth:`FusedCpuDecode.can_run` each
step and runs the eager model otherwise: layer-wise KV sends, FP8 caches and fp32 models
keep the eager path, and so do steps of more than
:data:`~pdserve.engine.kernels.cpu_decode.MAX_FUSED_TOKENS` tokens unless the weights are
bf16 on a CPU with native bf16 GEMMs (there the kernel runs prefill chunks too, its GEMMs
torch's own: the eager model's values, without its ~20 small ops per layer; steps of up to
384 rows on weights reordered once for oneDNN (pack_weights, or on first use): a 128-token prompt's
step 52.7 -> 33.6 ms on a 2-core Xeon with AMX).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable

import gguf
import torch
from torch import nn

from pdserve.cpu_affinity import background_priority
from pdserve.engine.kernels.cpu_decode import (
    BF16,
    MAX_FUSED_PREFILL_TOKENS, MAX_FUSED_TOKENS, Segment, bf16_segment, cpu_decode_module, group_to_blocks, int4_segment,
    int8_segment,
)
from pdserve.engine.layers.linear import Fp32GemmLinear, cpu_has_native_gemm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from pdserve.engine.quantization.base import QuantizedLinear
from pdserve.engine.quantization.gguf_blocks import dequantize_rows, q4_blocks_as_int4
from pdserve.engine.quantization.gguf_linear import GGUFLinear
from pdserve.engine.quantization.int_linear import IntLinear, unpack_nibbles

logger = logging.getLogger(__name__)

#: Longest context a step of more than 32 tokens may have to run fused where the kernel
#: attends token by token (builds without AVX512-BF16; see ``can_run``).
MAX_FUSED_PREFILL_CONTEXT = 512

_Q4_TYPES = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)


def _gguf_segments(mod: GGUFLinear) -> list[Segment]:
    """Q4_0/Q4_1 rows as int4 (exact), other GGML types as per-channel int8 (the packed
    CPU path's choice, :meth:`GGUFLinear.build_cpu_gemms`)."""
    segs = []
    for ggml_type, _, packed in mod.segments():
        if ggml_type in _Q4_TYPES and mod.in_features % 32 == 0:
            codes, d, offsets = q4_blocks_as_int4(ggml_type, packed, mod.in_features)
            segs.append(int4_segment(codes, d, offsets - 8.0 * d))
        else:
            segs.append(int8_segment(dequantize_rows(ggml_type, packed).float()))
    return segs


def linear_segments(mod: nn.Module) -> list[Segment] | None:
    """The weight of a linear layer as the fused kernel's segments, or None (unsupported).

    bf16 layers (``nn.Linear`` in bf16, or :class:`Fp32GemmLinear`'s bf16 copy, shared with
    its eager GEMV path) stay bf16; int4 layers whose groups are multiples of 32 without
    ``g_idx`` become int4 exactly; other quantized layers become per-channel int8, as their
    packed CPU GEMMs do (:mod:`pdserve.engine.quantization.cpu_packed`).
    """
    if isinstance(mod, Fp32GemmLinear):
        return [bf16_segment(mod.bf16_weights()[0])]  # the eager bf16 GEMV's copy
    if type(mod) is nn.Linear:
        return [bf16_segment(mod.weight)] if mod.weight.dtype == torch.bfloat16 else None
    if isinstance(mod, GGUFLinear):
        return _gguf_segments(mod)
    if isinstance(mod, IntLinear):
        if (mod.bits == 4 and mod.g_idx is None and mod.group_size % 32 == 0
                and mod.in_features % mod.group_size == 0):
            s, z = mod.scales.float(), mod.zeros.float()
            return [int4_segment(unpack_nibbles(mod.qweight),
                                 group_to_blocks(s, mod.group_size),
                                 group_to_blocks(-z * s, mod.group_size))]
        return [int8_segment(mod.dequantize(torch.float32))]
    if isinstance(mod, QuantizedLinear):
        return [int8_segment(mod.dequantize(torch.float32))]
    return None


def _bias(mod: nn.Module) -> torch.Tensor:
    bias = getattr(mod, "bias", None)
    return torch.empty(0) if bias is None else bias.detach().to(torch.bfloat16).float()


def step_tables(block_tables: list[list[int]], query_lens: list[int],
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's view of a step's requests: ``tables [R, max blocks]`` int64 (each
    request's block ids, zero-padded) and ``rows [num_tokens]`` int64 (each token's request)."""
    tables = torch.zeros((len(block_tables), max(len(bt) for bt in block_tables)),
                         dtype=torch.int64)
    for i, bt in enumerate(block_tables):
        tables[i, :len(bt)] = torch.tensor(bt, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    return tables, rows


def _norm_weight(norm: nn.Module | None) -> torch.Tensor:
    """A bf16 RMSNorm's weight as the eager model multiplies by it (bf16 values)."""
    if norm is None:
        return torch.empty(0)
    return norm.weight.detach().to(torch.bfloat16).float()


class FusedCpuDecode:
    """A model's decoder stack in the fused CPU kernel, for steps of few tokens.

    Build with :meth:`build`; the runner calls :meth:`can_run` then :meth:`run`.

    Args:
        module: the built extension.
        model: the loaded Llama-family model (weights are referenced, not copied, except
            where a format is repacked).
        kv_cache: the runner's whole cache, bf16 ``[layers, 2, blocks, block_size,
            kv_heads, head_dim]``.
        block_size: tokens per KV block.
        int8_lm_head: run a dense LM head as per-channel int8 (see :meth:`build`).
    """

    def __init__(self, module, model: LlamaForCausalLM, kv_cache: torch.Tensor,
                 block_size: int, int8_lm_head: bool = False) -> None:
        cfg, inner = model.cfg, model.model
        rotary: RotaryEmbedding = inner.rotary
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.decoder = module.FusedDecoder(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, float(inner.norm.eps), rotary.cos_cached,
            rotary.signed_sin_cached, _norm_weight(inner.norm))
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = []
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                segs = linear_segments(lin)
                if segs is None:
                    raise ValueError(f"no fused form for {type(lin).__name__}")
                parts += [segs, _bias(lin)]
            self.decoder.add_layer(
                _norm_weight(layer.input_layernorm), _norm_weight(layer.post_attention_layernorm),
                _norm_weight(getattr(attn, "q_norm", None)),
                _norm_weight(getattr(attn, "k_norm", None)), *parts)
        #: most tokens a step may have to run fused: prefill chunks too where the CPU
        #: multiplies bf16 natively (the kernel's GEMMs of more than 32 rows are torch's
        #: bf16 ones, quantized weights dequantized to bf16 in each such step: a 1,500-token
        #: prompt of SmolLM2 in rtn-int8 2.4 s through the eager model's int8 GEMMs, see
        #: README "Quantization"; see MAX_FUSED_PREFILL_TOKENS)
        self.max_tokens = (MAX_FUSED_PREFILL_TOKENS if cpu_has_native_gemm(torch.bfloat16)
                           else MAX_FUSED_TOKENS)
        #: longest context a step of more than 32 tokens may have to run fused: any where
        #: the build's prefill chunks take the blocked prefill attention kernel
        self.max_prefill_context = (sys.maxsize if hasattr(module, "prefill_attention")
                                    else MAX_FUSED_PREFILL_CONTEXT)
        #: called with each layer's index after it, in every fused step (a prefill
        #: worker's pause points, :meth:`pdserve.core_turns.CoreTurns.pause_between_layers`)
        self.between_layers: list[Callable[[int], None]] = []
        head = linear_segments(model.lm_head)
        if int8_lm_head and head is not None and all(k == BF16 for k, _, _ in head):
            head = [int8_segment(torch.cat([w for _, w, _ in head]).float())]
        #: the LM head in its own format (a GGUF file's Q8_0 embedding as int8), or None
        self.lm_head = (None if head is None else
                        module.FusedLinear(head, _bias(model.lm_head), cfg.hidden_size))

    @classmethod
    def build(cls, model: nn.Module, kv_cache: torch.Tensor, block_size: int,
              dtype: torch.dtype, device: torch.device,
              int8_lm_head: bool = False) -> "FusedCpuDecode | None":
        """The fused decoder for ``model``, or None where it does not apply (logged):
        not CPU, not bf16 (model and cache), not a Llama-family model with the plain
        forward, rotary tables that are not the head's, or the kernel cannot be built.

        ``int8_lm_head``: a dense LM head runs as per-channel int8 (a GGUF file whose tied
        embedding is Q8_0 loads it dense: this keeps it at 8 bits, half the bf16 bytes)."""
        why = _unsupported(model, kv_cache, dtype, device)
        module = None if why else cpu_decode_module()
        if why is None and module is None:
            why = "the fused CPU decode kernel is not available on this machine"
        if why is not None:
            logger.info("decode steps run the eager model: %s", why)
            return None
        try:
            fused = cls(module, model, kv_cache, block_size, int8_lm_head)
        except (ValueError, RuntimeError) as exc:
            logger.info("decode steps run the eager model: %s", exc)
            return None
        logger.info("steps of up to %d tokens run the fused CPU kernel", fused.max_tokens)
        return fused

    def warm_gemms(self, max_rows: int, stop: threading.Event | None = None) -> int:
        """Run torch's (oneDNN's) GEMMs once at every step size this decoder can take up to
        ``max_rows`` rows (rows padded to multiples of 32: 64, 96, ...), one size at a time
        until ``stop`` is set, so that no request pays for a kernel's compile in its own
        step (each new size cost ~25 ms on a 2-core Xeon: four layer GEMM shapes). Returns
        the number of GEMMs run."""
        count = 0
        for rows in range(2 * MAX_FUSED_TOKENS, min(max_rows, self.max_tokens) + 32, 32):
            if stop is not None and stop.is_set():
                break
            count += self.decoder.warm_gemms(rows)
        return count

    def pack_weights(self) -> int:
        """Reorder the weights of the steps that take them (33-384 rows, and 1,408 or more:
        cpu_decode.cpp's PACKED_MAX_ROWS, SPLIT_GEMM_ROWS) for oneDNN now, not in the first
        such step (the decode worker, whose prefills of short prompts take them, calls it
        before it registers: ~0.1 s and ~200 MB for SmolLM2; a prefill worker's GEMM warm-up
        makes them). Returns the weights reordered."""
        if self.max_tokens <= MAX_FUSED_TOKENS:  # no torch GEMMs here
            return 0
        return self.decoder.pack_weights()

    def start_warming(self, max_rows: int) -> Callable[[], None]:
        """:meth:`warm_gemms` in a background thread at the lowest CPU priority (the serving
        workers start it before they register: run up front it took 2.7-3.7 s of their
        start-up). Returns a function that stops the thread and waits for it (one step
        size, some ms)."""
        stop = threading.Event()

        def run() -> None:
            background_priority(19)
            start = time.perf_counter()
            count = self.warm_gemms(max_rows, stop)
            logger.info("ran %d GEMMs for steps of up to %d rows in %.1f s", count, max_rows,
                        time.perf_counter() - start)

        thread = threading.Thread(target=run, name="gemm-warm-up", daemon=True)
        thread.start()

        def finish() -> None:
            stop.set()
            thread.join(timeout=10)
        return finish

    def can_run(self, num_tokens: int, max_seq_len: int = 0) -> bool:
        """Whether a step of ``num_tokens`` tokens, the longest of its requests
        ``max_seq_len`` tokens long, runs fused. Steps of more than 32 tokens run fused up
        to :attr:`max_prefill_context` tokens of context: where the build attends token by
        token (no AVX512-BF16), that beats torch's flash kernel plus the eager ops only
        while contexts are short (2-core Zen 4: a 32 x 128 prefill 3.86 -> 3.49 s, one
        1,500-token prompt 2.09 -> 2.84 s); with the blocked prefill attention kernel a
        1,500-token prompt took 1.21 s fused against 1.37 s eager."""
        if num_tokens <= 0:
            return False
        return num_tokens <= MAX_FUSED_TOKENS or (
            num_tokens <= self.max_tokens and max_seq_len <= self.max_prefill_context)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            query_lens: list[int], block_tables: list[list[int]],
            aux_layer_ids: tuple[int, ...] = (),
            layer_done: Callable[[int], None] | None = None,
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The model's forward for one step (what :meth:`LlamaForCausalLM.forward` returns).

        Args:
            input_ids, positions, slot_mapping: ``[num_tokens]`` int64.
            query_lens: tokens of each request this step (they sum to ``num_tokens``).
            block_tables: each request's block ids.
            aux_layer_ids, layer_done: as in :meth:`LlamaModel.forward` (``layer_done`` is
                called from inside the kernel's call, between layers).

        Returns:
            ``hidden [num_tokens, hidden_size]`` bf16, or ``(hidden, aux)`` with
            ``aux_layer_ids``.

        Raises:
            RuntimeError: a position, slot or context outside the tables (the kernel checks).
        """
        tables, rows = step_tables(block_tables, query_lens)
        embeds = self.model.model.embed_tokens(input_ids)
        hooks = ([layer_done] if layer_done is not None else []) + self.between_layers
        hidden, aux = self.decoder.forward(
            embeds, positions, slot_mapping, tables, rows, self.kv_cache, list(aux_layer_ids),
            (lambda layer: [hook(layer) for hook in hooks]) if hooks else None)
        bad = [i for i in aux_layer_ids if not 0 <= i < self.decoder.num_layers()]
        if bad:
            raise ValueError(f"aux_layer_ids {bad} are not layers of this model "
                             f"(0 .. {self.decoder.num_layers() - 1})")
        return (hidden, aux) if aux_layer_ids else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [rows, hidden_size] -> logits [rows, vocab_size]`` fp32, what
        :meth:`LlamaForCausalLM.compute_logits` returns (bf16 values); up to
        :data:`~pdserve.engine.kernels.cpu_decode.MAX_FUSED_TOKENS` rows through the fused
        kernel's GEMV over the head's own weight format, more through the model."""
        if self.lm_head is None or not 0 < hidden.shape[0] <= MAX_FUSED_TOKENS:
            return self.model.compute_logits(hidden)
        return self.lm_head.forward(hidden)


def _unsupported(model: nn.Module, kv_cache: torch.Tensor, dtype: torch.dtype,
                 device: torch.device) -> str | None:
    """Why the fused path cannot run this model, or None."""
    if device.type != "cpu":
        return "not a CPU device"
    if dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
        return f"compute dtype {dtype} / KV cache {kv_cache.dtype} (the kernel takes bf16)"
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family model"
    inner = model.model
    if type(inner).forward is not LlamaModel.forward or not isinstance(inner.rotary,
                                                                        RotaryEmbedding):
        return f"{type(inner).__name__} changes the Llama forward"
    cfg = model.cfg
    if inner.rotary.cos_cached.shape[1] != cfg.head_dim:
        return "rotary dimension differs from the head dimension"
    if cfg.head_dim not in (16, 32, 64, 128):
        return "head_dim other than 16, 32, 64 or 128"
    if any(type(layer.mlp) is not LlamaMLP for layer in inner.layers):
        return "an MLP other than SwiGLU"
    return None
