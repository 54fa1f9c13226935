"""Quantized checkpoints load into the engine and compute what their dequantized weights do.

Tiny random Llama (untied LM head, GQA) and Qwen2 (q/k/v bias) checkpoints are quantized
by round-to-nearest, packed into the AutoAWQ, GPTQ (act order) and compressed-tensors
layouts, and loaded; the reference is a dense checkpoint holding the dequantized weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLMEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.layers.linear import Fp32GemmLinear
from pdserve.engine.quantization.int_layouts import (
    pack_awq,
    pack_compressed_tensors,
    pack_gptq,
)
from pdserve.engine.quantization.int_linear import IntLinear
from pdserve.engine.quantization.int_weight import IntWeight, quantize_rtn
from pdserve.offline.perplexity import perplexity
from pdserve.offline.quantize.writer import quantization_config
from conftest import build_tiny_checkpoint

GROUP = 32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _act_order(w: IntWeight, seed: int) -> IntWeight:
    """The same weight with GPTQ act-order groups: columns assigned to groups in a permuted
    order (codes re-quantized per the new groups)."""
    in_features = w.shape[1]
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    g_idx = (torch.arange(in_features) // w.group_size)[perm.argsort()].to(torch.int32)
    dense = w.dequantize()
    grouped = quantize_rtn(dense[:, perm], w.bits, w.group_size)  # groups of permuted columns
    inverse = perm.argsort()
    return IntWeight(grouped.codes[:, inverse].contiguous(), grouped.scales, grouped.zeros,
                     w.bits, w.group_size, g_idx)


def _write_pair(src, fmt: str, bits: int, out_q, out_ref):
    """Quantize every decoder projection of ``src``; write the packed and the reference."""
    tensors = load_file(str(src / "model.safetensors"))
    packed, dense = {}, dict(tensors)
    for name, t in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix != "weight" or module.rpartition(".")[2] not in PROJECTIONS:
            continue
        w = quantize_rtn(t, bits, GROUP)
        if fmt == "gptq":
            w = _act_order(w, seed=0)  # GPTQ: one H per input, so q/k/v share g_idx
        pack = {"awq": pack_awq, "gptq": pack_gptq,
                "compressed-tensors": pack_compressed_tensors}[fmt](w)
        packed.update({f"{module}.{k}": v for k, v in pack.items()})
        dense[name] = w.dequantize()
    for k, v in tensors.items():
        module = k.rpartition(".")[0]
        if module.rpartition(".")[2] not in PROJECTIONS or k.endswith(".bias"):
            packed[k] = v
    config = json.loads((src / "config.json").read_text())
    for out, ts, qc in ((out_q, packed, quantization_config(fmt, bits, GROUP, [], "rtn")),
                        (out_ref, dense, None)):
        out.mkdir()
        cfg = dict(config)
        if qc is not None:
            cfg["quantization_config"] = dict(qc, checkpoint_format="gptq") if fmt == "gptq" \
                else qc
        (out / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in ts.items()}, str(out / "model.safetensors"))


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16,
                                  max_model_len=128,
                                  load_progress=False, **kw))


def _ppl(engine) -> float:
    ids = torch.randint(0, 512, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    return perplexity(engine, ids, chunk_size=32)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt,bits", [("awq", 4), ("gptq", 4), ("gptq", 8),
                                      ("compressed-tensors", 4), ("compressed-tensors", 8)])
def test_quantized_checkpoint_equals_its_dequantized_weights(arch, fmt, bits, tmp_path):
    if fmt == "awq" and bits != 4:
        pytest.skip("AWQ is 4-bit only")
    src = tmp_path / "src"
    build_tiny_checkpoint(arch, src)
    _write_pair(src, fmt, bits, tmp_path / "q", tmp_path / "ref")
    quant = _engine(tmp_path / "q")
    layers = [m for m in quant.runner.model.modules() if isinstance(m, IntLinear)]
    assert len(layers) == 2 * 4 and all(m.bits == bits for m in layers)
    assert any(m.g_idx is not None for m in layers) == (fmt == "gptq")
    ref = _engine(tmp_path / "ref")
    assert _ppl(quant) == pytest.approx(_ppl(ref), rel=1e-4)


def test_skip_list_and_none_dequantize_to_dense_layers(tmp_path):
    src = tmp_path / "src"
    build_tiny_checkpoint("llama", src)
    _write_pair(src, "awq", 4, tmp_path / "q", tmp_path / "ref")
    skipped = _engine(tmp_path / "q", quantization_skip=("layers.0", "lm_head"))
    model = skipped.runner.model
    # dense (a CPU engine runs dense layers as Fp32GemmLinear, see layers/linear.py)
    assert isinstance(model.model.layers[0].mlp.down_proj, (torch.nn.Linear, Fp32GemmLinear))
    assert isinstance(model.model.layers[1].mlp.down_proj, IntLinear)
    dense = _engine(tmp_path / "q", quantization="none")
    assert not any(isinstance(m, IntLinear) for m in dense.runner.model.modules())
    ref = _ppl(_engine(tmp_path / "ref"))
    assert _ppl(skipped) == pytest.approx(ref, rel=1e-4)
    assert _ppl(dense) == pytest.approx(ref, rel=1e-4)


def test_method_that_does_not_fit_the_checkpoint_is_a_clear_error(tmp_path):
    src = tmp_path / "src"
    build_tiny_checkpoint("llama", src)
    _write_pair(src, "awq", 4, tmp_path / "q", tmp_path / "ref")
    with pytest.raises(ValueError, match="already quantized"):
        _engine(tmp_path / "q", quantization="rtn-int4")
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        _engine(tmp_path / "q", quantization="gptq")
    with pytest.raises(ValueError, match="needs a .gguf"):
        _engine(tmp_path / "ref", quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")


@pytest.mark.parametrize("argv,message", [
    (["generate", "--quantization-skip", "lm_head,,layers.0"], "bad layer pattern"),
    (["quantize", "--format", "awq", "--bits", "8", "--out", "x"], "--format awq"),
    (["quantize", "--group-size", "0", "--out", "x"], "--group-size"),
])
def test_bad_quantization_flags_exit_2_with_a_clear_message(argv, message):
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", *argv], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_dense_methods_quantize_a_dense_checkpoint(tmp_path):
    src = tmp_path / "src"
    build_tiny_checkpoint("qwen2", src)
    ref = _ppl(_engine(src))
    for method, rel in (("fp8", 0.02), ("rtn-int8", 0.01), ("rtn-int4", 0.15)):
        engine = _engine(src, quantization=method)
        assert engine.runner.weight_memory.num_quantized_layers == 2 * 4
        assert _ppl(engine) == pytest.approx(ref, rel=rel)
    shutil.rmtree(src)


def test_brown_tags_are_stripped_into_sentences():
    from pdserve.offline.quantize.calibration import strip_brown_tags

    raw = "\n\n\tThe/at jury/nn said/vbd ``/`` no/at ''/'' ,/, (/( yes/rb )/) ./.\n\n\tOk/uh ./.\n"
    assert strip_brown_tags(raw).splitlines() == ['The jury said " no ", (yes).', "Ok."]


def test_calibration_windows_spread_over_the_text_and_need_enough_tokens():
    from pdserve.offline.quantize.calibration import calibration_token_windows

    windows = calibration_token_windows(list(range(1000)), num_samples=3, seq_len=100)
    assert [w[0] for w in windows] == [0, 300, 600] and all(len(w) == 100 for w in windows)
    with pytest.raises(ValueError, match="fewer than"):
        calibration_token_windows(list(range(50)), 1, 100)
