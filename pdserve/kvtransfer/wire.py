"""The KV wire format: a small msgspec header, then the raw payload bytes and scale bytes.

One message carries layers ``[layer_start, layer_end)`` of one request's blocks, so a
request's KV can travel as one message or as one per layer (overlapping the transfer with
the prefill's compute). Transports move three parts and never look inside the last two::

    part 0  KVHeader, msgpack                            (~200 bytes)
    part 1  payload  [L, 2, num_blocks, block_size, num_kv_heads, head_dim]
            fp8_e4m3 bytes, or the cache dtype's bytes    header.payload_bytes
    part 2  scales   [L, 2, num_blocks, num_kv_heads] fp32
            (empty when scale_layout == "none")           header.scale_bytes

with ``L = layer_end - layer_start`` and all arrays C-contiguous, little-endian. The header's
``checksum`` is :func:`~pdserve.kvtransfer.checksum.kv_checksum` over parts 1 and 2.

With cluster keys (:mod:`pdserve.security`) the header's ``auth`` is an HMAC-SHA256, keyed
by the cluster secret, over the request id, the destination's KV address, the layer range,
the token and block counts and the checksum (:mod:`pdserve.kvtransfer.wire_auth`). A
receiver checks it before it touches a block, so a push forged by anyone without
the secret, or one aimed at another worker, is dropped; on UCX, whose transports neither
authenticate nor encrypt, this is the only check.

With ``rotation == "hadamard"`` (version 3, FP8 only) the payload quantizes ``kv @ H``,
``H`` the orthonormal Hadamard matrix along head_dim (:mod:`pdserve.kvtransfer.rotation`);
:func:`decode_kv` undoes it, so receivers get plain K/V (fp32, no scales).

A transfer may also carry one *hidden section* (``section == "hidden"``, version 2): the
prompt's target hidden states for the decode worker's EAGLE head, in their own message
after the KV layers (:mod:`pdserve.kvtransfer.hidden`); the transfer's KV messages announce
it (``hidden_size``) so that the receiver waits for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from types import MappingProxyType

import msgspec
import numpy as np
import torch

from pdserve.kvtransfer.checksum import kv_checksum
from pdserve.kvtransfer.errors import KVChecksumError, KVFormatError
from pdserve.kvtransfer.rotation import rotate
from pdserve.fp8 import FP8_DTYPE, SCALE_DTYPE, dequantize_blocks, quantize_blocks
from pdserve.host_memory import empty_host

WIRE_DTYPE_FP8 = "fp8_e4m3"
SCALE_LAYOUT_PER_BLOCK_HEAD = "per_layer_kv_block_head"
SCALE_LAYOUT_NONE = "none"
NATIVE_WIRE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32})
_WIRE_ITEMSIZE = {WIRE_DTYPE_FP8: 1, "bfloat16": 2, "float16": 2, "float32": 4}
_SCALE_ITEMSIZE = 4
#: The format's version, in every header; a header without one is version 1. Version 2 added
#: hidden sections (``section``, ``hidden_size``, ``hidden_start``), version 3 the Hadamard
#: ``rotation``. A receiver refuses a
#: version above its own with a KVFormatError naming both, so the transfer fails (and the
#: decode worker recomputes) instead of a newer sender's message being misread.
WIRE_VERSION = 3
#: ``KVHeader.rotation``: none, or a Hadamard rotation along head_dim before FP8 quantizing
ROTATIONS = ("none", "hadamard")
#: ``KVHeader.section``: layers of the request's KV ...
SECTION_KV = "kv"
#: ... or its prompt's target hidden states for an EAGLE head (:mod:`.hidden`)
SECTION_HIDDEN = "hidden"


class KVHeader(msgspec.Struct, frozen=True):
    """Describes one KV message; ``layer_end`` is exclusive."""

    request_id: str
    layer_start: int
    layer_end: int
    num_tokens: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "fp8_e4m3" | "bfloat16" | "float16" | "float32"
    scale_layout: str  # "per_layer_kv_block_head" | "none"
    payload_bytes: int
    scale_bytes: int
    checksum: int  # kv_checksum(payload, scales), 0 <= checksum < 2**64
    auth: bytes = b""  # HMAC by the cluster secret (sign_header), empty without keys
    version: int = 1  # the sender's WIRE_VERSION (absent: 1)
    section: str = SECTION_KV  # "kv" | "hidden"
    #: features per token of the transfer's hidden section, on each of its messages so the
    #: receiver waits for that section; 0: the transfer has none
    hidden_size: int = 0
    #: hidden section: its first prompt position (it holds ``[hidden_start, num_tokens)``)
    hidden_start: int = 0
    #: one of :data:`ROTATIONS`: "hadamard" quantized ``kv @ H`` (FP8 only, version >= 3)
    rotation: str = "none"

    @property
    def num_layers(self) -> int:
        """Layers this message carries (``layer_end - layer_start``)."""
        return self.layer_end - self.layer_start

    @property
    def kv_shape(self) -> tuple[int, int, int, int, int, int]:
        """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]"""
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, int, int, int]:
        """[num_layers, 2, num_blocks, num_kv_heads]"""
        return (self.num_layers, 2, self.num_blocks, self.num_kv_heads)

    @property
    def num_message_bytes(self) -> int:
        """Payload plus scale bytes: what a receiver's staging buffer must hold."""
        return self.payload_bytes + self.scale_bytes


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(KVHeader)


def encode_header(header: KVHeader) -> bytes:
    """The header as msgpack bytes (the first frame of a message)."""
    return _header_encoder.encode(header)


def decode_header(data) -> KVHeader:
    """Parses and validates header bytes; raises KVFormatError."""
    try:
        header = _header_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise KVFormatError(f"malformed KV header: {e}") from e
    validate_header(header)
    return header


def validate_header(header: KVHeader) -> None:
    """Checks the header's internal consistency; raises KVFormatError naming the field."""
    if not 1 <= header.version <= WIRE_VERSION:
        raise KVFormatError(f"version: this receiver reads KV wire versions 1 to "
                            f"{WIRE_VERSION}, got {header.version}")
    for name in ("layer_start", "payload_bytes", "scale_bytes", "checksum", "hidden_size",
                 "hidden_start"):
        if getattr(header, name) < 0:
            raise KVFormatError(f"{name}: must be >= 0, got {getattr(header, name)}")
    if header.section == SECTION_HIDDEN:
        _validate_hidden_section(header)
        return
    if header.section != SECTION_KV:
        raise KVFormatError(f"section: expected {SECTION_KV!r} or {SECTION_HIDDEN!r}, got "
                            f"{header.section!r}")
    if header.hidden_start:
        raise KVFormatError(f"hidden_start: only a hidden section has one, got "
                            f"{header.hidden_start}")
    _validate_rotation(header)
    for name in ("num_tokens", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
        if getattr(header, name) < 1:
            raise KVFormatError(f"{name}: must be >= 1, got {getattr(header, name)}")
    if header.layer_end <= header.layer_start:
        raise KVFormatError(f"layer_end: must be > layer_start={header.layer_start}, "
                            f"got {header.layer_end}")
    if header.checksum >= 1 << 64:
        raise KVFormatError(f"checksum: must fit in 64 bits, got {header.checksum}")
    if header.num_tokens > header.num_blocks * header.block_size:
        raise KVFormatError(f"num_tokens: {header.num_tokens} do not fit in "
                            f"{header.num_blocks} blocks of {header.block_size}")
    if header.dtype not in _WIRE_ITEMSIZE:
        raise KVFormatError(f"dtype: expected one of {sorted(_WIRE_ITEMSIZE)}, "
                            f"got {header.dtype!r}")
    is_fp8 = header.dtype == WIRE_DTYPE_FP8
    expected_layout = SCALE_LAYOUT_PER_BLOCK_HEAD if is_fp8 else SCALE_LAYOUT_NONE
    if header.scale_layout != expected_layout:
        raise KVFormatError(f"scale_layout: dtype {header.dtype} needs {expected_layout!r}, "
                            f"got {header.scale_layout!r}")
    payload_bytes = prod(header.kv_shape) * _WIRE_ITEMSIZE[header.dtype]
    if header.payload_bytes != payload_bytes:
        raise KVFormatError(f"payload_bytes: shape {header.kv_shape} of {header.dtype} "
                            f"needs {payload_bytes}, got {header.payload_bytes}")
    scale_bytes = prod(header.scales_shape) * _SCALE_ITEMSIZE if is_fp8 else 0
    if header.scale_bytes != scale_bytes:
        raise KVFormatError(f"scale_bytes: expected {scale_bytes}, got {header.scale_bytes}")


def _validate_rotation(header: KVHeader) -> None:
    """A rotation is one of :data:`ROTATIONS`; "hadamard" needs version 3, the FP8 dtype
    and a power-of-two head_dim."""
    if header.rotation not in ROTATIONS:
        raise KVFormatError(f"rotation: expected one of {list(ROTATIONS)}, got "
                            f"{header.rotation!r}")
    if header.rotation == "hadamard" and (
            header.version < 3 or header.dtype != WIRE_DTYPE_FP8
            or header.head_dim & (header.head_dim - 1)):
        raise KVFormatError(f"rotation: hadamard needs version >= 3, dtype {WIRE_DTYPE_FP8!r} "
                            f"and a power-of-two head_dim, got version {header.version}, "
                            f"{header.dtype!r}, head_dim {header.head_dim}")


def _validate_hidden_section(header: KVHeader) -> None:
    """A hidden section: ``[num_tokens - hidden_start, hidden_size]`` of a native dtype, no
    KV (layer range, KV geometry and scales all 0)."""
    if header.version < 2:
        raise KVFormatError(f"section: hidden sections need version >= 2, got "
                            f"{header.version}")
    if header.rotation != "none":
        raise KVFormatError(f"rotation: a hidden section has none, got {header.rotation!r}")
    for name in ("layer_start", "layer_end", "num_blocks", "block_size", "num_kv_heads",
                 "head_dim", "scale_bytes"):
        if getattr(header, name) != 0:
            raise KVFormatError(f"{name}: a hidden section carries no KV, must be 0, got "
                                f"{getattr(header, name)}")
    if header.hidden_size < 1:
        raise KVFormatError(f"hidden_size: must be >= 1, got {header.hidden_size}")
    if not 0 <= header.hidden_start < header.num_tokens:
        raise KVFormatError(f"hidden_start: must be in [0, num_tokens={header.num_tokens}), "
                            f"got {header.hidden_start}")
    if header.dtype not in NATIVE_WIRE_DTYPES or header.scale_layout != SCALE_LAYOUT_NONE:
        raise KVFormatError(f"dtype: a hidden section is one of {list(NATIVE_WIRE_DTYPES)} "
                            f"without scales, got {header.dtype!r} ({header.scale_layout!r})")
    payload_bytes = ((header.num_tokens - header.hidden_start) * header.hidden_size
                     * _WIRE_ITEMSIZE[header.dtype])
    if header.payload_bytes != payload_bytes:
        raise KVFormatError(f"payload_bytes: hidden section [{header.num_tokens} - "
                            f"{header.hidden_start}, {header.hidden_size}] of {header.dtype} "
                            f"needs {payload_bytes}, got {header.payload_bytes}")


@dataclass(frozen=True)
class EncodedKV:
    """A header and the two byte buffers to send after it (views, not copies)."""

    header: KVHeader
    payload: np.ndarray  # [payload_bytes] uint8
    scales: np.ndarray  # [scale_bytes] uint8 (size 0 without scales)

    @property
    def buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """``(payload, scales)``, the order every sender takes them in."""
        return (self.payload, self.scales)


def encode_kv(request_id: str, kv: torch.Tensor, *, layer_start: int, num_tokens: int,
              use_fp8: bool, scales: torch.Tensor | None = None,
              hidden_size: int = 0, rotation: str = "none") -> EncodedKV:
    """Encode gathered KV blocks as one message.

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] bf16/fp16/fp32 CPU,
        the request's blocks in block-table order, layers ``layer_start ..`` of the model;
        or float8_e4m3fn codes already quantized this way (an FP8 KV cache's blocks), sent
        as they are with ``scales``.
    use_fp8: quantize to fp8_e4m3 with per-(layer, K/V, block, head) scales, else send
        the bytes of ``kv.dtype`` unchanged. Must be True for FP8 ``kv``.
    scales: [num_layers, 2, num_blocks, num_kv_heads] fp32, with FP8 ``kv`` only.
    hidden_size: the width of the hidden section that follows this transfer's KV messages
        (:func:`~pdserve.kvtransfer.hidden.encode_hidden`); 0: none follows.
    rotation: "hadamard" quantizes ``kv @ H`` (with ``use_fp8`` and native ``kv``; FP8 codes
        go as they are stored, unrotated).
    """
    if kv.dim() != 6 or kv.shape[1] != 2:
        raise ValueError(f"kv: expected 6-d [num_layers, 2, num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(kv.shape)}")
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv.shape
    scales_given = scales
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation: expected one of {list(ROTATIONS)}, got {rotation!r}")
    if (kv.dtype == FP8_DTYPE) != (scales is not None) or (scales is not None and not use_fp8):
        raise ValueError("scales: give them exactly with float8_e4m3fn kv, and use_fp8=True")
    if scales is not None:
        if tuple(scales.shape) != (num_layers, 2, num_blocks, num_kv_heads) \
                or scales.dtype != SCALE_DTYPE:
            raise ValueError(f"scales: expected fp32 {(num_layers, 2, num_blocks, num_kv_heads)}"
                             f", got {scales.dtype} {tuple(scales.shape)}")
        values, dtype_name, layout = kv, WIRE_DTYPE_FP8, SCALE_LAYOUT_PER_BLOCK_HEAD
        scales = _as_bytes(scales)
    elif use_fp8:
        values, scales_t = quantize_blocks(rotate(kv) if rotation == "hadamard" else kv)
        dtype_name, layout = WIRE_DTYPE_FP8, SCALE_LAYOUT_PER_BLOCK_HEAD
        scales = _as_bytes(scales_t)
    else:
        dtype_name = _native_name(kv.dtype)
        values, layout = kv.contiguous(), SCALE_LAYOUT_NONE
        scales = np.empty(0, dtype=np.uint8)
    payload = _as_bytes(values)
    header = KVHeader(
        request_id=request_id, layer_start=layer_start, layer_end=layer_start + num_layers,
        num_tokens=num_tokens, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype_name, scale_layout=layout,
        payload_bytes=payload.size, scale_bytes=scales.size,
        checksum=kv_checksum(payload, scales), version=WIRE_VERSION, hidden_size=hidden_size,
        rotation=rotation if use_fp8 and scales_given is None else "none")
    return checked_encoding(header, payload, scales)


def checked_encoding(header: KVHeader, payload: np.ndarray, scales: np.ndarray) -> EncodedKV:
    """``header`` with its buffers, once :func:`validate_header` accepts it (the sender's
    check of the arguments that built it).

    Raises:
        ValueError: the header is malformed (the arguments were inconsistent).
    """
    try:
        validate_header(header)
    except KVFormatError as e:
        raise ValueError(str(e)) from e
    return EncodedKV(header=header, payload=payload, scales=scales)


@dataclass(frozen=True)
class DecodedKV:
    """A verified message as typed tensors that alias the received buffers."""

    header: KVHeader
    values: torch.Tensor  # [L, 2, num_blocks, block_size, H, D] float8_e4m3fn or native
    scales: torch.Tensor | None  # [L, 2, num_blocks, H] fp32, None without scales

    @property
    def is_fp8(self) -> bool:
        """Whether the values are fp8_e4m3 codes with scales (else the native dtype)."""
        return self.scales is not None

    def to_dtype(self, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor [L, 2, num_blocks, block_size, H, D] in ``dtype`` (dequantized)."""
        if self.scales is not None:
            return dequantize_blocks(self.values, self.scales, dtype)
        return empty_host(tuple(self.values.shape), dtype).copy_(self.values)


def decode_kv(header: KVHeader, payload, scales) -> DecodedKV:
    """Verify sizes and checksum, and view the bytes as tensors (no copy; a Hadamard-rotated
    message is dequantized and rotated back into a new fp32 tensor, without scales).

    payload, scales: buffers (bytes-like; ``scales`` may be empty) holding exactly
    ``header.payload_bytes`` and ``header.scale_bytes``. The returned tensors alias them:
    use the result before the receive buffer is released.
    Raises KVFormatError (header or sizes, or a hidden section: see
    :func:`~pdserve.kvtransfer.hidden.decode_hidden`) or KVChecksumError.
    """
    validate_header(header)
    if header.section != SECTION_KV:
        raise KVFormatError(f"section: a {header.section!r} message holds no KV")
    payload_np = _byte_view(payload)
    scales_np = _byte_view(scales)
    if payload_np.size != header.payload_bytes:
        raise KVFormatError(f"payload: header says {header.payload_bytes} bytes, "
                            f"got {payload_np.size}")
    if scales_np.size != header.scale_bytes:
        raise KVFormatError(f"scales: header says {header.scale_bytes} bytes, "
                            f"got {scales_np.size}")
    checksum = kv_checksum(payload_np, scales_np)
    if checksum != header.checksum:
        raise KVChecksumError(f"request {header.request_id!r} layers "
                              f"[{header.layer_start}, {header.layer_end}): checksum "
                              f"{checksum:#018x} != header {header.checksum:#018x}")
    payload_t = torch.from_numpy(payload_np)
    if header.dtype == WIRE_DTYPE_FP8:
        values = payload_t.view(FP8_DTYPE).view(header.kv_shape)
        scales_t = _typed_view(scales_np, SCALE_DTYPE).view(header.scales_shape)
        if header.rotation == "hadamard":  # plain K/V again, fp32
            return DecodedKV(header=header, scales=None, values=rotate(
                dequantize_blocks(values, scales_t, torch.float32)))
        return DecodedKV(header=header, values=values, scales=scales_t)
    values = _typed_view(payload_np, NATIVE_WIRE_DTYPES[header.dtype]).view(header.kv_shape)
    return DecodedKV(header=header, values=values, scales=None)


def _native_name(dtype: torch.dtype) -> str:
    for name, native in NATIVE_WIRE_DTYPES.items():
        if native == dtype:
            return name
    raise ValueError(f"kv: dtype {dtype} has no wire format; expected one of "
                     f"{list(NATIVE_WIRE_DTYPES)}")


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as a flat uint8 array, without copying if contiguous."""
    return t.contiguous().view(torch.uint8).reshape(-1).numpy()


def _byte_view(buf) -> np.ndarray:
    arr = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    return arr if arr.flags.writeable else arr.copy()


def _typed_view(raw: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """View uint8 bytes as ``dtype`` (copies only if the start is misaligned)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if raw.ctypes.data % itemsize:
        raw = raw.copy()
    return torch.from_numpy(raw).view(dtype)
