"""The Hadamard-rotated FP8 wire (``--kv-transfer-dtype fp8-hadamard``): the rotation is
orthonormal and undone on receipt, the header names it, and on K/V with outlier channels
it lowers the round-trip error at the same bytes."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pdserve.kvtransfer.blocks import scatter_blocks
from pdserve.kvtransfer.errors import KVFormatError
from pdserve.kvtransfer.rotation import hadamard, rotate
from pdserve.kvtransfer.wire import (
    WIRE_VERSION, decode_header, decode_kv, encode_header, encode_kv)


def _outlier_kv(seed: int = 0) -> torch.Tensor:
    """K/V blocks ``[3, 2, 4, 16, 3, 64]`` bf16 whose channels 5 and 40 are 20x the rest,
    as real keys' outlier channels are."""
    torch.manual_seed(seed)
    kv = torch.randn(3, 2, 4, 16, 3, 64)
    kv[..., 5] *= 20
    kv[..., 40] *= -20
    return kv.to(torch.bfloat16)


def _round_trip(kv: torch.Tensor, rotation: str) -> tuple[torch.Tensor, object]:
    msg = encode_kv("r", kv, layer_start=0, num_tokens=60, use_fp8=True, rotation=rotation)
    header = decode_header(encode_header(msg.header))
    decoded = decode_kv(header, msg.payload.copy(), msg.scales.copy())
    return decoded.values, msg.header


def test_hadamard_is_orthonormal_and_its_own_inverse():
    for n in (1, 2, 64, 128):
        h = hadamard(n)
        torch.testing.assert_close(h @ h, torch.eye(n), atol=1e-6, rtol=0)
        torch.testing.assert_close(h, h.T)
    x = torch.randn(5, 3, 64)
    torch.testing.assert_close(rotate(rotate(x)), x, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(48)


def test_rotated_wire_undoes_the_rotation_and_keeps_the_bytes():
    kv = _outlier_kv()
    plain, plain_header = _round_trip(kv, "none")
    rotated, header = _round_trip(kv, "hadamard")
    assert header.rotation == "hadamard" and header.version == WIRE_VERSION >= 3
    assert plain_header.rotation == "none"
    assert (header.payload_bytes, header.scale_bytes) == (plain_header.payload_bytes,
                                                          plain_header.scale_bytes)
    assert rotated.dtype == torch.float32 and rotated.shape == kv.shape  # plain K/V again
    err_plain = (plain.float() - kv.float()).pow(2).mean().item()
    err_rotated = (rotated - kv.float()).pow(2).mean().item()
    # the outlier channels set every (block, head) scale; rotated, they no longer do
    assert err_rotated < 0.5 * err_plain, (err_rotated, err_plain)
    # relative to the values themselves: a few percent, as FP8 e4m3 gives
    assert err_rotated < 2e-3 * kv.float().pow(2).mean().item()


def test_rotated_message_scatters_into_a_bf16_cache():
    kv = _outlier_kv(1)
    msg = encode_kv("r", kv, layer_start=0, num_tokens=64, use_fp8=True, rotation="hadamard")
    decoded = decode_kv(msg.header, msg.payload.copy(), msg.scales.copy())
    cache = torch.zeros(3, 2, 10, 16, 3, 64, dtype=torch.bfloat16)
    scatter_blocks(cache, [7, 2, 9, 0], decoded)
    torch.testing.assert_close(cache[:, :, [7, 2, 9, 0]], decoded.values.to(torch.bfloat16))
    assert cache[:, :, 1].abs().sum() == 0


def test_fp8_codes_and_native_kv_go_unrotated():
    kv = _outlier_kv(2)
    assert encode_kv("r", kv, layer_start=0, num_tokens=64, use_fp8=False,
                     rotation="hadamard").header.rotation == "none"
    from pdserve.fp8 import quantize_blocks

    codes, scales = quantize_blocks(kv)
    msg = encode_kv("r", codes, layer_start=0, num_tokens=64, use_fp8=True, scales=scales,
                    rotation="hadamard")
    assert msg.header.rotation == "none"  # an FP8 cache's codes go as they are stored
    with pytest.raises(ValueError, match="rotation"):
        encode_kv("r", kv, layer_start=0, num_tokens=64, use_fp8=True, rotation="givens")


@pytest.mark.parametrize("change,match", [
    (dict(rotation="givens"), "rotation"),
    (dict(version=2), "rotation"),  # a version-2 sender cannot have rotated
    (dict(dtype="bfloat16", scale_layout="none", scale_bytes=0), "rotation|payload"),
])
def test_headers_with_an_impossible_rotation_are_refused(change, match):
    header = encode_kv("r", _outlier_kv(), layer_start=0, num_tokens=64, use_fp8=True,
                       rotation="hadamard").header
    with pytest.raises(KVFormatError, match=match):
        decode_header(encode_header(msgspec.structs.replace(header, **change)))


def test_cluster_token_covers_the_rotation():
    from pdserve.kvtransfer.wire_auth import header_is_authentic, sign_header
    from pdserve.security import ClusterKeys

    keys = ClusterKeys(b"0123456789abcdef0123")
    header = encode_kv("r", _outlier_kv(), layer_start=0, num_tokens=64, use_fp8=True,
                       rotation="hadamard").header
    signed = sign_header(header, keys, "tcp://127.0.0.1:5000")
    assert header_is_authentic(signed, keys, "tcp://127.0.0.1:5000")
    assert not header_is_authentic(msgspec.structs.replace(signed, rotation="none"), keys,
                                   "tcp://127.0.0.1:5000")
