"""The torch GEMMs of the fused CPU kernel's prefill steps (steps of more than 32 rows,
pdserve/engine/kernels/cpu_decode.cpp): row counts padded to multiples of 32, the warm-up
that compiles their oneDNN kernels ahead of requests, and the steps on weights reordered
once for oneDNN (at most PACKED_MAX_ROWS rows, or SPLIT_GEMM_ROWS and more)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.entrypoints.llm import LLM
from pdserve.engine.kernels import cpu_decode as cd
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cd.cpu_decode_module() is None,
                                reason="no AVX2/FMA/F16C or no C++ toolchain")

#: The GEMMs a fused prefill step hands torch: on weights as stored, or (steps of at most
#: PACKED_MAX_ROWS rows or of SPLIT_GEMM_ROWS and more, cpu_decode.cpp) on weights
#: reordered for oneDNN.
GEMM_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")


def _gemm_kn(event) -> tuple[int, int]:
    """(K, N) of a profiled GEMM: mm's second operand is the weight transposed ([K, N]),
    the packed linear's the weight itself ([N, K])."""
    w = event.input_shapes[1]
    return (w[1], w[0]) if event.name == "mkldnn::_linear_pointwise" else tuple(w)


def test_prefill_gemms_see_row_counts_padded_to_32():
    """A 45-token prompt's fused step hands torch's GEMMs 64 rows (45 of data, zeros after):
    oneDNN JIT-compiles a kernel per new shape, so every distinct prompt length cost a fresh
    compile per layer GEMM; in multiples of 32 the shapes repeat (the primitive cache keeps
    them). The greedy token is the unpadded model's (the eager path's, computed apart)."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(None, dtype="bfloat16", load_progress=False)
    fused = llm.engine.runner.fused_decode
    if fused is None or fused.max_tokens <= cd.MAX_FUSED_TOKENS:  # AVX2 only: eager prefills
        pytest.skip("no fused prefill steps (torch GEMMs) on this machine")
    prompt = list(range(100, 145))
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        token = llm.generate([prompt], sp)[0].outputs[0].token_ids
    rows = {(e.input_shapes[1] if e.name == "aten::addmm" else e.input_shapes[0])[0]
            for e in prof.events() if e.name in GEMM_OPS and e.input_shapes}
    assert 64 in rows and 45 not in rows
    llm.engine.runner.fused_decode = None  # the eager model
    assert llm.generate([prompt], sp)[0].outputs[0].token_ids == token


def test_warm_gemms_runs_each_padded_step_size_once():
    """FusedCpuDecode.warm_gemms (the serving workers run it in a background thread): each
    layer GEMM shape (qkv, o, gate_up, down) at every padded row count of a step of 33 ..
    max_rows rows, here 64, 96 and 128 for 100 rows: 12 GEMMs, seen by the profiler; a set
    stop event ends it before the next size, and start_warming's stopper joins its thread."""
    import threading

    from torch.profiler import ProfilerActivity, profile

    llm = LLM(None, dtype="bfloat16", load_progress=False)
    fused = llm.engine.runner.fused_decode
    if fused is None or fused.max_tokens <= cd.MAX_FUSED_TOKENS:
        pytest.skip("no fused prefill steps (torch GEMMs) on this machine")
    assert fused.warm_gemms(100) == 12
    stop = threading.Event()
    stop.set()
    assert fused.warm_gemms(2048, stop) == 0
    fused.start_warming(2048)()  # stopped at once: returns after at most one size
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fused.warm_gemms(90)  # 64 and 96 rows: on this thread (no row split)
    shapes = [(e.input_shapes[0][0], _gemm_kn(e)) for e in prof.events()
              if e.name in GEMM_OPS and e.input_shapes]
    assert {rows for rows, _ in shapes} == {64, 96}
    weights = {w for _, w in shapes}  # (K, N): one per layer weight (or per segment)
    assert {(576, 576), (1536, 576)} <= weights and len(shapes) == 2 * len(weights)


def test_steps_up_to_packed_max_rows_take_the_reordered_weights():
    """Fused prefill steps of at most PACKED_MAX_ROWS (384) rows, and steps of
    SPLIT_GEMM_ROWS (1,408) rows or more, run their GEMMs on weights reordered once into
    oneDNN's layout (``mkldnn::_linear_pointwise``; plain weights are reordered inside every
    call: a 128-row step's GEMMs 38.9 -> 26.6 ms, bench/cpu_gemm.py), the ones between on
    the weights as stored, their rows split over the threads. ``pack_weights`` (the decode
    worker calls it at start-up) reorders every layer's weights once, so no step pays for
    it; without it the first such step would."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(None, dtype="bfloat16", load_progress=False)
    fused = llm.engine.runner.fused_decode
    if fused is None or fused.max_tokens <= cd.MAX_FUSED_TOKENS:
        pytest.skip("no fused prefill steps (torch GEMMs) on this machine")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    assert fused.pack_weights() == 4 * llm.engine.arch.num_layers  # qkv, o, gate_up, down
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fused.warm_gemms(448)  # 64 .. 448 rows: 384 the last packed size
        if torch.get_num_threads() > 1:
            fused.decoder.warm_gemms(1408)  # that size alone: packed again, not split
    rows = {name: {e.input_shapes[0][0] for e in prof.events()
                   if e.name == name and e.input_shapes} for name in GEMM_OPS}
    packed = set(range(64, 385, 32)) | ({1408} if torch.get_num_threads() > 1 else set())
    assert rows["mkldnn::_linear_pointwise"] == packed
    # 416 and 448 rows on the stored weights (split in halves over two threads)
    assert rows["aten::mm"] and rows["aten::mm"] <= {416, 448, 208, 224}
    assert not [e for e in prof.events() if e.name == "mkldnn::_reorder_linear_weight"]
    assert fused.pack_weights() == 4 * llm.engine.arch.num_layers  # the same ones, kept
