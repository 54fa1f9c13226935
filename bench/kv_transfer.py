"""KV transfer throughput of each transport vs the raw transport moving the same bytes.

A 2k-token SmolLM2-135M KV (30 layers x K/V x 128 blocks x 16 x 3 heads x 64, bf16 =
47.2 MB) goes from a sender process to a receiver process (inproc: one process), as one
message per request or as 30 per-layer messages, in bf16 or FP8, in two ways:

  kv (end to end, modes "bf16", "fp8", ...)  sender: encode_kv (FP8 quantize + checksum)
       + send_nowait, up to --window requests in flight; receiver: recv into a staging
       buffer + decode (checksum) + FP8 dequantize to bf16 (not the scatter into a cache:
       its cost is listed below)
  kv from an FP8 cache (mode "fp8 cache per-layer")  what prefill and decode workers
       with --kv-cache-dtype fp8 do: the codes and scales as stored (quantized once before
       the clock, as the attention kernel's KV store does) go out per layer with their
       checksum; the receiver verifies it and copies codes and scales into the request's
       tensors (no quantize, no dequantize)
  kv transport-only (modes "... transport")  the same messages encoded once before the
       clock starts; the receiver only receives into the staging buffer and releases it.
       The gap between the two is the CPU codec (on a GPU the quantize/dequantize is a
       fused kernel); the gap between transport-only and raw is the transport's own
       overhead (framing, staging buffers).
  raw  the same transport moving the same number of bytes per message as plain buffers,
       with the same window: zmq: one PUSH frame (copy=False, tracked) -> PULL recv_into
       one of two reused buffers; ucx: one tagged send on the same kind of ucxx endpoint
       and progress loop -> a tagged receive posted one message ahead; inproc: the
       same two copies, one request at a time. Measured once per wire size (a mode and
       its transport-only twin move the same bytes).

Throughput is measured at the receiver after warm-up messages, over --requests requests.
GB/s counts wire bytes; "KV GB/s" counts the bf16 KV that arrived (for FP8 twice the
wire bytes). Also prints the single-thread cost of each step (gather, quantize,
checksums, dequantize, scatter). Other processes on a 2-core machine skew the numbers:
each figure is the best of --repeats runs.

    python bench/kv_transfer.py [--transports inproc,zmq,ucx] [--requests 8] [--repeats 3]
                                [--modes 'bf16,bf16 transport,fp8,fp8 transport']
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import time
import zlib
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_TOKENS = 30, 16, 3, 64, 2048
NUM_BLOCKS = NUM_TOKENS // BLOCK_SIZE
KV_SHAPE = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
KV_BYTES = int(np.prod(KV_SHAPE)) * 2
TIMEOUT_S = 60.0
NUM_WARMUP = 2
RAW_TAG = 0x5241_5700


@dataclass(frozen=True)
class Mode:
    """What one timed run moves: bf16 or FP8, one message or one per layer, and whether the
    codec runs inside the timing (``has_codec``: encode = FP8 quantize + checksum, decode =
    checksum + FP8 dequantize) or the payload was encoded once beforehand and the receiver
    only receives and releases (transport-only: framing, staging buffers, the wire)."""

    name: str
    use_fp8: bool
    per_layer: bool
    has_codec: bool = True
    stored_fp8: bool = False  # FP8 cache -> FP8 cache: checksums and copies, no codec

    def layer_ranges(self) -> list[tuple[int, int]]:
        if self.per_layer:
            return [(i, i + 1) for i in range(NUM_LAYERS)]
        return [(0, NUM_LAYERS)]

    def wire_bytes(self, layer_start: int, layer_end: int) -> int:
        n = (layer_end - layer_start) * 2 * NUM_BLOCKS
        per_block = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
        return n * per_block + n * NUM_KV_HEADS * 4 if self.use_fp8 else n * per_block * 2


MODES = [Mode("bf16", False, False), Mode("bf16 transport", False, False, has_codec=False),
         Mode("fp8", True, False), Mode("fp8 transport", True, False, has_codec=False),
         Mode("bf16 per-layer", False, True), Mode("fp8 per-layer", True, True),
         Mode("fp8 per-layer transport", True, True, has_codec=False),
         Mode("fp8 cache per-layer", True, True, stored_fp8=True)]


def raw_twin(mode: Mode) -> Mode:
    """The mode whose raw run moves the same bytes (raw has no codec to leave out)."""
    return Mode(mode.name.removesuffix(" transport").replace(" cache", ""), mode.use_fp8,
                mode.per_layer)


def make_kv() -> torch.Tensor:
    """Stands in for gather_blocks' output (NumPy-backed memory, like it)."""
    from pdserve.host_memory import empty_host

    torch.manual_seed(0)
    kv = empty_host(KV_SHAPE, torch.bfloat16)  # [30, 2, 128, 16, 3, 64]
    return kv.copy_(torch.randn(KV_SHAPE))


# --- receiving side ---------------------------------------------------------------------

def receive_kv(receiver, mode: Mode, num_requests: int, num_warmup: int = NUM_WARMUP,
               out: torch.Tensor | None = None) -> float:
    """recv + decode (checksum) + FP8 dequantize into ``out``; seconds after warm-up."""
    from pdserve.fp8 import dequantize_blocks

    out = torch.empty(KV_SHAPE, dtype=torch.bfloat16) if out is None else out
    codes = torch.empty(KV_SHAPE, dtype=torch.float8_e4m3fn) if mode.stored_fp8 else None
    scales = torch.empty(KV_SHAPE[:3] + KV_SHAPE[4:5]) if mode.stored_fp8 else None
    num_messages = len(mode.layer_ranges())
    t0 = time.perf_counter()
    for i in range((num_warmup + num_requests) * num_messages):
        if i == num_warmup * num_messages:
            t0 = time.perf_counter()
        with receiver.recv(timeout_s=TIMEOUT_S) as msg:
            if not mode.has_codec:
                continue  # transport-only: the bytes are in the staging buffer
            kv = msg.decode()
            if mode.stored_fp8:
                h = kv.header
                codes[h.layer_start:h.layer_end] = kv.values
                scales[h.layer_start:h.layer_end] = kv.scales
            elif kv.is_fp8:
                h = kv.header
                dequantize_blocks(kv.values, kv.scales, torch.bfloat16,
                                  out=out[h.layer_start:h.layer_end])
    return time.perf_counter() - t0


def receive_raw(post_recv, mode: Mode, num_requests: int) -> float:
    """Plain receives, each posted one message ahead into the other of two buffers."""
    sizes = [mode.wire_bytes(*r) for r in mode.layer_ranges()]
    bufs = [np.zeros(max(sizes), dtype=np.uint8) for _ in range(2)]
    pending: deque = deque()
    t0 = 0.0
    for i in range(NUM_WARMUP + num_requests):
        for j, size in enumerate(sizes):
            pending.append(post_recv(memoryview(bufs[len(pending) % 2])[:size]))
            if len(pending) == 2:
                pending.popleft().wait()
        if i == NUM_WARMUP - 1:
            while pending:
                pending.popleft().wait()
            t0 = time.perf_counter()
    while pending:
        pending.popleft().wait()
    return time.perf_counter() - t0


def send_kv(sender, kv: torch.Tensor, mode: Mode, num_requests: int, window: int,
            encoded_cache: dict | None = None) -> None:
    """encode + send_nowait each message; at most ``window`` requests in flight.

    Transport-only modes send messages encoded once (kept in ``encoded_cache`` across calls
    when given, as the in-process run sends one request per call)."""
    from pdserve.kvtransfer.wire import encode_kv

    encoded_cache = {} if encoded_cache is None else encoded_cache
    stored = None
    if mode.stored_fp8:  # the FP8 cache's contents, quantized when the KV was stored
        from pdserve.fp8 import quantize_blocks

        if "stored fp8" not in encoded_cache:
            encoded_cache["stored fp8"] = quantize_blocks(kv)
        stored = encoded_cache["stored fp8"]

    def encode(start: int, end: int):
        if stored is not None:
            return encode_kv("req", stored[0][start:end], layer_start=start,
                             num_tokens=NUM_TOKENS, use_fp8=True, scales=stored[1][start:end])
        return encode_kv("req", kv[start:end], layer_start=start, num_tokens=NUM_TOKENS,
                         use_fp8=mode.use_fp8)

    # transport-only: encoded once here, before the receiver's clock starts (warm-up)
    if not mode.has_codec and mode.name not in encoded_cache:
        encoded_cache[mode.name] = [encode(*r) for r in mode.layer_ranges()]
    pre_encoded = encoded_cache.get(mode.name) if not mode.has_codec else None
    in_flight: deque = deque()  # (handle, message): the message keeps its buffers alive
    for _ in range(num_requests):
        for i, (start, end) in enumerate(mode.layer_ranges()):
            msg = encode(start, end) if pre_encoded is None else pre_encoded[i]
            handle = sender.send_nowait(msg.header, msg.buffers, timeout_s=TIMEOUT_S)
            in_flight.append((handle, msg))
            while len(in_flight) > window * len(mode.layer_ranges()):
                in_flight.popleft()[0].wait(timeout_s=TIMEOUT_S)
    for handle, _ in in_flight:
        handle.wait(timeout_s=TIMEOUT_S)


def send_raw(post_send, mode: Mode, num_requests: int, window: int) -> None:
    """Plain sends of one buffer, with the same in-flight window as send_kv."""
    sizes = [mode.wire_bytes(*r) for r in mode.layer_ranges()]
    buf = np.ones(max(sizes), dtype=np.uint8)
    in_flight: deque = deque()
    for _ in range(num_requests):
        for size in sizes:
            in_flight.append(post_send(memoryview(buf)[:size]))
            while len(in_flight) > window * len(sizes):
                in_flight.popleft().wait()
    for handle in in_flight:
        handle.wait()


# --- raw endpoints over the same transports -------------------------------------------

class _Done:
    def wait(self) -> None:
        pass


class _FutureWait:
    def __init__(self, future) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result(TIMEOUT_S)


def raw_zmq_receiver():
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 12)
    sock.bind("tcp://127.0.0.1:*")

    def post(view):  # zmq's I/O thread receives ahead by itself
        sock.recv_into(view)
        return _Done()
    return sock.getsockopt_string(zmq.LAST_ENDPOINT), post


def raw_zmq_sender(address: str):
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 12)
    sock.connect(address)

    def post(view):
        return _TrackerWait(sock.send(view, copy=False, track=True))
    return post


class _TrackerWait:
    def __init__(self, tracker) -> None:
        self._tracker = tracker

    def wait(self) -> None:
        self._tracker.wait(TIMEOUT_S)


def raw_ucx_receiver(transport):
    receiver = transport.create_receiver(_tiny_config())  # for its bootstrap socket

    def post(view):
        return _FutureWait(transport.submit(transport.ctx.recv(view, tag=RAW_TAG)))
    return receiver.address, post


def raw_ucx_sender(transport, address: str):
    sender = transport.create_sender(address, timeout_s=TIMEOUT_S)

    def post(view):
        return _FutureWait(transport.submit(
            sender.endpoint.send(view, tag=RAW_TAG, force_tag=True)))
    return post


def _tiny_config():
    from pdserve.kvtransfer.transport import KVReceiverConfig

    return KVReceiverConfig(max_message_bytes=1)


# --- processes --------------------------------------------------------------------------

def receiver_main(name: str, kind: str, conn) -> None:
    torch.set_num_threads(1)
    from pdserve.kvtransfer.transport import KVReceiverConfig, create_transport

    transport = create_transport(name)
    if kind == "kv":
        rx = transport.create_receiver(KVReceiverConfig(max_message_bytes=KV_BYTES))
        address = rx.address
    elif name == "zmq":
        address, raw_recv = raw_zmq_receiver()
    else:
        address, raw_recv = raw_ucx_receiver(transport)
    conn.send(address)
    while (command := conn.recv()) is not None:
        mode, num_requests = command
        if kind == "kv":
            conn.send(receive_kv(rx, mode, num_requests))
        else:
            conn.send(receive_raw(raw_recv, mode, num_requests))
    transport.close()


def sender_main(name: str, kind: str, address: str, window: int, conn) -> None:
    torch.set_num_threads(1)
    from pdserve.kvtransfer.transport import create_transport

    transport = create_transport(name)
    kv = make_kv()
    if kind == "kv":
        sender = transport.create_sender(address, timeout_s=TIMEOUT_S)
    elif name == "zmq":
        raw_send = raw_zmq_sender(address)
    else:
        raw_send = raw_ucx_sender(transport, address)
    conn.send("connected")
    while (command := conn.recv()) is not None:
        mode, num_requests = command
        if kind == "kv":
            send_kv(sender, kv, mode, NUM_WARMUP + num_requests, window)
        else:
            send_raw(raw_send, mode, NUM_WARMUP + num_requests, window)
        conn.send("done")
    transport.close()


def run_two_processes(name: str, kind: str, modes: list[Mode], num_requests: int,
                      repeats: int, window: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    rx_conn, rx_child = ctx.Pipe()
    tx_conn, tx_child = ctx.Pipe()
    rx = ctx.Process(target=receiver_main, args=(name, kind, rx_child), daemon=True)
    rx.start()
    address = rx_conn.recv()
    tx = ctx.Process(target=sender_main, args=(name, kind, address, window, tx_child), daemon=True)
    tx.start()
    assert tx_conn.recv() == "connected"
    best = {}
    for mode in modes:
        for _ in range(repeats):
            rx_conn.send((mode, num_requests))
            tx_conn.send((mode, num_requests))
            elapsed = rx_conn.recv()
            assert tx_conn.recv() == "done"
            best[mode.name] = min(best.get(mode.name, float("inf")), elapsed)
    for conn in (rx_conn, tx_conn):
        conn.send(None)
    for p in (rx, tx):
        p.join(10)
        if p.is_alive():
            p.kill()
    return best


def run_inproc(kind: str, modes: list[Mode], num_requests: int, repeats: int) -> dict:
    from pdserve.kvtransfer.transport import KVReceiverConfig, create_transport

    transport = create_transport("inproc")
    rx = transport.create_receiver(KVReceiverConfig(max_message_bytes=KV_BYTES))
    sender = transport.create_sender(rx.address, timeout_s=TIMEOUT_S)
    kv, out = make_kv(), torch.empty(KV_SHAPE, dtype=torch.bfloat16)
    src = np.ones(KV_BYTES, dtype=np.uint8)
    dst = np.zeros(KV_BYTES, dtype=np.uint8)
    encoded_cache: dict = {}

    def one_request(mode: Mode) -> None:  # one request in flight at a time
        if kind == "kv":
            send_kv(sender, kv, mode, 1, window=1, encoded_cache=encoded_cache)
            receive_kv(rx, mode, 1, num_warmup=0, out=out)
        else:
            for size in (mode.wire_bytes(*r) for r in mode.layer_ranges()):
                dst[:size] = np.frombuffer(bytes(memoryview(src)[:size]), np.uint8)

    best = {}
    for mode in modes:
        one_request(mode)  # warm-up
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(num_requests):
                one_request(mode)
            best[mode.name] = min(best.get(mode.name, float("inf")), time.perf_counter() - t)
    return best


# --- single-thread cost of each step ------------------------------------------------------

def time_best(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def print_steps() -> None:
    from pdserve.kvtransfer.blocks import gather_blocks
    from pdserve.kvtransfer.checksum import wsum64
    from pdserve.fp8 import dequantize_blocks, quantize_blocks

    kv = make_kv()
    cache = torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS + 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                        dtype=torch.bfloat16)
    ids = torch.randperm(NUM_BLOCKS + 64)[:NUM_BLOCKS]
    payload, scales = quantize_blocks(kv)
    out = torch.empty_like(kv)
    raw = kv.view(torch.uint8).reshape(-1).numpy()
    dst = np.empty_like(raw)
    steps = [
        ("memcpy (reference)", KV_BYTES, lambda: np.copyto(dst, raw)),
        ("gather blocks (index_select)", KV_BYTES,
         lambda: gather_blocks(cache, ids, 0, NUM_LAYERS)),
        ("scatter blocks (index_copy_)", KV_BYTES,
         lambda: cache.index_copy_(2, ids, kv)),
        ("FP8 quantize (bf16 in)", KV_BYTES, lambda: quantize_blocks(kv)),
        ("FP8 dequantize (bf16 out)", KV_BYTES,
         lambda: dequantize_blocks(payload, scales, torch.bfloat16, out=out)),
        ("checksum wsum64 (chosen)", KV_BYTES, lambda: wsum64(raw)),
        ("checksum zlib.crc32", KV_BYTES, lambda: zlib.crc32(raw)),
        ("checksum zlib.adler32", KV_BYTES, lambda: zlib.adler32(raw)),
        ("checksum blake2b-64", KV_BYTES,
         lambda: hashlib.blake2b(raw, digest_size=8).digest()),
    ]
    print(f"\nsingle-thread cost per 2k-token KV ({KV_BYTES / 1e6:.1f} MB bf16):")
    for label, num_bytes, fn in steps:
        s = time_best(fn)
        print(f"  {label:<30} {s * 1e3:8.1f} ms  {num_bytes / s / 1e9:6.2f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transports", default="inproc,zmq,ucx")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window", type=int, default=2, help="requests in flight per sender")
    p.add_argument("--modes", default=",".join(m.name for m in MODES),
                   help="comma-separated subset of: " + ", ".join(m.name for m in MODES))
    p.add_argument("--skip-steps", action="store_true")
    args = p.parse_args()
    by_name = {m.name: m for m in MODES}
    modes = [by_name[n.strip()] for n in args.modes.split(",")]
    # raw moves the same bytes for a mode and its transport-only twin: measured once
    raw_modes = list({raw_twin(m): None for m in modes})
    torch.set_num_threads(1)
    print(f"SmolLM2-135M KV for {NUM_TOKENS} tokens: {KV_BYTES / 1e6:.1f} MB bf16, "
          f"{Mode('fp8', True, False).wire_bytes(0, NUM_LAYERS) / 1e6:.1f} MB FP8 + scales; "
          f"{args.requests} requests, best of {args.repeats}")
    print("mode 'X': codec inside the timing (encode: FP8 quantize + checksum; decode: "
          "checksum + FP8 dequantize);\nmode 'X transport': pre-encoded payload, received and "
          "released only. raw: the same transport moving the same bytes buffer-to-buffer.")
    print(f"{'transport':<8} {'mode':<24} {'raw GB/s':>9} {'kv GB/s':>8} {'ratio':>6} "
          f"{'KV GB/s':>8} {'ms/request':>10}")
    for name in args.transports.split(","):
        if name == "ucx":
            from pdserve.kvtransfer.ucx_transport import ucx_unavailable_reason

            reason = ucx_unavailable_reason()
            if reason is not None:
                print(f"ucx      skipped: {reason}")
                continue
        if name == "inproc":
            raw = run_inproc("raw", raw_modes, args.requests, args.repeats)
            ours = run_inproc("kv", modes, args.requests, args.repeats)
        else:
            raw = run_two_processes(name, "raw", raw_modes, args.requests, args.repeats,
                                    args.window)
            ours = run_two_processes(name, "kv", modes, args.requests, args.repeats,
                                     args.window)
        for mode in modes:
            wire = sum(mode.wire_bytes(*r) for r in mode.layer_ranges()) * args.requests
            raw_gbs = wire / raw[raw_twin(mode).name] / 1e9
            kv_gbs = wire / ours[mode.name] / 1e9
            eff_gbs = KV_BYTES * args.requests / ours[mode.name] / 1e9
            print(f"{name:<8} {mode.name:<24} {raw_gbs:9.2f} {kv_gbs:8.2f} "
                  f"{kv_gbs / raw_gbs:6.0%} {eff_gbs:8.2f} "
                  f"{ours[mode.name] / args.requests * 1e3:10.1f}")
    if not args.skip_steps:
        print_steps()


if __name__ == "__main__":
    main()
