"""Triton kernels for quantized linear layers, each beside its torch reference.

| module | kernel |
|---|---|
| ``w4a16`` | fused int4 dequant-GEMM (W4A16) over :class:`~..int_linear.IntLinear`'s layout |
| ``gguf_gemm`` | fused dequant-GEMM/GEMV over GGML Q4_0 / Q4_1 / Q8_0 rows |

Triton decides at decoration time whether a kernel is compiled or interpreted, from
``TRITON_INTERPRET``: set it before the first import of Triton to run the kernels on CPU
tensors (the tests do). Without Triton, ``is_available()`` is False and layers dequantize
in torch.
"""
