"""Runs the model for one scheduled step: builds the flat token batch, attends over the paged
KV cache, computes logits only for rows that sample, and samples them."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from pdserve.engine.attention import AttentionInputs, get_backend
from pdserve.engine.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    DEFAULT_GPU_KV_CACHE_FRACTION,
    EngineConfig,
    ModelArchConfig,
)
from pdserve.engine.layers.linear import cpu_has_native_gemm, swap_to_fp32_gemm
from pdserve.engine.loader.checkpoint import Checkpoint
from pdserve.engine.models import get_model_class
from pdserve.engine.quantization import load_model_weights, weight_memory
from pdserve.engine.sampler import LogprobsTensors, Sampler, SamplingMetadata
from pdserve.engine.scheduler import SchedulerOutput


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step, one row per sampling request, in schedule order.

    Attributes:
        request_ids: the requests that sampled.
        sampled_token_ids: their new tokens.
        logprobs: ``LogprobsTensors`` on the host for those rows, None if none asked.
    """

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: LogprobsTensors | None


def _available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelRunner:
    """Owns the model weights, the paged KV cache and the sampler.

    Args:
        config: engine configuration.
        arch: the model's architecture facts.
        checkpoint: where the weights come from.
        max_model_len: longest sequence (prompt + output) served.

    Raises:
        ValueError: when the KV budget cannot hold one ``max_model_len`` sequence.
    """

    def __init__(self, config: EngineConfig, arch: ModelArchConfig, checkpoint: Checkpoint,
                 max_model_len: int) -> None:
        self.config = config
        self.arch = arch
        self.device = config.torch_device
        self.dtype = config.resolve_dtype(None)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.backend = get_backend(config.attention_backend, self.device)
        model_cls = get_model_class(arch.architecture)
        with _default_dtype(self.dtype), self.device:
            self.model = model_cls(arch, self.backend, max_model_len)
        use_fp32_gemm = (self.device.type == "cpu" and self.dtype != torch.float32
                         and not cpu_has_native_gemm(self.dtype))
        # Quantized layers (--quantization) replace nn.Linear here, so the fp32-GEMM swap
        # below only touches the layers that stay dense.
        load_model_weights(self.model, arch, checkpoint, config.quantization,
                           config.quantization_skip, self.dtype,
                           torch.float32 if use_fp32_gemm else self.dtype,
                           progress=config.load_progress)
        self.model.eval()
        if use_fp32_gemm:
            swap_to_fp32_gemm(self.model)
        self.weight_memory = weight_memory(self.model)
        self.weight_bytes = self.weight_memory.total_bytes

        self.num_kv_blocks = self._decide_num_blocks()
        if self.num_kv_blocks * self.block_size < max_model_len:
            raise ValueError(
                f"KV cache budget ({self.num_kv_blocks} blocks of {self.block_size} tokens) cannot "
                f"hold one sequence of max_model_len={max_model_len}; raise the KV budget "
                "(num_kv_blocks / kv_cache_memory_bytes / kv_cache_memory_fraction) or lower "
                "max_model_len"
            )
        # [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            (arch.num_layers, 2, self.num_kv_blocks, self.block_size, arch.num_kv_heads,
             arch.head_dim),
            dtype=self.dtype, device=self.device,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1])
                          for i in range(arch.num_layers)]
        self.kv_cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        self.sampler = Sampler()
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(config.seed)

    def _decide_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        bytes_per_block = self.arch.kv_bytes_per_token(self.dtype) * self.block_size
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif cfg.kv_cache_memory_fraction is not None:
            budget = int(_available_memory_bytes(self.device) * cfg.kv_cache_memory_fraction)
        elif self.device.type == "cuda":
            budget = int(_available_memory_bytes(self.device) * DEFAULT_GPU_KV_CACHE_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        return max(1, budget // bytes_per_block)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step's forward pass and sample.

        The host reads results once, at the end (``tolist`` of the sampled ids).
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampling = []
        for s in sched.scheduled:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            end = start + n
            bt = req.block_table
            input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            block_tables.append(bt)
            if s.is_sampling:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(req)

        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        attn_inputs = AttentionInputs(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_lens=query_lens, seq_lens=seq_lens, block_tables=block_tables,
            num_decodes=sched.num_decodes, block_size=bs,
        )
        metadata = self.backend.build_metadata(attn_inputs)
        hidden = self.model(ids_t, pos_t, self.kv_caches, metadata)
        if not sampling:
            return ModelRunnerOutput([], [], None)
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=dev)
        logits = self.model.compute_logits(hidden[rows])  # [num_sampling, vocab] fp32
        smeta = SamplingMetadata.build(
            params=[r.sampling_params for r in sampling],
            prompt_token_ids=[r.prompt_token_ids for r in sampling],
            output_token_ids=[r.output_token_ids for r in sampling],
            generators=[r.generator for r in sampling],
            eos_token_id=self.arch.eos_token_ids[0] if self.arch.eos_token_ids else None,
            vocab_size=logits.shape[-1],
            device=dev,
        )
        out = self.sampler(logits, smeta, self.default_generator)
        logprobs = out.logprobs
        if logprobs is not None and dev.type != "cpu":
            logprobs = LogprobsTensors(*(t.cpu() for t in (
                logprobs.sampled_logprobs, logprobs.sampled_ranks, logprobs.top_token_ids,
                logprobs.top_logprobs)))
        return ModelRunnerOutput(
            [r.request_id for r in sampling], out.sampled_token_ids.tolist(), logprobs
        )
