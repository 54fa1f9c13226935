"""The step API the workers drive: ``add_request``, ``abort_request``, ``step``."""

from __future__ import annotations

import logging

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, ModelArchConfig
from pdserve.engine.loader.checkpoint import load_checkpoint
from pdserve.engine.loader.default_model import resolve_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import RequestDelta, TokenLogprob
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


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
        self.model_path = resolve_model(config.model)
        checkpoint = load_checkpoint(self.model_path)
        self.arch = ModelArchConfig.from_hf_config(checkpoint.hf_config)
        model_max = self.arch.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's maximum "
                f"context length (max_position_embeddings={model_max})"
            )
        self.max_model_len = config.max_model_len or model_max
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.arch, checkpoint, self.max_model_len)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.requests: dict[str, Request] = {}
        self.num_generation_tokens = 0
        self.num_prompt_tokens = 0
        logger.info(
            "engine ready: %s (%s), %d KV blocks x %d tokens (%.1f MiB), max_model_len=%d",
            self.arch.architecture, self.runner.dtype, self.runner.num_kv_blocks,
            config.block_size, self.runner.kv_cache_bytes / 2**20, self.max_model_len,
        )

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, arrival_time: float | None = None) -> None:
        """Queue a request.

        Raises:
            ValueError: duplicate id, empty prompt, token id outside the vocabulary, or
                prompt (+ max_tokens) longer than ``max_model_len``.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.arch.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt} tokens; the maximum context length is "
                f"{self.max_model_len}, which leaves no room for output"
            )
        room = self.max_model_len - num_prompt
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the maximum "
                f"context length {self.max_model_len}"
            )
        if sampling_params.logit_bias and any(t >= vocab for t in sampling_params.logit_bias):
            raise ValueError(f"logit_bias token ids must be < vocab size {vocab}")
        request = Request(request_id, prompt_token_ids, sampling_params, max_tokens,
                          self.arch.eos_token_ids, self.runner.device, arrival_time)
        self.requests[request_id] = request
        self.scheduler.add_request(request)

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
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestDelta]:
        """Run one engine step; returns the requests that produced tokens or finished."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        out = self.runner.execute(sched)
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_computed_blocks(s.request)
        deltas: list[RequestDelta] = []
        lp = out.logprobs
        for row, (request_id, token_id) in enumerate(zip(out.request_ids, out.sampled_token_ids)):
            req = self.requests[request_id]
            req.append_output_token(token_id)
            self.num_generation_tokens += 1
            if req.num_output_tokens == 1:
                self.num_prompt_tokens += req.num_prompt_tokens
            new_logprobs = None
            if req.sampling_params.logprobs is not None and lp is not None:
                k = req.sampling_params.logprobs
                new_logprobs = [TokenLogprob(
                    token_id=token_id,
                    logprob=float(lp.sampled_logprobs[row]),
                    rank=int(lp.sampled_ranks[row]),
                    top_token_ids=lp.top_token_ids[row, :k].tolist(),
                    top_logprobs=lp.top_logprobs[row, :k].tolist(),
                )]
            status = req.check_stop(self.max_model_len)
            if status is not None:
                self.scheduler.finish(req, status)
                del self.requests[request_id]
            queue_time_s = None
            if req.num_output_tokens == 1 and req.first_scheduled_s is not None:
                queue_time_s = req.first_scheduled_s - req.added_s
            deltas.append(RequestDelta(
                request_id=request_id, new_token_ids=[token_id], new_logprobs=new_logprobs,
                finish_reason=status.finish_reason if status else None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens, queue_time_s=queue_time_s,
            ))
        return deltas

    # -- load ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage
