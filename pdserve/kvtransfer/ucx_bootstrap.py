"""The UCX transport's connection set-up over zmq (see :mod:`.ucx_transport`): a sender asks
the receiver's bootstrap REP socket for its UCX worker address and a sender id."""

from __future__ import annotations

import zmq

from pdserve.kvtransfer.errors import KVFormatError, KVTransferTimeout

#: The one request a bootstrap socket answers with an address; anything else gets empties.
HELLO = b"pdserve-kv-ucx-1"


def bootstrap(zmq_ctx: zmq.Context, address: str, timeout_s: float) -> tuple[bytes, int]:
    """Ask the receiver at ``address`` for its UCX worker address and our sender id.

    Raises:
        KVTransferTimeout: no answer within ``timeout_s`` seconds.
        KVFormatError: what answered is not a UCX KV receiver.
    """
    sock = zmq_ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(HELLO)
        if not sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            raise KVTransferTimeout(f"no UCX KV receiver answered at {address} within "
                                    f"{timeout_s} s")
        worker_address, sender_id = sock.recv_multipart()
    finally:
        sock.close()
    if not worker_address:
        raise KVFormatError(f"{address} is not a UCX KV receiver")
    return worker_address, int.from_bytes(sender_id, "little")
