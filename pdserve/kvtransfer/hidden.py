"""Hidden sections: a prompt's target hidden states, sent with its KV for an EAGLE head.

An EAGLE head drafts from the target's features (its final hidden states, or EAGLE-3's fused
layer inputs) and keeps a one-layer K/V of its own, filled from those features as the
prompt is prefilled. A prompt prefilled on a prefill worker arrives on the decode worker as
KV only; with its features (one row per position, the head's input) the decode worker runs
the head over the prompt and leaves its cache as a local prefill would. One message per
transfer, after the KV layers, through the same transports::

    part 0  KVHeader: section "hidden", version >= 2, num_tokens, hidden_start,
            hidden_size, dtype; layer range, KV geometry and scale bytes 0
    part 1  payload  [num_tokens - hidden_start, hidden_size] bfloat16 | float16 | float32
    part 2  empty

``hidden_start`` > 0 when the prefill worker took the prompt's first positions from its
prefix cache and so never had their features. Every KV message of such a transfer carries
``hidden_size`` so that the receiver waits for the section.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kvtransfer.checksum import kv_checksum
from pdserve.kvtransfer.errors import KVChecksumError, KVFormatError
from pdserve.kvtransfer.wire import (
    NATIVE_WIRE_DTYPES, SCALE_LAYOUT_NONE, SECTION_HIDDEN, WIRE_VERSION, EncodedKV, KVHeader,
    _as_bytes, _byte_view, _native_name, _typed_view, checked_encoding, validate_header)


def encode_hidden(request_id: str, hidden: torch.Tensor, *, hidden_start: int,
                  num_tokens: int) -> EncodedKV:
    """Encode a prompt's hidden states as a hidden-section message.

    Args:
        hidden: ``[num_tokens - hidden_start, hidden_size]`` bf16/fp16/fp32 CPU, the rows of
            prompt positions ``hidden_start ..`` (sent in its own dtype: cast it first).
        hidden_start: the first prompt position in ``hidden``.
        num_tokens: the prompt's length (its KV messages' ``num_tokens``).

    Raises:
        ValueError: ``hidden`` is not 2-d, has no wire dtype, or does not have
            ``num_tokens - hidden_start`` rows.
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected [num_tokens - hidden_start, hidden_size], got "
                         f"{tuple(hidden.shape)}")
    payload = _as_bytes(hidden)
    scales = np.empty(0, dtype=np.uint8)
    header = KVHeader(
        request_id=request_id, layer_start=0, layer_end=0, num_tokens=num_tokens,
        num_blocks=0, block_size=0, num_kv_heads=0, head_dim=0,
        dtype=_native_name(hidden.dtype), scale_layout=SCALE_LAYOUT_NONE,
        payload_bytes=payload.size, scale_bytes=0, checksum=kv_checksum(payload, scales),
        version=WIRE_VERSION, section=SECTION_HIDDEN, hidden_size=hidden.shape[1],
        hidden_start=hidden_start)
    return checked_encoding(header, payload, scales)


@dataclass(frozen=True)
class DecodedHidden:
    """A verified hidden section; ``features`` aliases the received buffer."""

    header: KVHeader
    features: torch.Tensor  # [num_tokens - hidden_start, hidden_size] in the wire dtype

    @property
    def hidden_start(self) -> int:
        """The first prompt position in :attr:`features`."""
        return self.header.hidden_start


def decode_hidden(header: KVHeader, payload, scales) -> DecodedHidden:
    """Verify a hidden section's header, sizes and checksum, and view its rows (no copy:
    use them before the receive buffer is released).

    Raises:
        KVFormatError: not a hidden section, a bad header, or sizes that differ from it.
        KVChecksumError: the bytes do not match the header's checksum.
    """
    validate_header(header)
    if header.section != SECTION_HIDDEN:
        raise KVFormatError(f"section: expected {SECTION_HIDDEN!r}, got {header.section!r}")
    payload_np, scales_np = _byte_view(payload), _byte_view(scales)
    if payload_np.size != header.payload_bytes or scales_np.size != 0:
        raise KVFormatError(f"hidden section: header says {header.payload_bytes} + 0 bytes, "
                            f"got {payload_np.size} + {scales_np.size}")
    checksum = kv_checksum(payload_np, scales_np)
    if checksum != header.checksum:
        raise KVChecksumError(f"request {header.request_id!r} hidden section: checksum "
                              f"{checksum:#018x} != header {header.checksum:#018x}")
    rows = header.num_tokens - header.hidden_start
    features = _typed_view(payload_np, NATIVE_WIRE_DTYPES[header.dtype])
    return DecodedHidden(header=header, features=features.view(rows, header.hidden_size))
