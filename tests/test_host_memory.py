"""glibc malloc settings of CPU workers (pdserve.engine.host_memory): freed step tensors are
reused, not returned to the kernel and faulted in again."""

import platform
import subprocess
import sys
import textwrap

import pytest

from pdserve.engine.host_memory import keep_freed_memory

# Three 24 MB tensors made, written and freed, ten times over, as a prefill layer's GEMM
# outputs are: the minor page faults per cycle after a first one.
_CYCLES = textwrap.dedent("""
    import resource, sys, torch
    if sys.argv[1] == "keep":
        from pdserve.engine.host_memory import keep_freed_memory
        assert keep_freed_memory()
    elif sys.argv[1] != "default":  # a CPU engine on the checkpoint at argv[1]
        from pdserve.engine import LLM
        LLM(sys.argv[1], dtype="float32", load_progress=False, max_model_len=64)
    def cycle():
        ts = [torch.empty(6 << 20, dtype=torch.float32).fill_(1.0) for _ in range(3)]
        del ts
    cycle()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        cycle()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10)
""")


def _faults_per_cycle(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _CYCLES, str(mode)], capture_output=True,
                         text=True, timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_freed_step_tensors_are_reused_not_faulted_in_again():
    default = _faults_per_cycle("default")
    kept = _faults_per_cycle("keep")
    # 72 MB a cycle is 18,432 pages: beyond the most free heap glibc keeps by default
    # (64 MB), whatever its thresholds have become
    assert default > 4000, default
    assert kept < default / 4, (kept, default)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_a_cpu_engine_keeps_freed_memory(tiny_llama_checkpoint):
    path, _ = tiny_llama_checkpoint
    assert _faults_per_cycle(path) < _faults_per_cycle("default") / 4


def test_keep_freed_memory_answers_the_same_every_call():
    first = keep_freed_memory()
    assert keep_freed_memory() is first
    assert first is GLIBC
