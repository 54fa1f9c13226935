"""Runs the model for one scheduled step: builds the flat token batch, attends over the paged
KV cache, computes logits only for rows that sample, and samples them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.engine.attention import AttentionInputs, get_backend
from pdserve.engine.compiled.cuda_graphs import CUDAGraphRunner
from pdserve.engine.compiled.fused_decode import FusedCpuDecode
from pdserve.engine.config import EngineConfig, ModelArchConfig
from pdserve.engine.layers.linear import swap_to_fp32_gemm, wants_fp32_gemm
from pdserve.engine.loader.checkpoint import Checkpoint
from pdserve.engine.loader.construct import building_model
from pdserve.engine.models import get_model_class
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.paged_kv_cache import PagedKVCache
from pdserve.engine.sample import Sampler, SamplingMetadata, gather_logprobs
from pdserve.engine.sample.logprobs import prompt_logprobs, token_logprobs
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from pdserve.engine.spec_decode.rejection_sampler import RejectionSampler
from pdserve.engine.step_inputs import StepInputs
from pdserve.engine.structured_output import StepMasks, StructuredOutputManager, apply_token_bitmask
from pdserve.engine.quantization import load_model_weights, prepare_cpu_gemms, weight_memory
from pdserve.memory import keep_freed_memory


@dataclass
class ModelRunnerOutput:
    """Tokens emitted by one step, one entry per sampling request, in schedule order.

    Attributes:
        request_ids: the requests that sampled.
        sampled_token_ids: per request its new tokens: one for a plain step, ``1 .. k + 1``
            for a request that verified ``k`` draft tokens (the accepted drafts, then the
            target's correction or bonus token).
        logprobs: per request, a :class:`TokenLogprob` for each new token when the request
            asked for logprobs, else None.
        num_draft_tokens: per request, the drafts it verified (0 without speculation).
        num_accepted_tokens: per request, how many of them were accepted.
        prompt_logprobs: for requests that asked for prompt logprobs and prefilled part of
            their prompt this step, the logprobs of the prompt tokens that part predicts, in
            position order (any scheduled request, sampling or not).
        hidden: the step's target hidden states (or the fused layer outputs the step was
            asked for), for a drafter that reads them (EAGLE).
    """

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob] | None]
    num_draft_tokens: list[int]
    num_accepted_tokens: list[int]
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    hidden: "StepHidden | None" = None


@dataclass
class StepHidden:
    """A step's target hidden states, for drafters that read them (EAGLE).

    Attributes:
        features: ``[num_tokens, hidden_size]`` final (normed) hidden states of the step, or
            with ``aux_layer_ids`` given to :meth:`ModelRunner.execute` the fused layer
            outputs ``[num_tokens, len(aux_layer_ids) * hidden_size]``.
        query_starts: per scheduled request (schedule order), its first row in ``hidden``.
        num_computed_before: per scheduled request, its computed tokens before the step
            (row ``query_starts[i] + j`` is position ``num_computed_before[i] + j``).
    """

    features: torch.Tensor
    query_starts: list[int]
    num_computed_before: list[int]


def load_model(arch: ModelArchConfig, checkpoint: Checkpoint, dtype: torch.dtype,
               device: torch.device, backend, max_model_len: int, progress: bool = True,
               quantization: str | None = None,
               quantization_skip: tuple[str, ...] = ()) -> torch.nn.Module:
    """Build the model class of ``arch`` on ``device`` in ``dtype`` and load its weights.

    Quantized layers (``quantization``, see :mod:`pdserve.engine.quantization`) replace
    ``nn.Linear`` while loading; on CPUs without native 16-bit GEMMs the layers that stay
    dense are then swapped to fp32 GEMMs (see :mod:`pdserve.engine.layers.linear`).

    Raises:
        ValueError: unknown architecture, a checkpoint that does not fit the model, or a
            quantization method that does not fit the checkpoint.
    """
    model_cls = get_model_class(arch.architecture)
    with building_model(dtype, device):
        model = model_cls(arch, backend, max_model_len)
    use_fp32_gemm = wants_fp32_gemm(device, dtype)
    load_model_weights(model, arch, checkpoint, quantization, quantization_skip, dtype,
                       torch.float32 if use_fp32_gemm else dtype, progress=progress)
    model.eval()
    if use_fp32_gemm:
        swap_to_fp32_gemm(model)
    if device.type == "cpu":
        prepare_cpu_gemms(model, dtype)
    return model


class ModelRunner:
    """Owns the model weights, the paged KV cache and the sampler.

    Args:
        config: engine configuration.
        arch: the model's architecture facts.
        checkpoint: where the weights come from.
        max_model_len: longest sequence (prompt + output) served.
        structured_output: builds grammar masks for constrained requests (None: the runner
            serves none).

    Raises:
        ValueError: when the KV budget cannot hold one ``max_model_len`` sequence.
    """

    def __init__(self, config: EngineConfig, arch: ModelArchConfig, checkpoint: Checkpoint,
                 max_model_len: int,
                 structured_output: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.structured_output = structured_output
        self.arch = arch
        self.device = config.torch_device
        keep_freed_memory()  # a CPU step's tensors reuse the last step's heap (pdserve.memory)
        self.dtype = config.resolve_dtype()
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.backend = get_backend(config.attention_backend, self.device)
        self.model = load_model(arch, checkpoint, self.dtype, self.device, self.backend,
                                max_model_len, config.load_progress, config.quantization,
                                config.quantization_skip)
        self.weight_memory = weight_memory(self.model)
        self.kv = PagedKVCache(config, arch, self.dtype, max_model_len)
        # the cache under the names the engine, the workers and the drafters use
        self.kv_cache, self.kv_scales = self.kv.cache, self.kv.scales
        self.kv_caches, self.num_kv_blocks = self.kv.layers, self.kv.num_blocks
        self.kv_cache_bytes = self.kv.num_bytes
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(config.seed)
        self.cuda_graphs = CUDAGraphRunner.build(self.model, self.kv_caches, config,
                                                 self.backend.name, max_model_len)
        #: decode steps of few tokens as one fused CPU call (None: the eager model runs)
        self.fused_decode = (None if config.enforce_eager else FusedCpuDecode.build(
            self.model, self.kv_cache, self.block_size, self.dtype, self.device,
            int8_lm_head=config.quantization == "gguf"))

    def read_kv_blocks(self, block_ids: list[int], layer: int | None = None) -> torch.Tensor:
        """Copy of blocks in the compute dtype (:meth:`PagedKVCache.read_blocks`)."""
        return self.kv.read_blocks(block_ids, layer)

    def read_fp8_kv_blocks(self, block_ids: list[int], layer: int | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 cache's codes and scales as stored (:meth:`PagedKVCache.read_fp8_blocks`)."""
        return self.kv.read_fp8_blocks(block_ids, layer)

    def write_kv_blocks(self, block_ids: list[int], kv: torch.Tensor, num_tokens: int,
                        scales: torch.Tensor | None = None) -> None:
        """Store received blocks (:meth:`PagedKVCache.write_blocks`)."""
        self.kv.write_blocks(block_ids, kv, num_tokens, scales)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, aux_layer_ids: tuple[int, ...] = (),
                layer_done: Callable[[int], None] | None = None) -> ModelRunnerOutput:
        """Run one step's forward pass, then sample (plain rows) and verify (draft rows).

        The host reads results once per group, at the end (``tolist`` of the token ids).

        Args:
            sched: the step.
            aux_layer_ids: target layers whose inputs the output's ``hidden`` carries
                instead of the final hidden states (what an EAGLE-3 drafter declared).
            layer_done: called with each layer's index once its K/V is written (a
                prefill worker streaming KV layer by layer).
        """
        batch = StepInputs.build(sched.scheduled, self.block_size)
        # grammar masks depend only on tokens already emitted: fill them during the forward
        masks = None
        if self.structured_output is not None:
            masks = self.structured_output.submit_step_masks(
                [s.request.grammar for s, _ in batch.plain],
                [(s.request.grammar, s.spec_token_ids) for s, _ in batch.verify])
        attn_inputs = AttentionInputs(
            slot_mapping=torch.tensor(batch.slots, dtype=torch.int64, device=self.device),
            query_lens=batch.query_lens, seq_lens=batch.seq_lens,
            block_tables=batch.block_tables, num_decodes=sched.num_decodes,
            block_size=self.block_size,
        )
        hidden, features = self.forward(batch.input_ids, batch.positions, attn_inputs,
                                        aux_layer_ids, layer_done)
        # for the drafter: this step's hidden states, each scheduled request's first row in
        # them and its num_computed_tokens before the step
        step_hidden = StepHidden(hidden if features is None else features, batch.query_starts,
                                 [s.request.num_computed_tokens for s in sched.scheduled])
        step_masks = masks.result() if masks is not None else None
        prompt_lps = prompt_logprobs(hidden, sched.scheduled, batch.query_starts,
                                     self.compute_logits)
        results: dict[str, tuple[list[int], list[TokenLogprob] | None, int, int]] = {}
        if batch.plain:
            results.update(self._sample_plain(hidden, batch.plain, step_masks))
        if batch.verify:
            results.update(self._verify_drafts(hidden, batch.verify, step_masks))
        order = [s.request.request_id for s in sched.scheduled
                 if s.request.request_id in results]
        return ModelRunnerOutput(
            request_ids=order,
            sampled_token_ids=[results[r][0] for r in order],
            logprobs=[results[r][1] for r in order],
            num_draft_tokens=[results[r][2] for r in order],
            num_accepted_tokens=[results[r][3] for r in order],
            prompt_logprobs=prompt_lps, hidden=step_hidden)

    def forward(self, input_ids: list[int], positions: list[int],
                attn_inputs: AttentionInputs, aux_layer_ids: tuple[int, ...] = (),
                layer_done: Callable[[int], None] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward over one step's tokens, by the fastest path that applies:
        CUDA graphs (decode batches on CUDA), the fused CPU decode kernel (steps of few
        tokens on CPU), else the eager model.

        Args:
            input_ids, positions: the step's tokens and their positions.
            attn_inputs: the step's slots, query/sequence lengths and block tables.
            aux_layer_ids, layer_done: as in :meth:`execute`.

        Returns:
            ``(hidden [num_tokens, hidden_size], features)``: ``features`` the EAGLE-3
            layer inputs ``[num_tokens, len(aux_layer_ids) * hidden_size]``, or None.
        """
        a = attn_inputs
        if self.cuda_graphs is not None and not aux_layer_ids and layer_done is None \
                and self.cuda_graphs.can_run(a.query_lens):
            bs = a.block_size  # one token per request: its slot, without a device sync
            slots = [bt[p // bs] * bs + p % bs for bt, p in zip(a.block_tables, positions)]
            return self.cuda_graphs.run(input_ids, positions, slots, a.block_tables,
                                        a.seq_lens), None
        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        if self.fused_decode is not None and self.fused_decode.can_run(
                len(input_ids), max(a.seq_lens)):
            out = self.fused_decode.run(ids_t, pos_t, a.slot_mapping, a.query_lens,
                                        a.block_tables, aux_layer_ids, layer_done)
            return out if aux_layer_ids else (out, None)
        metadata = self.backend.build_metadata(a)
        if aux_layer_ids:  # EAGLE-3 fuses several target layers
            return self.model(ids_t, pos_t, self.kv_caches, metadata,
                              aux_layer_ids=aux_layer_ids, layer_done=layer_done)
        return self.model(ids_t, pos_t, self.kv_caches, metadata, layer_done=layer_done), None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [rows, hidden_size] -> logits [rows, vocab_size]`` fp32 (through the
        fused CPU kernel where it runs, else the model's LM head)."""
        if self.fused_decode is not None:
            return self.fused_decode.compute_logits(hidden)
        return self.model.compute_logits(hidden)

    def _sampling_metadata(self, requests: list, vocab_size: int) -> SamplingMetadata:
        return SamplingMetadata.build(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[r.generator for r in requests],
            eos_token_id=self.arch.eos_token_ids[0] if self.arch.eos_token_ids else None,
            vocab_size=vocab_size,
            device=self.device,
        )

    def _sample_plain(self, hidden: torch.Tensor, plain: list[tuple[ScheduledRequest, int]],
                      masks: StepMasks | None):
        """One token per request from its last row (all sampling features)."""
        reqs = [s.request for s, _ in plain]
        rows = torch.tensor([row for _, row in plain], dtype=torch.int64, device=self.device)
        logits = self.compute_logits(hidden[rows])  # [num_plain, vocab] fp32
        smeta = self._sampling_metadata(reqs, logits.shape[-1])
        if masks is not None and masks.plain_rows:
            smeta.grammar_bitmask = masks.plain_bitmask
            smeta.grammar_rows = masks.plain_rows
        out = self.sampler(logits, smeta, self.default_generator)
        tokens = out.sampled_token_ids.tolist()
        lps = token_logprobs(reqs, [[t] for t in tokens], out.logprobs)
        return {r.request_id: ([t], lp, 0, 0) for r, t, lp in zip(reqs, tokens, lps)}

    def _verify_drafts(self, hidden: torch.Tensor, verify: list[tuple[ScheduledRequest, int]],
                       masks: StepMasks | None):
        """Verify each request's ``k`` drafts over its ``k + 1`` rows (rejection sampling).

        A constrained request's rows are masked by the grammar state each draft prefix
        reaches, so a draft the grammar forbids has probability 0 and is rejected, and the
        emitted tokens follow the constrained distribution (logprobs stay the raw model's).
        """
        reqs = [s.request for s, _ in verify]
        rows = torch.tensor([first + j for s, first in verify for j in range(s.num_spec_tokens + 1)],
                            dtype=torch.int64, device=self.device)
        logits = self.compute_logits(hidden[rows])  # [sum(k_i + 1), vocab] fp32
        smeta = self._sampling_metadata(reqs, logits.shape[-1])
        target = logits
        if masks is not None and masks.verify_rows:
            target = apply_token_bitmask(logits.float().clone(), masks.verify_bitmask,
                                         masks.verify_rows)
        out = self.rejection_sampler(
            target, [s.spec_token_ids for s, _ in verify],
            [s.spec_draft_probs for s, _ in verify], smeta, self.default_generator)
        emitted, num_accepted = out.to_lists()
        logprobs = None
        if smeta.max_num_logprobs is not None:
            # emitted token j of a request is scored by its verified row j
            starts = itertools.accumulate((s.num_spec_tokens + 1 for s, _ in verify), initial=0)
            emit_rows = torch.tensor([st + j for st, toks in zip(starts, emitted)
                                      for j in range(len(toks))], dtype=torch.int64,
                                     device=self.device)
            tokens = torch.tensor([t for toks in emitted for t in toks], dtype=torch.int64,
                                  device=self.device)
            raw = torch.log_softmax(logits[emit_rows], dim=-1)
            logprobs = gather_logprobs(raw, tokens, smeta.max_num_logprobs)
        lps = token_logprobs(reqs, emitted, logprobs)
        return {r.request_id: (toks, lp, s.num_spec_tokens, m)
                for r, (s, _), toks, lp, m in zip(reqs, verify, emitted, lps, num_accepted)}

