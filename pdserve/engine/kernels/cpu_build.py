"""Build (once per machine) and load the C++ CPU kernels of :mod:`pdserve.engine.kernels`.

Kernels are compiled with torch's ``cpp_extension`` (g++ and ninja) into
``~/.cache/pdserve/kernels/<hash of source, flags and torch version>`` (or
``$PDSERVE_KERNEL_CACHE``) and loaded from there after. ``PDSERVE_DISABLE_CPU_KERNELS=1``
turns every kernel off, so callers take their torch paths.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_cpu_extension(tag: str, source: str, cflags: list[str], needs: set[str],
                        functions: list[str] | None = None):
    """Compile ``source`` (C++ text) into a Python module, or return None (logged).

    Args:
        tag: a short name for the module and the log.
        source: the C++ source; without ``functions`` it defines its own PYBIND11_MODULE.
        cflags: compiler flags beyond ``-O3 -fopenmp``.
        needs: CPU flags the code needs (e.g. ``{"avx2", "fma"}``); without them: None.
        functions: functions to bind automatically (``load_inline``'s ``functions``).

    Returns:
        The loaded module, or None when kernels are disabled, the CPU lacks ``needs`` or the
        build fails (no compiler, no ninja, a compile error).
    """
    if os.environ.get("PDSERVE_DISABLE_CPU_KERNELS"):
        return None
    if not needs <= cpu_flags():
        return None
    from torch.utils import cpp_extension  # noqa: PLC0415 (only where a kernel is used)

    flags = ["-O3", *cflags, "-fopenmp"]  # OpenMP: at::parallel_for's threads
    digest = hashlib.sha256(" ".join([source, torch.__version__, *flags]).encode()
                            ).hexdigest()[:16]
    build_dir = Path(os.environ.get("PDSERVE_KERNEL_CACHE",
                                    Path.home() / ".cache" / "pdserve" / "kernels")) / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    # ninja comes with the package (PyPI ninja) next to this interpreter, which is not on
    # PATH when the venv was not activated (`.venv/bin/pdserve serve`)
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        return cpp_extension.load_inline(
            name=f"pdserve_{tag}_{digest}", cpp_sources=source, functions=functions,
            extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
            verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: callers keep torch
        logger.warning("the CPU kernel %r could not be built (%s); torch ops run instead",
                       tag, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return None
