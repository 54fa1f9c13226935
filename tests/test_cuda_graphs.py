"""Decode CUDA graphs: bucket choice, padding, and the padded static-buffer forward.

Graphs cannot be captured without a GPU; what they replay is the forward over the padded
static buffers, which runs eagerly here (Triton kernels in the interpreter) and must give
the same tokens as transformers.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.compiled.cuda_graphs import (
    DEFAULT_DECODE_BUCKETS,
    CUDAGraphRunner,
    bucket_for,
    decode_buckets,
    pad_decode_batch,
)
from pdserve.engine.kernels import PAD_SLOT_ID
from test_engine_equivalence import hf_greedy, make_prompts


def test_buckets_stop_at_max_num_seqs():
    assert decode_buckets(256) == DEFAULT_DECODE_BUCKETS
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert decode_buckets(1) == (1,)
    assert decode_buckets(1000)[-1] == 256


def test_bucket_is_the_smallest_that_fits():
    buckets = (1, 2, 4, 8)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert bucket_for(9, buckets) is None
    assert bucket_for(0, buckets) is None


def test_padding_rows_are_inert():
    batch = pad_decode_batch(input_ids=[7, 9], positions=[4, 10], slots=[36, 6],
                             block_tables=[[9, 3], [20, 5, 1]], seq_lens=[5, 11], bucket=4,
                             max_blocks=4, block_size=4)
    assert batch.bucket == 4 and batch.num_seqs == 2
    assert batch.input_ids.tolist() == [7, 9, 0, 0]
    assert batch.positions.tolist() == [4, 10, 0, 0]
    assert batch.slot_mapping.tolist() == [36, 6, PAD_SLOT_ID, PAD_SLOT_ID]
    assert batch.seq_lens.tolist() == [5, 11, 0, 0]
    assert batch.block_tables.dtype == torch.int32
    assert batch.block_tables.tolist() == [[9, 3, 0, 0], [20, 5, 1, 0], [0] * 4, [0] * 4]


def test_padding_rejects_batches_that_do_not_fit():
    with pytest.raises(ValueError, match="bucket"):
        pad_decode_batch([1, 2, 3], [0, 0, 0], [0, 1, 2], [[0]] * 3, [1, 1, 1], 2, 4, 4)
    with pytest.raises(ValueError, match="max_blocks"):
        pad_decode_batch([1], [8], [8], [[0, 1, 2]], [9], 1, 2, 4)


@pytest.mark.slow
def test_decode_over_padded_static_buffers_matches_transformers(tiny_llama_checkpoint):
    path, model = tiny_llama_checkpoint
    prompts = make_prompts([1, 6, 19])
    expected = [hf_greedy(model, p, 8) for p in prompts]
    llm = LLM(str(path), dtype="float32", load_progress=False, block_size=4, max_num_seqs=8,
              attention_backend="triton")
    runner = llm.engine.runner
    assert runner.cuda_graphs is None  # CPU: never captured
    graphs = CUDAGraphRunner(runner.model, runner.kv_caches, 8, llm.engine.max_model_len,
                             runner.block_size, runner.device)
    calls = []
    eager_run = graphs.run
    graphs.run = lambda *a: calls.append(len(a[0])) or eager_run(*a)
    runner.cuda_graphs = graphs  # decode-only steps now go through the static buffers
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, detokenize=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert calls and 3 in calls  # 3 decodes ran in bucket 4 (one padding row)
