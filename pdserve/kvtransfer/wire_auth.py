"""The KV wire's authentication: an HMAC-SHA256 by the cluster secret over a header's
identity, its destination and its checksum (see :mod:`pdserve.kvtransfer.wire`)."""

from __future__ import annotations

import hmac

import msgspec

from pdserve.kvtransfer.wire import KVHeader


def _auth_parts(header: KVHeader, dest_address: str) -> tuple[bytes, ...]:
    return (b"kv-push", header.request_id.encode(), dest_address.encode(),
            *(str(v).encode() for v in (header.layer_start, header.layer_end,
                                         header.num_tokens, header.num_blocks,
                                         header.payload_bytes, header.scale_bytes,
                                         header.checksum, header.version, header.section,
                                         header.hidden_size, header.hidden_start,
                                         header.rotation)))


def sign_header(header: KVHeader, keys, dest_address: str) -> KVHeader:
    """``header`` with its ``auth`` HMAC for a push to ``dest_address`` (the receiver's
    advertised KV address); ``keys`` is a :class:`pdserve.security.ClusterKeys`."""
    return msgspec.structs.replace(header, auth=keys.sign(*_auth_parts(header, dest_address)))


def header_is_authentic(header: KVHeader, keys, dest_address: str) -> bool:
    """Whether ``header.auth`` is the cluster's HMAC for a push to ``dest_address``."""
    return hmac.compare_digest(header.auth, keys.sign(*_auth_parts(header, dest_address)))
