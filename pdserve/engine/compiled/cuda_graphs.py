"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed over static buffers.

A decode step launches a few hundred small kernels (per layer: norms, projections, rotary,
KV store, attention, MLP); at small batch the launch overhead dominates the step. Capturing
the whole forward once per bucket and replaying it removes that overhead (as in vLLM and
gpt-fast).

NOTE (what makes a step capturable). Everything a replay reads lives in static buffers
allocated once, sized for the largest bucket; a step with ``n`` decodes picks the smallest
bucket ``b >= n``, writes its inputs into rows ``[0, n)`` and padding into ``[n, b)``::

    input_ids / positions   [b]              padding: token 0 at position 0
    slot_mapping            [b]   int64      padding: PAD_SLOT_ID (the store skips it)
    block_tables            [b, max_blocks]  padding: zeros (never read)
    seq_lens                [b]   int32      padding: 0 (attention writes zeros)
    store segments          arange(b), ones(b)   (one token per decode: constant)

and the Triton backend's forward does no host reads, so the captured kernels see the new
values on replay. Only rows ``[0, n)`` of the output are used. Steps with prefills, or more
decodes than the largest bucket, run eagerly. Graphs are CUDA-only; on CPU (tests) the same
padded buffers run eagerly through :meth:`CUDAGraphRunner.run`, which checks the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.triton_backend import TritonAttentionMetadata, block_table_tensor
from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels import PAD_SLOT_ID

#: Batch sizes that get a graph (those up to ``max_num_seqs`` are captured, plus that one).
DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def decode_buckets(max_num_seqs: int, candidates: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
                   ) -> tuple[int, ...]:
    """The buckets captured for an engine of ``max_num_seqs``: the candidates below it and
    ``min(max_num_seqs, largest candidate)`` itself, ascending."""
    top = min(max_num_seqs, max(candidates))
    return tuple(sorted({b for b in candidates if b < top} | {top}))


def bucket_for(num_seqs: int, buckets: tuple[int, ...]) -> int | None:
    """Smallest bucket holding ``num_seqs`` decodes, or None when none does."""
    return next((b for b in buckets if b >= num_seqs), None) if num_seqs > 0 else None


@dataclass
class DecodeBatch:
    """One decode step's inputs, padded to a bucket (host tensors).

    Attributes:
        num_seqs: real decodes (rows ``[0, num_seqs)``).
        input_ids: ``[bucket]`` int64.
        positions: ``[bucket]`` int64.
        slot_mapping: ``[bucket]`` int64, ``PAD_SLOT_ID`` in padding rows.
        block_tables: ``[bucket, max_blocks]`` int32.
        seq_lens: ``[bucket]`` int32, 0 in padding rows.
    """

    num_seqs: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def bucket(self) -> int:
        """Rows after padding (real decodes plus padding rows)."""
        return self.input_ids.numel()


def pad_decode_batch(input_ids: list[int], positions: list[int], slots: list[int],
                     block_tables: list[list[int]], seq_lens: list[int], bucket: int,
                     max_blocks: int, block_size: int) -> DecodeBatch:
    """Pad one decode step to ``bucket`` rows (see the module NOTE for the padding values).

    Raises:
        ValueError: more decodes than ``bucket``, or a context longer than ``max_blocks``.
    """
    n = len(input_ids)
    if n > bucket:
        raise ValueError(f"{n} decodes do not fit bucket {bucket}")
    if any((s + block_size - 1) // block_size > max_blocks for s in seq_lens):
        raise ValueError(f"a context needs more than max_blocks={max_blocks} blocks")
    pad = bucket - n

    def padded(values: list[int], fill: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(list(values) + [fill] * pad, dtype=dtype)

    tables = torch.zeros((bucket, max_blocks), dtype=torch.int32)
    tables[:n] = block_table_tensor(block_tables, seq_lens, block_size, num_cols=max_blocks)
    return DecodeBatch(n, padded(input_ids, 0, torch.int64), padded(positions, 0, torch.int64),
                       padded(slots, PAD_SLOT_ID, torch.int64), tables,
                       padded(seq_lens, 0, torch.int32))


class CUDAGraphRunner:
    """Static decode buffers plus one captured graph per bucket.

    Args:
        model: the ``*ForCausalLM``; called as ``model(ids, positions, kv_caches, metadata)``.
        kv_caches: the runner's per-layer caches (as the model takes them).
        max_num_seqs: most decodes in a step.
        max_model_len: longest context (sets the block-table width).
        block_size: tokens per KV block.
        device: where the buffers live.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.buckets = decode_buckets(max_num_seqs)
        self.max_blocks = (max_model_len + block_size - 1) // block_size
        top = self.buckets[-1]
        # Static buffers: [top] / [top, max_blocks]; graphs read views of their first rows.
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((top, self.max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.segment_starts = torch.arange(top, dtype=torch.int32, device=device)
        self.segment_lens = torch.ones(top, dtype=torch.int32, device=device)
        self._no_prefill = torch.zeros((0, 1), dtype=torch.int32, device=device)
        self._no_prefill_cu = torch.zeros(1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @classmethod
    def build(cls, model: torch.nn.Module, kv_caches: list, config: EngineConfig,
              backend_name: str, max_model_len: int) -> "CUDAGraphRunner | None":
        """The captured decode graphs for ``model``, or None where they do not apply: not a
        CUDA device, an attention backend other than Triton, or ``enforce_eager``."""
        device = config.torch_device
        if device.type != "cuda" or config.enforce_eager or backend_name != "triton":
            return None
        graphs = cls(model, kv_caches, config.max_num_seqs, max_model_len, config.block_size,
                     device)
        graphs.capture()
        return graphs

    def metadata(self, bucket: int) -> TritonAttentionMetadata:
        """Attention metadata over the static buffers' first ``bucket`` rows (no prefills)."""
        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            segments=(self.segment_starts[:bucket], self.segment_lens[:bucket]),
            num_decodes=bucket, decode_block_tables=self.block_tables[:bucket],
            decode_seq_lens=self.seq_lens[:bucket], prefill_block_tables=self._no_prefill,
            prefill_cu_query_lens=self._no_prefill_cu,
            prefill_seq_lens=self._no_prefill_cu[:0], max_prefill_query_len=0)

    def _forward(self, bucket: int) -> torch.Tensor:
        """``[bucket, hidden]`` hidden states over the static buffers."""
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches,
                          self.metadata(bucket))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, sharing one memory pool (CUDA only).

        Padding rows are inert (no KV write, zero attention), so warm-up and capture leave
        the KV cache untouched.
        """
        pool = None
        self.slot_mapping.fill_(PAD_SLOT_ID)
        self.seq_lens.zero_()
        for bucket in reversed(self.buckets):
            self._forward(bucket)  # warm-up: compiles the Triton kernels, settles the allocator
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, query_lens: list[int]) -> bool:
        """Whether a step with these per-request query lengths replays a graph (or, before
        :meth:`capture`, runs over the static buffers)."""
        return (bool(query_lens) and all(q == 1 for q in query_lens)
                and bucket_for(len(query_lens), self.buckets) is not None)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            block_tables: list[list[int]], seq_lens: list[int]) -> torch.Tensor:
        """Hidden states ``[num_decodes, hidden]`` of a decode-only step.

        Copies the padded inputs into the static buffers (host -> device copies, no sync),
        then replays the bucket's graph, or runs the same forward eagerly if not captured.
        """
        bucket = bucket_for(len(input_ids), self.buckets)
        if bucket is None:
            raise ValueError(f"{len(input_ids)} decodes exceed the largest bucket")
        batch = pad_decode_batch(input_ids, positions, slots, block_tables, seq_lens, bucket,
                                 self.max_blocks, self.block_size)
        for dst, src in ((self.input_ids, batch.input_ids), (self.positions, batch.positions),
                         (self.slot_mapping, batch.slot_mapping),
                         (self.block_tables, batch.block_tables), (self.seq_lens, batch.seq_lens)):
            dst[:bucket].copy_(src, non_blocking=True)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:batch.num_seqs]
        return self._forward(bucket)[:batch.num_seqs]
