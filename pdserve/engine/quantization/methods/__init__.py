"""Quantization methods, one file each; importing this package registers them all."""

from pdserve.engine.quantization.methods import (  # noqa: F401
    awq,
    compressed_tensors,
    fp8,
    gguf,
    gptq,
    rtn,
)
