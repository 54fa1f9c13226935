"""glibc heap policy (pdserve.memory): a CPU engine's step-sized blocks come from the heap
and stay there when freed, instead of being mapped, unmapped and faulted in again."""

import platform
import subprocess
import sys
import textwrap

import pytest

from pdserve.memory import keep_freed_memory

GLIBC = platform.libc_ver()[0] == "glibc"

# A 24 MB block (a 4,096-row step's gate/up output in bf16) malloc'd and freed: whether it
# lay in the brk heap, and whether the heap kept its pages after the free.
_BLOCK = textwrap.dedent("""
    import ctypes, sys
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = (ctypes.c_ssize_t,)
    if sys.argv[1] == "keep":
        from pdserve.memory import keep_freed_memory
        assert keep_freed_memory()
    elif sys.argv[1] != "default":  # a CPU engine on the checkpoint at argv[1]
        from pdserve.engine import LLM
        LLM(sys.argv[1], dtype="float32", load_progress=False, max_model_len=64)
    size = 24 << 20
    brk0 = libc.sbrk(0)
    p = libc.malloc(size)
    brk1 = libc.sbrk(0)
    on_heap = brk0 - (64 << 20) <= p < brk1
    libc.free(p)
    print(on_heap, on_heap and libc.sbrk(0) >= brk1 - 4096)
""")


def _block(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", _BLOCK, str(mode)], capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_step_sized_blocks_come_from_the_heap_and_stay_after_free():
    assert _block("default") == "False False"  # mapped for itself, unmapped on free
    assert _block("keep") == "True True"


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_a_cpu_engine_keeps_freed_memory(tiny_llama_checkpoint):
    path, _ = tiny_llama_checkpoint
    assert _block(path) == "True True"


def test_keep_freed_memory_answers_the_same_every_call():
    first = keep_freed_memory()
    assert keep_freed_memory() is first
    assert first is GLIBC
