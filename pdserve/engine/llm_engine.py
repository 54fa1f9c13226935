"""The step API the workers drive: ``add_request``, ``abort_request``, ``step``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, ModelArchConfig
from pdserve.engine.loader.checkpoint import load_checkpoint
from pdserve.engine.loader.default_model import resolve_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import RequestDelta, TokenLogprob
from pdserve.engine.request import Request, RequestStatus, resolve_max_tokens
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.spec_decode import SpecDecodeStats, build_proposer
from pdserve.engine.spec_decode.governor import SpecGovernor, propose_next
from pdserve.engine.step_stats import PrefillStats
from pdserve.engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class KVCapacityError(RuntimeError):
    """Not enough free KV blocks to reserve for a remote prefill right now."""


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    One step is ``schedule() -> execute() -> update()``: the scheduler picks the batch,
    the model runner computes it and samples, and the engine appends tokens, checks stop
    conditions and frees finished requests' blocks.

    Args:
        config: validated engine configuration.

    Raises:
        FileNotFoundError: the model path (or the default model) does not exist.
        ValueError: the configuration does not fit the model (e.g. ``max_model_len``).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model(config.model, prefer_gguf=config.quantization == "gguf")
        checkpoint = load_checkpoint(self.model_path)
        self.arch = ModelArchConfig.from_hf_config(checkpoint.hf_config)
        model_max = self.arch.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's maximum "
                             f"context length (max_position_embeddings={model_max})")
        self.max_model_len = config.max_model_len or model_max
        torch.manual_seed(config.seed)
        self.structured_output = StructuredOutputManager(
            self.model_path, self.arch.vocab_size, list(self.arch.eos_token_ids))
        self.runner = ModelRunner(config, self.arch, checkpoint, self.max_model_len,
                                  structured_output=self.structured_output)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.proposer = build_proposer(config, self.runner, self.block_manager,
                                       self.max_model_len)
        self.spec_stats = SpecDecodeStats(config.num_speculative_tokens)
        self.governor = SpecGovernor() if config.spec_adaptive else None
        self.prefill_stats = PrefillStats()
        self.requests: dict[str, Request] = {}
        #: request id -> [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.exported_kv: dict[str, torch.Tensor] = {}
        #: Prefill-worker mode, optional: ``(request_id, layer, kv, scales, num_prompt_tokens)``
        #: gets each layer of an ``export_kv`` request's prompt KV once the step completing its
        #: prefill has written it (sending overlaps the rest of the forward): ``kv [1, 2,
        #: num_blocks, block_size, num_kv_heads, head_dim]`` in the compute dtype with ``scales``
        #: None, or an FP8 cache's codes as stored with ``scales [1, 2, num_blocks,
        #: num_kv_heads]`` fp32 (nothing re-quantized). Such requests get no :attr:`exported_kv`.
        self.kv_layer_sink: Callable[[str, int, torch.Tensor, torch.Tensor | None, int],
                                     None] | None = None
        self.num_generation_tokens = 0
        logger.info("engine ready: %s (%s), %d KV blocks x %d tokens (%.1f MiB), max_model_len=%d",
                    self.arch.architecture, self.runner.dtype, self.runner.num_kv_blocks,
                    config.block_size, self.runner.kv_cache_bytes / 2**20, self.max_model_len)

    # -- requests ------------------------------------------------------------------------
    def _new_request(self, request_id: str, prompt_token_ids: list[int],
                     sampling_params: SamplingParams, arrival_time: float | None,
                     max_tokens_override: int | None = None) -> Request:
        """Validate and build a request (not yet queued).

        Raises:
            ValueError: duplicate id, or as :func:`~pdserve.engine.request.resolve_max_tokens`.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = resolve_max_tokens(prompt_token_ids, sampling_params, self.arch.vocab_size,
                                        self.max_model_len)
        if max_tokens_override is not None:
            max_tokens = min(max_tokens, max_tokens_override)
        request = Request(request_id, prompt_token_ids, sampling_params, max_tokens,
                          self.arch.eos_token_ids, self.runner.device, arrival_time)
        if sampling_params.structured_output is not None:
            request.grammar = self.structured_output.new_matcher(
                sampling_params.structured_output)
        return request

    def _consume_grammar(self, request: Request) -> bool:
        """Feeds a constrained request's grammar the outputs it has not seen; False if one
        is forbidden (the request cannot continue under its grammar)."""
        if request.grammar is None:
            return True
        return self.structured_output.consume(request.grammar, request.output_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, arrival_time: float | None = None,
                    export_kv: bool = False,
                    output_token_ids: list[int] | None = None) -> None:
        """Queue a request.

        Args:
            export_kv: prefill-worker mode: stop after the first token and keep a copy of the
                prompt's KV blocks in :attr:`exported_kv` (taken with :meth:`pop_exported_kv`).
            output_token_ids: tokens this request already generated elsewhere (a retry
                after its worker died); they are prefilled with the prompt, count toward
                ``max_tokens``, and generation continues after them.

        Raises:
            ValueError: as :meth:`_new_request`, or outputs that already end the request.
        """
        request = self._new_request(request_id, prompt_token_ids, sampling_params,
                                    arrival_time, max_tokens_override=1 if export_kv else None)
        if output_token_ids:
            vocab = self.arch.vocab_size
            if any(not 0 <= t < vocab for t in output_token_ids):
                raise ValueError(f"output token ids must be integers in [0, {vocab})")
            request.token_ids.extend(output_token_ids)
            request.skip_sampled_draws(len(output_token_ids), vocab)
            if request.check_stop(self.max_model_len) is not None:
                raise ValueError("the given output tokens already finish this request")
            if not self._consume_grammar(request):
                raise ValueError("the given output tokens break the request's grammar")
        request.export_kv = export_kv
        self.requests[request_id] = request
        self.scheduler.add_request(request)

    # -- remote prefill (decode side) ----------------------------------------------------
    def reserve_remote_prefill(self, request_id: str, prompt_token_ids: list[int],
                               sampling_params: SamplingParams,
                               arrival_time: float | None = None) -> int:
        """Reserve blocks for a prompt whose KV another worker will send; park the request.

        Returns:
            Prompt tokens already in this worker's prefix cache (their blocks are shared and
            must not be overwritten by the incoming KV).

        Raises:
            ValueError: as :meth:`add_request`.
            KVCapacityError: not enough free blocks now.
        """
        request = self._new_request(request_id, prompt_token_ids, sampling_params, arrival_time)
        if not self.block_manager.can_allocate(request):
            raise KVCapacityError(
                f"not enough free KV blocks for {request.num_tokens} tokens "
                f"({self.block_manager.num_free_blocks} free)")
        self.block_manager.allocate(request)
        request.num_cached_tokens = request.num_computed_tokens
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request_id] = request
        return request.num_cached_tokens

    def complete_remote_prefill(self, request_id: str, first_token_id: int,
                                kv: torch.Tensor | None, scales: torch.Tensor | None = None,
                                hidden: torch.Tensor | None = None, hidden_start: int = 0) -> bool:
        """Write a parked request's received KV into its blocks and start decoding it.

        Args:
            first_token_id: the token the prefill worker sampled (already streamed).
            kv: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` in the
                compute dtype, the prompt's blocks in order (an FP8 cache quantizes them;
                blocks this worker had cached are skipped); or float8_e4m3fn codes with their
                ``scales [num_layers, 2, num_blocks, num_kv_heads]`` fp32 (stored as they are
                in an FP8 cache, else dequantized); None: already written into the blocks.
            hidden: ``[num_prompt_tokens - hidden_start, F]`` its target features (EAGLE's input).

        Returns:
            False if the request is unknown or no longer waiting (aborted meanwhile).

        Raises:
            ValueError: ``kv`` has the wrong shape for this request.
        """
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.WAITING_FOR_KV:
            return False
        bs = self.block_manager.block_size
        num_blocks = self.block_manager.num_blocks_for(req.num_prompt_tokens)
        cache = self.runner.kv_cache
        expected = (cache.shape[0], 2, num_blocks, bs, cache.shape[4], cache.shape[5])
        if kv is not None and tuple(kv.shape) != expected:
            raise ValueError(f"received KV has shape {tuple(kv.shape)}, expected {expected}")
        first = req.num_cached_tokens // bs
        if first < num_blocks and kv is not None:
            self.runner.write_kv_blocks(
                req.block_table[first:num_blocks], kv[:, :, first:],
                num_tokens=req.num_prompt_tokens - first * bs,
                scales=None if scales is None else scales[:, :, first:])
        req.num_computed_tokens = req.num_prompt_tokens
        self.block_manager.cache_computed_blocks(req)
        req.append_output_token(first_token_id)
        req.skip_sampled_draws(1, self.arch.vocab_size)
        status = req.check_stop(self.max_model_len)
        if status is None and not self._consume_grammar(req):
            logger.error("request %s: first token %d breaks its grammar", request_id,
                         first_token_id)
            status = RequestStatus.FINISHED_ABORTED
        if status is not None:  # the router already knows; just release the blocks
            self.scheduler.finish(req, status)
            del self.requests[request_id]
            return True
        req.status = RequestStatus.RUNNING
        req.first_scheduled_s = time.monotonic()
        self.scheduler.add_running(req)
        if hidden is not None and self.proposer is not None:  # the head's state, as if local
            self.proposer.ingest_prompt(req, hidden, hidden_start, len(self.scheduler.running))
        return True

    def resume_locally(self, request_id: str, output_token_ids: list[int]) -> bool:
        """Recompute a parked request's prefill here (its KV will not come).

        Args:
            output_token_ids: tokens already streamed to the client (the prefill worker's
                first token, or nothing); generation continues after them.

        Returns:
            False if the request is unknown or no longer waiting.
        """
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.WAITING_FOR_KV:
            return False
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.num_draft_computed = 0
        req.token_ids = req.prompt_token_ids + list(output_token_ids)
        req.skip_sampled_draws(len(output_token_ids), self.arch.vocab_size)
        if req.grammar is not None:
            req.grammar = self.structured_output.new_matcher(
                req.sampling_params.structured_output)
            if not self._consume_grammar(req):
                self.abort_request(request_id)
                return False
        req.status = RequestStatus.WAITING
        self.scheduler.add_request(req)
        return True

    def pop_exported_kv(self, request_id: str) -> torch.Tensor | None:
        """The KV copied out of a finished ``export_kv`` request (prefill worker), once."""
        return self.exported_kv.pop(request_id, None)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    # -- stepping ------------------------------------------------------------------------
    @property
    def has_unfinished_requests(self) -> bool:
        """Whether a request is waiting or running (``step`` has work); parked ones don't count."""
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestDelta]:
        """Run one engine step; returns the requests that produced tokens or finished.

        With speculation a request may emit several tokens in one step; it stops at the
        first that meets a stop condition and the rest are dropped.
        """
        start_s = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        streamed, layer_done = self._stream_kv_layers(sched)
        out = self.runner.execute(
            sched, self.proposer.target_aux_layer_ids if self.proposer is not None else (),
            layer_done)
        for request_id, items in out.prompt_logprobs.items():
            self.requests[request_id].prompt_logprobs.extend(items)
        self._advance_computed(sched, dict(zip(out.request_ids, out.num_accepted_tokens)))
        deltas = [self._append_tokens(request_id, token_ids, logprobs, num_draft, num_acc,
                                      request_id in streamed)
                  for request_id, token_ids, logprobs, num_draft, num_acc in zip(
                      out.request_ids, out.sampled_token_ids, out.logprobs,
                      out.num_draft_tokens, out.num_accepted_tokens)]
        if self.proposer is not None:
            propose_next(self, sched, out.hidden, deltas, time.perf_counter() - start_s)
        self.spec_stats.maybe_log()
        self.prefill_stats.observe(sched, self.scheduler, time.perf_counter() - start_s)
        return deltas

    def _advance_computed(self, sched: SchedulerOutput, num_accepted: dict[str, int]) -> None:
        """Count the step's tokens as computed, except rejected drafts (their K/V stays in
        the slots past ``num_computed_tokens``, overwritten later): blocks that only held
        them go back, and newly full blocks enter the prefix cache."""
        for s in sched.scheduled:
            req = s.request
            rejected = s.num_spec_tokens - num_accepted.get(req.request_id, s.num_spec_tokens)
            req.num_computed_tokens += s.num_new_tokens - rejected
            if rejected:
                self.block_manager.trim(req, req.num_computed_tokens + 1)
            self.block_manager.cache_computed_blocks(req)

    def _append_tokens(self, request_id: str, token_ids: list[int],
                       logprobs: list[TokenLogprob] | None, num_draft: int, num_accepted: int,
                       kv_streamed: bool) -> RequestDelta:
        """Append a request's sampled tokens up to the first that stops it, and finish the
        request if one did (an ``export_kv`` request whose KV was not streamed layer by
        layer leaves a copy in :attr:`exported_kv`). Returns the step's delta for it."""
        req = self.requests[request_id]
        if num_draft:
            self.spec_stats.observe(num_draft, num_accepted)
        status = None
        new_ids: list[int] = []
        for token_id in token_ids:
            req.append_output_token(token_id)
            new_ids.append(token_id)
            status = req.check_stop(self.max_model_len)
            if req.grammar is not None and status is None:
                status = self._advance_grammar(req, token_id)
            if status is not None:
                break
        self.num_generation_tokens += len(new_ids)
        if status is not None:
            if req.export_kv and not kv_streamed:
                num_blocks = self.block_manager.num_blocks_for(req.num_prompt_tokens)
                self.exported_kv[request_id] = self.runner.read_kv_blocks(
                    req.block_table[:num_blocks])
            self.scheduler.finish(req, status)
            del self.requests[request_id]
        first_delta = req.num_output_tokens == len(new_ids)
        return RequestDelta(
            request_id=request_id, new_token_ids=new_ids,
            new_logprobs=logprobs[:len(new_ids)] if logprobs is not None else None,
            finish_reason=status.finish_reason if status else None,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
            queue_time_s=(req.first_scheduled_s - req.added_s
                          if first_delta and req.first_scheduled_s is not None else None),
            prompt_logprobs=(req.prompt_logprobs if first_delta
                             and req.sampling_params.prompt_logprobs is not None else None),
        )

    def _advance_grammar(self, req: Request, token_id: int) -> RequestStatus | None:
        """Consumes an emitted token; the request stops once its grammar has ended."""
        if not req.grammar.accept_token(token_id):  # the mask makes this unreachable
            logger.error("request %s: sampled token %d is outside its grammar",
                         req.request_id, token_id)
            return RequestStatus.FINISHED_ABORTED
        return RequestStatus.FINISHED_STOPPED if req.grammar.is_terminated else None

    def _stream_kv_layers(self, sched) -> tuple[set[str], Callable[[int], None] | None]:
        """The ``layer_done`` callback that hands :attr:`kv_layer_sink` each layer's KV of
        the ``export_kv`` requests whose prefill this step completes, and their ids
        (``(set(), None)``: nothing to stream)."""
        if self.kv_layer_sink is None:
            return set(), None
        targets = []
        for s in sched.scheduled:
            req = s.request
            if req.export_kv and req.num_computed_tokens + s.num_new_tokens >= req.num_tokens:
                num_blocks = self.block_manager.num_blocks_for(req.num_prompt_tokens)
                targets.append((req.request_id, req.block_table[:num_blocks],
                                req.num_prompt_tokens))
        if not targets:
            return set(), None
        sink, runner = self.kv_layer_sink, self.runner

        def hook(layer: int) -> None:
            for request_id, block_ids, num_tokens in targets:
                if runner.kv_scales is None:
                    kv, scales = runner.read_kv_blocks(block_ids, layer), None
                else:
                    kv, scales = runner.read_fp8_kv_blocks(block_ids, layer)
                sink(request_id, layer, kv, scales, num_tokens)

        return {t[0] for t in targets}, hook

    # -- load ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """KV blocks no live request holds (cached prefix blocks among them)."""
        return self.block_manager.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by live requests, 0.0 - 1.0."""
        return self.block_manager.usage
