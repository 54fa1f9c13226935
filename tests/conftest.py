"""Shared fixtures: tiny random-weight checkpoints built from transformers configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Processes the tests start as separate commands (`pdserve server`, `decode-worker`, ...)
# need the same cluster secret (CURVE; pdserve.security); `serve` hands it to its children.
os.environ.setdefault("PDSERVE_CLUSTER_SECRET", "pdserve-test-suite-cluster-secret")
# Triton kernels run in its interpreter on CPU; read when the kernels are decorated (import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def _pin_xdist_worker() -> None:
    """Under pytest-xdist, test worker ``gwN`` and every process it starts (servers,
    workers, CLIs) keep to core ``N``: two OpenMP pools of two threads each on two cores
    spin against each other at every barrier, which made one test 20x slower. pdserve's
    workers size their thread pools from the cores they are given, so they follow."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if len(cores) < 2 or count < 2:
        return
    share = len(cores) // count or 1
    index = int(worker[2:]) % count
    mine = cores[index * share:(index + 1) * share] or cores[:1]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))


_pin_xdist_worker()

#: Small architectures under test, each exercising a different feature.
TINY_CONFIGS = {
    # Llama with llama3 RoPE scaling, untied LM head, GQA 4:2.
    "llama": dict(
        cls="LlamaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 128},
    ),
    # Qwen2 with q/k/v bias, linear RoPE scaling, tied embeddings, GQA 4:1.
    "qwen2": dict(
        cls="Qwen2Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    # Qwen3 with q/k RMSNorm and head_dim not equal to hidden/heads.
    "qwen3": dict(
        cls="Qwen3Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}


def build_tiny_checkpoint(arch: str, out_dir: Path, seed: int = 0):
    """Save a random-weight fp32 model of family ``arch``; returns the transformers model."""
    import transformers

    spec = dict(TINY_CONFIGS[arch])
    cfg_cls = getattr(transformers, spec.pop("cls"))
    cfg = cfg_cls(vocab_size=512, initializer_range=0.08, rms_norm_eps=1e-6,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, **spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_model(request, tmp_path_factory):
    """``(arch, checkpoint_dir, transformers_model)`` for each tiny architecture."""
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = build_tiny_checkpoint(request.param, out)
    return request.param, out, model


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory):
    """``(checkpoint_dir, transformers_model)`` of the tiny Llama alone."""
    out = tmp_path_factory.mktemp("tiny-llama-only")
    return out, build_tiny_checkpoint("llama", out)


#: Test files that take minutes, slowest first (seconds of one ``pytest -n 2 --dist loadfile``
#: run on 2 cores in brackets); they are collected, and so scheduled, first. The longest
#: files started last used to run on one core while the other had nothing left to do.
SLOW_FILES_FIRST = (
    "test_disaggregated_greedy.py",  # 287
    "test_quantization_smollm2.py",  # 343 before its AWQ builds shrank
    "test_disaggregated_faults.py",  # 193
    "test_eagle_remote_prefill.py",  # 185
    "test_structured_output_e2e.py", "test_structured_output_engine.py",  # 155, 145
    "test_router_liveness.py", "test_chaos.py", "test_eagle_smollm2_head.py",  # 132, 112, 106
    "test_cpu_decode.py", "test_drain.py", "test_overload.py", "test_front_doors.py",
    "test_disaggregated_e2e.py", "test_server_errors.py", "test_supervision.py",
    "test_kv_fidelity.py", "test_spec_decode_smollm2.py", "test_predicted_routing.py",
    "test_local_cluster.py", "test_spec_decode_engine.py", "test_fp8_kv_cache.py",
    "test_cluster_security.py", "test_smollm2.py", "test_loader.py", "test_deploy_live.py",
    "test_serve_worker_metrics.py", "test_server_e2e.py",
)


def pytest_configure(config):
    """pytest-xdist's ``--dist loadfile`` hands out files by number of tests, most first
    (``--loadscope-reorder``, its default), which put the few-test files that take minutes
    last: turned off, it hands them out in the order collected (slow files first)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """Collect :data:`SLOW_FILES_FIRST` first, in that order (stable within a file)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
