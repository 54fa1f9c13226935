"""Hidden sections on the KV wire (a prompt's target hidden states for an EAGLE head):
encode/decode, version and section fields, and rejection of malformed frames."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pdserve.kvtransfer.errors import KVChecksumError, KVFormatError
from pdserve.kvtransfer.hidden import decode_hidden, encode_hidden
from pdserve.kvtransfer.wire import (
    WIRE_VERSION, KVHeader, decode_header, decode_kv, encode_header, encode_kv)
from pdserve.kvtransfer.wire_auth import header_is_authentic, sign_header
from pdserve.security import ClusterKeys


def _hidden(rows=10, width=576, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(rows, width).to(dtype)


def _msg(rows=10, start=2, dtype=torch.bfloat16):
    return encode_hidden("req", _hidden(rows, dtype=dtype), hidden_start=start,
                         num_tokens=start + rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_hidden_section_round_trips_bit_exactly(dtype):
    rows = _hidden(7, 64, dtype)
    msg = encode_hidden("req", rows, hidden_start=5, num_tokens=12)
    header = decode_header(encode_header(msg.header))
    got = decode_hidden(header, msg.payload.copy(), msg.scales.copy())
    assert got.features.dtype == dtype and got.hidden_start == 5
    assert torch.equal(got.features, rows)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    assert header.payload_bytes == 7 * 64 * itemsize  # by hand: rows x width x itemsize


def test_hidden_header_names_its_section_version_and_no_kv():
    header = _msg().header
    assert (header.section, header.version, header.hidden_size, header.hidden_start) == \
        ("hidden", WIRE_VERSION, 576, 2)
    assert (header.layer_start, header.layer_end, header.num_blocks, header.scale_bytes) == \
        (0, 0, 0, 0)
    assert len(encode_header(header)) < 300


def test_kv_messages_announce_the_hidden_section_that_follows():
    kv = torch.randn(2, 2, 1, 16, 3, 64)
    header = encode_kv("req", kv, layer_start=0, num_tokens=12, use_fp8=True,
                       hidden_size=576).header
    assert decode_header(encode_header(header)).hidden_size == 576
    plain = encode_kv("req", kv, layer_start=0, num_tokens=12, use_fp8=True).header
    assert (plain.section, plain.hidden_size, plain.version) == ("kv", 0, WIRE_VERSION)


def test_a_header_without_the_version_2_fields_reads_as_version_1_kv():
    header = encode_kv("req", torch.randn(1, 2, 1, 16, 3, 64), layer_start=0, num_tokens=16,
                       use_fp8=False).header
    old = msgspec.structs.asdict(header)
    for name in ("version", "section", "hidden_size", "hidden_start"):
        del old[name]
    read = decode_header(msgspec.msgpack.encode(old))
    assert (read.version, read.section, read.hidden_size) == (1, "kv", 0)


def test_flipped_hidden_byte_raises_checksum_error():
    msg = _msg()
    payload = msg.payload.copy()
    payload[123] ^= 0x10
    with pytest.raises(KVChecksumError, match="hidden section"):
        decode_hidden(msg.header, payload, msg.scales.copy())


def test_truncated_or_padded_hidden_payload_raises_format_error():
    msg = _msg()
    with pytest.raises(KVFormatError, match="hidden section"):
        decode_hidden(msg.header, msg.payload[:-2].copy(), msg.scales.copy())
    with pytest.raises(KVFormatError, match="hidden section"):
        decode_hidden(msg.header, msg.payload.copy(), b"\0" * 4)


@pytest.mark.parametrize("field,value,match", [
    ("version", WIRE_VERSION + 1, "version"),
    ("version", 0, "version"),
    ("version", 1, "version >= 2"),
    ("section", "draft_kv", "section"),
    ("hidden_size", 0, "hidden_size"),
    ("hidden_size", -1, "hidden_size"),
    ("hidden_start", 12, "hidden_start"),
    ("payload_bytes", 10, "payload_bytes"),
    ("num_blocks", 1, "num_blocks"),
    ("layer_end", 1, "layer_end"),
    ("scale_bytes", 4, "scale_bytes"),
    ("dtype", "fp8_e4m3", "dtype"),
    ("scale_layout", "per_layer_kv_block_head", "dtype"),
])
def test_inconsistent_hidden_header_raises_format_error(field, value, match):
    bad = msgspec.structs.replace(_msg().header, **{field: value})
    with pytest.raises(KVFormatError, match=match):
        decode_header(encode_header(bad))


def test_kv_header_with_a_hidden_start_or_a_future_version_is_refused():
    header = encode_kv("req", torch.randn(1, 2, 1, 16, 3, 64), layer_start=0, num_tokens=16,
                       use_fp8=False).header
    for change, match in (({"hidden_start": 3}, "hidden_start"),
                          ({"version": WIRE_VERSION + 1}, "version"),
                          ({"hidden_size": -5}, "hidden_size")):
        with pytest.raises(KVFormatError, match=match):
            decode_header(encode_header(msgspec.structs.replace(header, **change)))


def test_sections_are_not_decoded_as_each_other():
    hidden = _msg()
    with pytest.raises(KVFormatError, match="holds no KV"):
        decode_kv(hidden.header, hidden.payload.copy(), hidden.scales.copy())
    kv = encode_kv("req", torch.randn(1, 2, 1, 16, 3, 64), layer_start=0, num_tokens=16,
                   use_fp8=False)
    with pytest.raises(KVFormatError, match="expected 'hidden'"):
        decode_hidden(kv.header, kv.payload.copy(), kv.scales.copy())


def test_encode_hidden_rejects_what_the_wire_cannot_carry():
    with pytest.raises(ValueError, match="hidden"):
        encode_hidden("req", torch.zeros(4), hidden_start=0, num_tokens=4)
    with pytest.raises(ValueError, match="payload_bytes"):  # 4 rows for a 6-row section
        encode_hidden("req", torch.zeros(4, 8), hidden_start=0, num_tokens=6)
    with pytest.raises(ValueError, match="no wire format"):
        encode_hidden("req", torch.zeros(4, 8, dtype=torch.float64), hidden_start=0,
                      num_tokens=4)


def test_cluster_token_covers_the_section_fields():
    keys = ClusterKeys(b"0123456789abcdef0123")
    signed = sign_header(_msg().header, keys, "tcp://127.0.0.1:5000")
    assert header_is_authentic(signed, keys, "tcp://127.0.0.1:5000")
    for change in ({"hidden_start": 3}, {"hidden_size": 288}, {"section": "kv"},
                   {"version": 1}):
        assert not header_is_authentic(msgspec.structs.replace(signed, **change), keys,
                                       "tcp://127.0.0.1:5000"), change
