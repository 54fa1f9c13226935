"""One-pass CPU kernels for the FP8 KV codec (``fp8_cpu.c``), called through ctypes.

The torch reference in :mod:`pdserve.fp8` makes five passes over each chunk (convert, abs,
amax, scale, cast) and torch's float -> float8 cast is scalar: ~1.2 GB/s of bf16 KV on one
core. The C kernels read each row once for its absmax and once more from L1 to scale,
round and store, 8 lanes at a time, with results bit-identical to the torch path (the
tests compare them). They take per-row element offsets, so quantizing can read a request's
blocks straight out of a paged cache (the gather fused in) and dequantizing can write
straight into another cache's blocks (the scatter fused in)::

    row r = one (layer, K/V, block) = [block_size, H, D] contiguous elements
    src/dst row r at offsets[r] elements; codes [num_rows, block_size, H, D] uint8 and
    scales [num_rows, H] fp32 are contiguous

The shared object is built once per machine with the system C compiler (``cc -O3 -mavx2
-mf16c``, about a second) into the kernel cache directory the engine's C++ kernels use
(``$PDSERVE_KERNEL_CACHE`` or ``~/.cache/pdserve/kernels``); ctypes releases the GIL during
each call, so a sender or receiver thread runs beside the engine's. Where the CPU lacks
AVX2/F16C, no compiler is found, or ``PDSERVE_DISABLE_CPU_KERNELS`` is set,
:func:`fp8_kernels` returns None and callers keep the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: The kernels' dtype codes.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SOURCE = Path(__file__).with_name("fp8_cpu.c")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-std=c11"]
_NEEDS = {"avx2", "f16c"}

_lock = threading.Lock()
_state: dict[str, object] = {}


class FP8Kernels:
    """The loaded shared object's two entry points, with tensor-level argument checks."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._quantize = lib.pdserve_fp8_quantize_rows
        self._quantize.argtypes = [ptr, ctypes.c_int, ptr, i64, i64, i64, i64, ptr, ptr]
        self._quantize.restype = i64
        self._dequantize = lib.pdserve_fp8_dequantize_rows
        self._dequantize.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ctypes.c_int, ptr]
        self._dequantize.restype = None

    def quantize_rows(self, src: torch.Tensor, row_offsets: torch.Tensor | None,
                      codes: torch.Tensor, scales: torch.Tensor) -> int:
        """Quantize ``num_rows`` rows of ``src`` into ``codes`` and ``scales``.

        Args:
            src: contiguous CPU fp32/bf16/fp16 tensor holding the rows (any shape).
            row_offsets: [num_rows] int64 element offsets of each row in ``src``; None:
                row r starts at ``r * block_size * H * D``.
            codes: contiguous [num_rows, block_size, H, D] uint8 or float8_e4m3fn, written.
            scales: contiguous [num_rows, H] fp32, written.
        Returns the number of rows holding inf or NaN (their outputs are unspecified).
        Raises ValueError for a wrong dtype, layout or an offset outside ``src``.
        """
        num_rows, bs, heads, dim = _row_shape(codes, scales)
        _check_rows(src, row_offsets, num_rows, bs * heads * dim)
        return self._quantize(src.data_ptr(), DTYPE_CODES[src.dtype], _ptr(row_offsets),
                              num_rows, bs, heads, dim, codes.data_ptr(), scales.data_ptr())

    def dequantize_rows(self, codes: torch.Tensor, scales: torch.Tensor, dst: torch.Tensor,
                        row_offsets: torch.Tensor | None) -> None:
        """Write ``codes * scale`` rounded to ``dst.dtype`` into the rows of ``dst``.

        Args:
            codes: contiguous [num_rows, block_size, H, D] uint8 or float8_e4m3fn.
            scales: contiguous [num_rows, H] fp32.
            dst: contiguous CPU fp32/bf16/fp16 tensor holding the rows (any shape), written.
            row_offsets: [num_rows] int64 element offsets of each row in ``dst``; None:
                contiguous rows.
        Raises ValueError for a wrong dtype, layout or an offset outside ``dst``.
        """
        num_rows, bs, heads, dim = _row_shape(codes, scales)
        _check_rows(dst, row_offsets, num_rows, bs * heads * dim)
        self._dequantize(codes.data_ptr(), scales.data_ptr(), num_rows, bs, heads, dim,
                         dst.data_ptr(), DTYPE_CODES[dst.dtype], _ptr(row_offsets))


def fp8_kernels() -> FP8Kernels | None:
    """The kernels (built on first use, once per machine), or None where unavailable."""
    if "kernels" in _state:
        return _state["kernels"]  # type: ignore[return-value]
    with _lock:
        if "kernels" not in _state:
            _state["kernels"] = _build()
        return _state["kernels"]  # type: ignore[return-value]


def _build() -> FP8Kernels | None:
    if os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") or not _NEEDS <= _cpu_flags():
        return None
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PDSERVE_KERNEL_CACHE",
                                Path.home() / ".cache" / "pdserve" / "kernels"))
    target = cache / f"fp8_cpu_{digest}.so"
    try:
        if not target.exists():
            cache.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            subprocess.run([os.environ.get("CC", "cc"), *_FLAGS, str(_SOURCE), "-o", str(tmp)],
                           check=True, capture_output=True, timeout=120)
            os.replace(tmp, target)  # atomic: concurrent builders never load a partial file
        return FP8Kernels(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("the FP8 CPU kernels could not be built (%s); torch ops run instead",
                       str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _row_shape(codes: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int, int]:
    if codes.dim() != 4 or codes.element_size() != 1 or not codes.is_contiguous() \
            or codes.device.type != "cpu":
        raise ValueError(f"codes: expected contiguous CPU [num_rows, block_size, H, D] "
                         f"1-byte codes, got {codes.dtype} {tuple(codes.shape)}")
    num_rows, bs, heads, dim = codes.shape
    if tuple(scales.shape) != (num_rows, heads) or scales.dtype != torch.float32 \
            or not scales.is_contiguous():
        raise ValueError(f"scales: expected contiguous fp32 {(num_rows, heads)}, "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    return num_rows, bs, heads, dim


def _check_rows(data: torch.Tensor, offsets: torch.Tensor | None, num_rows: int,
                row_elems: int) -> None:
    if data.dtype not in DTYPE_CODES or not data.is_contiguous() or data.device.type != "cpu":
        raise ValueError(f"rows: expected a contiguous CPU tensor of {list(DTYPE_CODES)}, "
                         f"got {data.dtype} on {data.device}")
    if offsets is None:
        if num_rows * row_elems > data.numel():
            raise ValueError(f"rows: {num_rows} rows of {row_elems} do not fit "
                             f"{data.numel()} elements")
        return
    if offsets.dtype != torch.int64 or tuple(offsets.shape) != (num_rows,) \
            or not offsets.is_contiguous():
        raise ValueError(f"row_offsets: expected contiguous int64 [{num_rows}], "
                         f"got {offsets.dtype} {tuple(offsets.shape)}")
    if num_rows and (int(offsets.min()) < 0
                     or int(offsets.max()) + row_elems > data.numel()):
        raise ValueError(f"row_offsets: rows must lie within the tensor's "
                         f"{data.numel()} elements")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
