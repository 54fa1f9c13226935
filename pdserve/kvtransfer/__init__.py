"""KV-cache transfer between a prefill worker and a decode worker.

    wire.py          KVHeader + payload (+ FP8 scales), encode_kv / decode_kv
    fp8.py           FP8 e4m3 block quantization with a proven error bound
    checksum.py      wsum64, the 64-bit payload checksum
    blocks.py        gather_blocks / scatter_blocks between a paged cache and a message
    transport.py     KVTransport / KVSender / KVReceiver protocols and the registry
    inproc.py, zmq_transport.py, ucx_transport.py   the transports
"""

from pdserve.kvtransfer.blocks import gather_blocks, scatter_blocks
from pdserve.kvtransfer.errors import (
    KVChecksumError, KVFormatError, KVTransferError, KVTransferTimeout)
from pdserve.fp8 import dequantize_blocks, fp8_error_bound, quantize_blocks
from pdserve.kvtransfer.transport import (
    TRANSPORTS, KVReceiver, KVReceiverConfig, KVSender, KVSendHandle, KVTransport,
    ReceivedKV, create_transport)
from pdserve.kvtransfer.wire import (
    DecodedKV, EncodedKV, KVHeader, decode_header, decode_kv, encode_header, encode_kv)

__all__ = [
    "DecodedKV", "EncodedKV", "KVChecksumError", "KVFormatError", "KVHeader", "KVReceiver",
    "KVReceiverConfig", "KVSendHandle", "KVSender", "KVTransferError", "KVTransferTimeout",
    "KVTransport", "ReceivedKV", "TRANSPORTS", "create_transport", "decode_header",
    "decode_kv", "dequantize_blocks", "encode_header", "encode_kv", "fp8_error_bound",
    "gather_blocks", "quantize_blocks", "scatter_blocks",
]
