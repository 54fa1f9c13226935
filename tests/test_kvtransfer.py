"""Wire format: header, sizes, checksum, FP8 size budget, gather/scatter of blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kvtransfer.blocks import gather_blocks, scatter_blocks
from pdserve.kvtransfer.checksum import ROW_WORDS, kv_checksum, wsum64
from pdserve.kvtransfer.errors import KVChecksumError, KVFormatError
from pdserve.fp8 import dequantize_blocks, quantize_blocks
from pdserve.kvtransfer.wire import (
    KVHeader, decode_header, decode_kv, encode_header, encode_kv)

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; block 16; a 2k-token prompt.
SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, num_tokens=2048)


def _kv(num_layers=3, num_blocks=4, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(num_layers, 2, num_blocks, 16, 3, 64).to(dtype)


def _reference_wsum64(data: bytes) -> int:
    """wsum64 by its definition, in plain Python integers."""
    padded = data + b"\0" * (-len(data) % 8)
    words = [int.from_bytes(padded[i:i + 8], "little") for i in range(0, len(padded), 8)]
    rows = [sum(words[i:i + ROW_WORDS]) for i in range(0, len(words), ROW_WORDS)]
    s1 = sum(rows)
    s2 = sum((k + 1) * r for k, r in enumerate(rows))
    return (s1 + 0x9E3779B97F4A7C16 * s2 + len(data)) % 2 ** 64


def test_fp8_wire_bytes_at_most_052_of_bf16_for_smollm2_2k_tokens():
    m = SMOLLM2
    num_blocks = m["num_tokens"] // m["block_size"]
    # By hand: bf16 = 30*2*128*16*3*64*2 B; fp8 = half of that + 30*2*128*3 fp32 scales.
    bf16_bytes = 30 * 2 * 128 * 16 * 3 * 64 * 2
    fp8_bytes = bf16_bytes // 2 + 30 * 2 * 128 * 3 * 4
    torch.manual_seed(0)
    kv = torch.randn(m["num_layers"], 2, num_blocks, m["block_size"], m["num_kv_heads"],
                     m["head_dim"], dtype=torch.bfloat16)
    plain = encode_kv("r", kv, layer_start=0, num_tokens=2048, use_fp8=False).header
    fp8 = encode_kv("r", kv, layer_start=0, num_tokens=2048, use_fp8=True).header
    assert plain.payload_bytes + plain.scale_bytes == bf16_bytes == 47_185_920
    assert fp8.payload_bytes + fp8.scale_bytes == fp8_bytes == 23_685_120
    assert fp8_bytes / bf16_bytes <= 0.52  # 0.502


def test_header_round_trips_through_msgpack():
    header = encode_kv("req-1", _kv(), layer_start=5, num_tokens=60, use_fp8=True).header
    assert decode_header(encode_header(header)) == header
    assert (header.layer_start, header.layer_end, header.num_blocks) == (5, 8, 4)
    assert header.dtype == "fp8_e4m3" and header.scale_layout == "per_layer_kv_block_head"
    assert len(encode_header(header)) < 300


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_native_dtype_round_trips_bit_exactly(dtype):
    kv = _kv(dtype=dtype)
    msg = encode_kv("r", kv, layer_start=0, num_tokens=64, use_fp8=False)
    decoded = decode_kv(msg.header, msg.payload.copy(), msg.scales.copy())
    assert decoded.scales is None and msg.header.scale_layout == "none"
    assert torch.equal(decoded.values, kv)
    assert torch.equal(decoded.to_dtype(dtype), kv)


def test_fp8_message_decodes_to_local_dequantization():
    kv = _kv()
    msg = encode_kv("r", kv, layer_start=0, num_tokens=64, use_fp8=True)
    decoded = decode_kv(msg.header, bytearray(msg.payload), bytearray(msg.scales))
    payload, scales = quantize_blocks(kv)
    assert torch.equal(decoded.scales, scales)
    assert torch.equal(decoded.to_dtype(torch.bfloat16),
                       dequantize_blocks(payload, scales, torch.bfloat16))


@pytest.mark.parametrize("part,position", [("payload", 0), ("payload", 12345),
                                           ("payload", -1), ("scales", 7)])
def test_flipped_byte_raises_checksum_error(part, position):
    msg = encode_kv("r", _kv(), layer_start=0, num_tokens=64, use_fp8=True)
    payload, scales = msg.payload.copy(), msg.scales.copy()
    target = payload if part == "payload" else scales
    target[position] ^= 0x01
    with pytest.raises(KVChecksumError, match="checksum"):
        decode_kv(msg.header, payload, scales)


def test_checksum_sees_every_single_byte_change():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=3 * ROW_WORDS * 8 + 5, dtype=np.uint8)  # ragged tail
    base = wsum64(data)
    for i in range(data.size):
        for flip in (0x01, 0x80, 0xFF):
            data[i] ^= flip
            assert wsum64(data) != base, (i, flip)
            data[i] ^= flip


def test_checksum_matches_its_definition_and_sees_moved_rows():
    rng = np.random.default_rng(1)
    for size in (0, 1, 7, 8, 9, ROW_WORDS * 8, 5 * ROW_WORDS * 8 + 3):
        data = rng.integers(0, 256, size=size, dtype=np.uint8)
        assert wsum64(data) == _reference_wsum64(data.tobytes()), size
    data = rng.integers(0, 256, size=4 * ROW_WORDS * 8, dtype=np.uint8)
    rows = data.reshape(4, -1)
    assert wsum64(rows[[1, 0, 2, 3]].copy()) != wsum64(data)
    # A change in the scales alone changes the message checksum.
    assert kv_checksum(data, b"\x00" * 8) != kv_checksum(data, b"\x00" * 7 + b"\x80")


def test_size_mismatch_raises_format_error():
    msg = encode_kv("r", _kv(), layer_start=0, num_tokens=64, use_fp8=True)
    with pytest.raises(KVFormatError, match="payload"):
        decode_kv(msg.header, msg.payload[:-1].copy(), msg.scales.copy())
    with pytest.raises(KVFormatError, match="scales"):
        decode_kv(msg.header, msg.payload.copy(), msg.scales[:-4].copy())


@pytest.mark.parametrize("field,value,match", [
    ("dtype", "int8", "dtype"),
    ("scale_layout", "none", "scale_layout"),
    ("payload_bytes", 10, "payload_bytes"),
    ("scale_bytes", 0, "scale_bytes"),
    ("layer_end", 0, "layer_end"),
    ("num_tokens", 10_000, "num_tokens"),
    ("num_blocks", 0, "num_blocks"),
])
def test_inconsistent_header_raises_format_error(field, value, match):
    header = encode_kv("r", _kv(), layer_start=0, num_tokens=64, use_fp8=True).header
    bad = msgspec_replace(header, **{field: value})
    with pytest.raises(KVFormatError, match=match):
        decode_header(encode_header(bad))


def test_garbage_header_bytes_raise_format_error():
    with pytest.raises(KVFormatError, match="malformed"):
        decode_header(b"\x93\x01\x02")


def test_gather_then_scatter_moves_blocks_to_other_ids():
    torch.manual_seed(3)
    src = torch.randn(4, 2, 10, 16, 3, 64, dtype=torch.bfloat16)
    dst = torch.zeros(4, 2, 12, 16, 3, 64, dtype=torch.bfloat16)
    src_ids, dst_ids = [7, 2, 9], [0, 11, 5]
    for layer_start, layer_end in [(0, 1), (1, 4)]:
        kv = gather_blocks(src, src_ids, layer_start, layer_end)
        msg = encode_kv("r", kv, layer_start=layer_start, num_tokens=40, use_fp8=False)
        scatter_blocks(dst, dst_ids, decode_kv(msg.header, msg.payload, msg.scales))
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    untouched = [i for i in range(12) if i not in dst_ids]
    assert bool((dst[:, :, untouched] == 0).all())


def test_scatter_dequantizes_fp8_into_a_float32_cache():
    torch.manual_seed(4)
    src = torch.randn(2, 2, 3, 16, 3, 64)
    dst = torch.zeros(2, 2, 3, 16, 3, 64)
    msg = encode_kv("r", src, layer_start=0, num_tokens=48, use_fp8=True)
    scatter_blocks(dst, [2, 1, 0], decode_kv(msg.header, msg.payload, msg.scales))
    payload, scales = quantize_blocks(src)
    expected = dequantize_blocks(payload, scales, torch.float32)
    assert torch.equal(dst, expected.flip(2))


def test_scatter_rejects_wrong_block_count_and_layout():
    dst = torch.zeros(2, 2, 4, 16, 3, 64, dtype=torch.bfloat16)
    msg = encode_kv("r", _kv(num_layers=2, num_blocks=2), layer_start=0, num_tokens=20,
                    use_fp8=False)
    decoded = decode_kv(msg.header, msg.payload, msg.scales)
    with pytest.raises(ValueError, match="block_ids"):
        scatter_blocks(dst, [0, 1, 2], decoded)
    with pytest.raises(ValueError, match="block_ids"):
        scatter_blocks(dst, [0, 4], decoded)
    with pytest.raises(ValueError, match="do not fit"):
        scatter_blocks(torch.zeros(2, 2, 4, 8, 3, 64), [0, 1], decoded)


def msgspec_replace(header: KVHeader, **changes) -> KVHeader:
    import msgspec

    return msgspec.structs.replace(header, **changes)
