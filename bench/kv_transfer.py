"""KV transfer throughput, end to end and per stage, vs the raw transport moving the same bytes.

A prompt's KV (default: SmolLM2-135M, 30 layers x K/V x 3 KV heads x 64, 16-token blocks;
--tokens sets the prompt length, --shape L,H,D a larger synthetic model) goes from a
sender process to a receiver process, one message per layer (what the prefill worker
sends: each layer leaves once the forward has written it), in these modes:

  fp8 e2e   what the workers do, from P's paged cache to D's: sender: gather the request's
            blocks of one layer out of a paged cache (index_select, the prefill worker's
            layer hook), FP8 quantize with scales, checksum + header (encode_kv), send;
            receiver: receive into a staging buffer, verify (checksum, views), copy the
            codes and scales into the request's tensors (the decode worker's KV inbox),
            dequantize them straight into D's paged cache at its own block ids (the
            engine's write at install: pdserve.fp8.dequantize_into_cache, one pass).
  fp8 e2e before  the same pipeline as it was before the C kernels: torch quantize,
            dequantize into a new tensor, copied into the request's, scattered.
  fp8 e2e fused  also the gather fused into the quantize pass
            (pdserve.fp8.quantize_cache_blocks), and the dequantize+scatter straight
            from the staging buffer (no codes copy): one pass over the KV on each side.
  bf16 e2e  the exact wire (--kv-transfer-dtype auto): gather, checksum, send | receive,
            verify, scatter.
  fp8 transport  the same FP8 messages encoded once before the clock; the receiver only
            receives and releases (the transport's own overhead: framing, staging).
  raw       the same transport moving the same number of bytes per message as plain
            buffers, with the same window: zmq: one PUSH frame (copy=False, tracked) ->
            PULL recv_into one of two reused buffers; ucx: one tagged send on the same
            kind of ucxx endpoint and progress loop -> a tagged receive posted one
            message ahead; inproc: the same two copies. Measured right before each
            repeat of each mode (a second process pair), so both see the same load.

Throughput is measured at the receiver after warm-up over --requests requests, up to
--window requests in flight. GB/s counts wire bytes (FP8: codes + scales); "KV GB/s" the
bf16 KV that arrived. ratio = e2e / raw. Each stage's time is summed per process and shown
per request (the receiver's "receive" is its wait for the next message; the sender's
"send" its time to post a send plus waiting for the window). Also prints the single-thread
cost of each codec step (torch reference vs the C kernels). On a 2-core machine shared with
other work, each figure is the best of --repeats runs (the ratio: best e2e / best raw).

    python bench/kv_transfer.py [--transports inproc,zmq,ucx] [--tokens 2048]
        [--shape 30,3,64] [--requests 8] [--repeats 5] [--modes 'fp8 e2e,...'] [--json F]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import platform
import time
import zlib
from collections import defaultdict, deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

TIMEOUT_S = 60.0
NUM_WARMUP = 2
RAW_TAG = 0x5241_5700
CACHE_SPARE_BLOCKS = 64  # paged caches hold this many blocks beyond the request's


@dataclass(frozen=True)
class Shape:
    """The KV of one prompt: [num_layers, 2, num_blocks, block_size, H, D] bf16."""

    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    num_tokens: int = 2048
    block_size: int = 16

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return (1, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def cache_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks + CACHE_SPARE_BLOCKS, self.block_size,
                self.num_kv_heads, self.head_dim)

    @property
    def kv_bytes(self) -> int:
        return self.num_layers * int(np.prod(self.layer_shape)) * 2

    def layer_wire_bytes(self, use_fp8: bool) -> int:
        n = int(np.prod(self.layer_shape))
        return n + 2 * self.num_blocks * self.num_kv_heads * 4 if use_fp8 else 2 * n


@dataclass(frozen=True)
class Mode:
    """What one timed run moves (see the module docstring)."""

    name: str
    use_fp8: bool
    has_codec: bool = True  # False: pre-encoded messages, receive + release only
    is_fused: bool = False  # gather+quantize and dequantize+scatter in one pass each
    is_before: bool = False  # the torch codec and the receive path before the C kernels


MODES = [Mode("fp8 e2e before", True, is_before=True), Mode("fp8 e2e", True),
         Mode("fp8 e2e fused", True, is_fused=True),
         Mode("fp8 transport", True, has_codec=False), Mode("bf16 e2e", False),
         Mode("bf16 transport", False, has_codec=False)]


def raw_twin(mode: Mode) -> Mode:
    """The raw run moving the same bytes per message."""
    return Mode("fp8" if mode.use_fp8 else "bf16", mode.use_fp8)


def make_cache(shape: Shape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache holding the request's KV in shuffled blocks, and those block ids."""
    from pdserve.host_memory import empty_host

    torch.manual_seed(seed)
    cache = empty_host(shape.cache_shape, torch.bfloat16)
    cache.copy_(torch.randn(shape.cache_shape))
    ids = torch.randperm(shape.cache_shape[2])[: shape.num_blocks]
    return cache, ids


class Stages:
    """Seconds per stage, summed over the timed requests."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._t = time.perf_counter()

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] += now - self._t
        self._t = now


# --- receiving side ---------------------------------------------------------------------

def receive_kv(receiver, shape: Shape, mode: Mode, num_requests: int,
               num_warmup: int = NUM_WARMUP, state: dict | None = None) -> tuple[float, dict]:
    """recv, verify, dequantize and scatter each layer into D's paged cache; returns the
    seconds after warm-up and the per-stage seconds."""
    from pdserve.fp8 import dequantize_blocks, dequantize_into_cache

    state = {} if state is None else state
    if "cache" not in state:
        state["cache"], state["ids"] = make_cache(shape, seed=1)
        full = (shape.num_layers, *shape.layer_shape[1:])
        state["kv"] = torch.empty(full, dtype=torch.bfloat16)
        state["codes"] = torch.empty(full, dtype=torch.float8_e4m3fn)
        state["scales"] = torch.empty(full[:3] + full[4:5], dtype=torch.float32)
    cache, ids, req_kv = state["cache"], state["ids"], state["kv"]
    stages = Stages()
    t0 = time.perf_counter()
    for i in range((num_warmup + num_requests) * shape.num_layers):
        if i == num_warmup * shape.num_layers:
            t0 = time.perf_counter()
            stages = Stages()
        stages.start()
        msg = receiver.recv(timeout_s=TIMEOUT_S)
        stages.lap("receive (wait)")
        if mode.has_codec:
            kv = msg.decode()
            stages.lap("verify checksum")
            h = kv.header
            if mode.is_fused and kv.is_fp8:
                dequantize_into_cache(kv.values, kv.scales, cache, ids, h.layer_start)
                stages.lap("dequantize+scatter (fused)")
            elif mode.is_before:  # dequantized to a new tensor, copied, then scattered
                layers = slice(h.layer_start, h.layer_end)
                req_kv[layers] = dequantize_blocks(kv.values, kv.scales, torch.bfloat16,
                                                   use_kernels=False)
                stages.lap("dequantize (torch) + copy")
                cache[layers].index_copy_(2, ids, req_kv[layers])
                stages.lap("scatter into blocks")
            elif kv.is_fp8:  # the inbox keeps codes; the engine dequantizes as it scatters
                layers = slice(h.layer_start, h.layer_end)
                state["codes"][layers].copy_(kv.values)
                state["scales"][layers].copy_(kv.scales)
                stages.lap("copy codes out")
                dequantize_into_cache(state["codes"][layers], state["scales"][layers], cache,
                                      ids, h.layer_start)
                stages.lap("dequantize+scatter")
            else:
                layers = slice(h.layer_start, h.layer_end)
                req_kv[layers].copy_(kv.values)
                stages.lap("copy out")
                cache[layers].index_copy_(2, ids, req_kv[layers])
                stages.lap("scatter into blocks")
        msg.release()
    return time.perf_counter() - t0, dict(stages.seconds)


def receive_raw(post_recv, shape: Shape, mode: Mode, num_requests: int) -> float:
    """Plain receives, each posted one message ahead into the other of two buffers."""
    size = shape.layer_wire_bytes(mode.use_fp8)
    bufs = [np.zeros(size, dtype=np.uint8) for _ in range(2)]
    pending: deque = deque()
    t0 = 0.0
    for i in range(NUM_WARMUP + num_requests):
        for _ in range(shape.num_layers):
            pending.append(post_recv(memoryview(bufs[len(pending) % 2])))
            if len(pending) == 2:
                pending.popleft().wait()
        if i == NUM_WARMUP - 1:
            while pending:
                pending.popleft().wait()
            t0 = time.perf_counter()
    while pending:
        pending.popleft().wait()
    return time.perf_counter() - t0


# --- sending side -----------------------------------------------------------------------

def encode_layer(shape: Shape, mode: Mode, cache: torch.Tensor, ids: torch.Tensor,
                 layer: int, stages: Stages):
    """One layer's message, as the prefill worker makes it, timing each stage."""
    from pdserve.fp8 import quantize_blocks, quantize_cache_blocks
    from pdserve.kvtransfer.wire import encode_kv

    if mode.is_fused:
        codes, scales = quantize_cache_blocks(cache, ids, layer, layer + 1)
        stages.lap("gather+quantize (fused)")
    else:
        kv = cache[layer:layer + 1].index_select(2, ids)  # the layer hook's read_kv_blocks
        stages.lap("gather blocks")
        if not mode.use_fp8:
            enc = encode_kv("req", kv, layer_start=layer, num_tokens=shape.num_tokens,
                            use_fp8=False)
            stages.lap("checksum+header")
            return enc
        codes, scales = quantize_blocks(kv, use_kernels=not mode.is_before)
        stages.lap("FP8 quantize")
    enc = encode_kv("req", codes, layer_start=layer, num_tokens=shape.num_tokens,
                    use_fp8=True, scales=scales)
    stages.lap("checksum+header")
    return enc


def send_kv(sender, shape: Shape, mode: Mode, num_requests: int, window: int,
            state: dict) -> dict:
    """Encode + send_nowait each layer, at most ``window`` requests in flight; returns the
    per-stage seconds of the last ``num_requests - NUM_WARMUP`` requests (all for inproc)."""
    if "cache" not in state:
        state["cache"], state["ids"] = make_cache(shape, seed=0)
    cache, ids = state["cache"], state["ids"]
    if not mode.has_codec and mode.name not in state:  # encoded once, before the clock
        state[mode.name] = [encode_layer(shape, Mode("", mode.use_fp8), cache, ids, layer,
                                         Stages()) for layer in range(shape.num_layers)]
    in_flight: deque = deque()  # (handle, message): the message keeps its buffers alive
    stages = Stages()
    for r in range(num_requests):
        if r == min(NUM_WARMUP, num_requests - 1):
            stages = Stages()
        for layer in range(shape.num_layers):
            stages.start()
            msg = (encode_layer(shape, mode, cache, ids, layer, stages) if mode.has_codec
                   else state[mode.name][layer])
            in_flight.append((sender.send_nowait(msg.header, msg.buffers, timeout_s=TIMEOUT_S),
                              msg))
            while len(in_flight) > window * shape.num_layers:
                in_flight.popleft()[0].wait(timeout_s=TIMEOUT_S)
            stages.lap("send (post + window)")
    for handle, _ in in_flight:
        handle.wait(timeout_s=TIMEOUT_S)
    return dict(stages.seconds)


def send_raw(post_send, shape: Shape, mode: Mode, num_requests: int, window: int) -> None:
    """Plain sends of one buffer per layer, with the same in-flight window as send_kv."""
    size = shape.layer_wire_bytes(mode.use_fp8)
    buf = np.ones(size, dtype=np.uint8)
    in_flight: deque = deque()
    for _ in range(num_requests):
        for _ in range(shape.num_layers):
            in_flight.append(post_send(memoryview(buf)))
            while len(in_flight) > window * shape.num_layers:
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


class _TrackerWait:
    def __init__(self, tracker) -> None:
        self._tracker = tracker

    def wait(self) -> None:
        self._tracker.wait(TIMEOUT_S)


def raw_endpoint(name: str, transport, side: str, address: str | None = None):
    """(address, post_recv) for the receiving side, post_send for the sending side."""
    import zmq

    if name == "zmq":
        sock = zmq.Context.instance().socket(zmq.PULL if side == "rx" else zmq.PUSH)
        sock.setsockopt(zmq.RCVHWM if side == "rx" else zmq.SNDHWM, 12)
        if side == "rx":
            sock.bind("tcp://127.0.0.1:*")

            def post_recv(view):  # zmq's I/O thread receives ahead by itself
                sock.recv_into(view)
                return _Done()
            return sock.getsockopt_string(zmq.LAST_ENDPOINT), post_recv
        sock.connect(address)
        return lambda view: _TrackerWait(sock.send(view, copy=False, track=True))
    from pdserve.kvtransfer.transport import KVReceiverConfig

    if side == "rx":
        receiver = transport.create_receiver(KVReceiverConfig(max_message_bytes=1))
        return receiver.address, lambda view: _FutureWait(
            transport.submit(transport.ctx.recv(view, tag=RAW_TAG)))
    sender = transport.create_sender(address, timeout_s=TIMEOUT_S)
    return lambda view: _FutureWait(transport.submit(
        sender.endpoint.send(view, tag=RAW_TAG, force_tag=True)))


# --- processes --------------------------------------------------------------------------

def receiver_main(name: str, kind: str, shape: Shape, conn) -> None:
    """Receives KV messages (kind "kv") or raw buffers ("raw") on command."""
    torch.set_num_threads(1)
    from pdserve.kvtransfer.transport import KVReceiverConfig, create_transport

    transport = create_transport(name)
    if kind == "kv":
        rx = transport.create_receiver(KVReceiverConfig(
            max_message_bytes=shape.layer_wire_bytes(False)))
        address = rx.address
    else:
        address, raw_recv = raw_endpoint(name, transport, "rx")
    conn.send(address)
    state: dict = {}
    while (command := conn.recv()) is not None:
        mode, num_requests = command
        if kind == "kv":
            conn.send(receive_kv(rx, shape, mode, num_requests, state=state))
        else:
            conn.send((receive_raw(raw_recv, shape, mode, num_requests), {}))
    transport.close()


def sender_main(name: str, kind: str, shape: Shape, address: str, window: int,
                conn) -> None:
    """Sends KV messages (kind "kv") or raw buffers ("raw") on command."""
    torch.set_num_threads(1)
    from pdserve.kvtransfer.transport import create_transport

    transport = create_transport(name)
    if kind == "kv":
        sender = transport.create_sender(address, timeout_s=TIMEOUT_S)
    else:
        raw_send = raw_endpoint(name, transport, "tx", address)
    conn.send("connected")
    state: dict = {}
    while (command := conn.recv()) is not None:
        mode, num_requests = command
        if kind == "kv":
            conn.send(send_kv(sender, shape, mode, NUM_WARMUP + num_requests, window, state))
        else:
            send_raw(raw_send, shape, mode, NUM_WARMUP + num_requests, window)
            conn.send({})
    transport.close()


class ProcessPair:
    """A receiver and a sender process of one kind ("kv" or "raw") over one transport."""

    def __init__(self, name: str, kind: str, shape: Shape, window: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.rx_conn, rx_child = ctx.Pipe()
        self.tx_conn, tx_child = ctx.Pipe()
        self.procs = [ctx.Process(target=receiver_main, args=(name, kind, shape, rx_child),
                                  daemon=True)]
        self.procs[0].start()
        address = self.rx_conn.recv()
        self.procs.append(ctx.Process(target=sender_main,
                                      args=(name, kind, shape, address, window, tx_child),
                                      daemon=True))
        self.procs[1].start()
        assert self.tx_conn.recv() == "connected"

    def run(self, mode: Mode, num_requests: int, best: dict) -> None:
        """One timed run; keeps the fastest per mode in ``best``."""
        self.rx_conn.send((mode, num_requests))
        self.tx_conn.send((mode, num_requests))
        elapsed, rx_stages = self.rx_conn.recv()
        tx_stages = self.tx_conn.recv()
        if elapsed < best.get(mode.name, (float("inf"),))[0]:
            best[mode.name] = (elapsed, rx_stages, tx_stages)

    def close(self) -> None:
        for conn in (self.rx_conn, self.tx_conn):
            conn.send(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def run_two_processes(name: str, shape: Shape, modes: list[Mode], num_requests: int,
                      repeats: int, window: int) -> tuple[dict, dict]:
    """Each repeat runs a mode right after its raw twin (two process pairs, alive
    together; the idle pair waits on its pipe), so both see the same background load;
    returns ({raw name: best}, {mode name: best}), best = (seconds, receiver stages,
    sender stages) of the fastest repeat."""
    raw_pair = ProcessPair(name, "raw", shape, window)
    kv_pair = ProcessPair(name, "kv", shape, window)
    raw: dict = {}
    ours: dict = {}
    try:
        for _ in range(repeats):
            for mode in modes:
                raw_pair.run(raw_twin(mode), num_requests, raw)
                kv_pair.run(mode, num_requests, ours)
    finally:
        raw_pair.close()
        kv_pair.close()
    return raw, ours


def run_inproc(kind: str, shape: Shape, modes: list[Mode], num_requests: int,
               repeats: int) -> dict:
    """One request in flight at a time, sender and receiver on this thread."""
    from pdserve.kvtransfer.transport import KVReceiverConfig, create_transport

    transport = create_transport("inproc")
    rx = transport.create_receiver(KVReceiverConfig(
        max_message_bytes=shape.layer_wire_bytes(False)))
    sender = transport.create_sender(rx.address, timeout_s=TIMEOUT_S)
    tx_state: dict = {}
    rx_state: dict = {}
    best: dict = {}
    for mode in modes:
        size = shape.layer_wire_bytes(mode.use_fp8)
        src, dst = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
        for rep in range(repeats + 1):  # the first is warm-up
            t = time.perf_counter()
            tx_total: dict = defaultdict(float)
            rx_total: dict = defaultdict(float)
            for _ in range(num_requests):
                if kind == "raw":
                    for _ in range(shape.num_layers):
                        dst[:] = np.frombuffer(bytes(memoryview(src)), np.uint8)
                    continue
                for k, v in send_kv(sender, shape, mode, 1, 1, tx_state).items():
                    tx_total[k] += v
                for k, v in receive_kv(rx, shape, mode, 1, 0, rx_state)[1].items():
                    rx_total[k] += v
            elapsed = time.perf_counter() - t
            if rep and elapsed < best.get(mode.name, (float("inf"),))[0]:
                best[mode.name] = (elapsed, dict(rx_total), dict(tx_total))
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


def step_costs(shape: Shape) -> list[dict]:
    """Single-thread seconds of each codec step over the whole prompt's KV."""
    from pdserve.fp8 import (dequantize_blocks, dequantize_into_cache, quantize_blocks,
                             quantize_cache_blocks)
    from pdserve.kvtransfer.checksum import wsum64

    cache, ids = make_cache(shape, seed=0)
    layers = shape.num_layers
    kv = cache.index_select(2, ids)
    payload, scales = quantize_blocks(kv)
    out = torch.empty_like(kv)
    raw = kv.view(torch.uint8).reshape(-1).numpy()
    dst = np.empty_like(raw)
    steps = [
        ("memcpy (reference)", lambda: np.copyto(dst, raw)),
        ("gather blocks (index_select)", lambda: cache.index_select(2, ids)),
        ("scatter blocks (index_copy_)", lambda: cache.index_copy_(2, ids, kv)),
        ("FP8 quantize, torch reference", lambda: quantize_blocks(kv, use_kernels=False)),
        ("FP8 quantize, C kernel", lambda: quantize_blocks(kv)),
        ("gather+quantize fused, C kernel", lambda: quantize_cache_blocks(cache, ids, 0, layers)),
        ("FP8 dequantize, torch reference",
         lambda: dequantize_blocks(payload, scales, torch.bfloat16, out=out, use_kernels=False)),
        ("FP8 dequantize, C kernel",
         lambda: dequantize_blocks(payload, scales, torch.bfloat16, out=out)),
        ("dequantize+scatter fused, C kernel",
         lambda: dequantize_into_cache(payload, scales, cache, ids, 0)),
        ("checksum wsum64 (FP8 payload)", lambda: wsum64(payload.view(torch.uint8).numpy())),
        ("checksum zlib.crc32 (bf16)", lambda: zlib.crc32(raw)),
        ("checksum blake2b-64 (bf16)", lambda: hashlib.blake2b(raw, digest_size=8).digest()),
    ]
    rows = []
    for label, fn in steps:
        s = time_best(fn)
        rows.append({"step": label, "ms": s * 1e3, "bf16_kv_gb_per_s": shape.kv_bytes / s / 1e9})
    return rows


def report(name: str, shape: Shape, modes: list[Mode], raw: dict, ours: dict,
           num_requests: int) -> list[dict]:
    """Print one transport's rows (and their stage breakdown); return them for the JSON."""
    rows = []
    for mode in modes:
        wire = shape.layer_wire_bytes(mode.use_fp8) * shape.num_layers * num_requests
        raw_s = raw[raw_twin(mode).name][0]
        elapsed, rx_stages, tx_stages = ours[mode.name]
        raw_gbs, kv_gbs = wire / raw_s / 1e9, wire / elapsed / 1e9
        row = {"transport": name, "mode": mode.name, "raw_gb_per_s": raw_gbs,
               "gb_per_s": kv_gbs, "ratio": kv_gbs / raw_gbs,
               "bf16_kv_gb_per_s": shape.kv_bytes * num_requests / elapsed / 1e9,
               "ms_per_request": elapsed / num_requests * 1e3,
               "raw_ms_per_request": raw_s / num_requests * 1e3,
               "sender_ms_per_request": {k: v / num_requests * 1e3 for k, v in tx_stages.items()},
               "receiver_ms_per_request": {k: v / num_requests * 1e3
                                           for k, v in rx_stages.items()}}
        rows.append(row)
        print(f"{name:<7} {mode.name:<15} {raw_gbs:8.2f} {kv_gbs:8.2f} {row['ratio']:6.0%} "
              f"{row['bf16_kv_gb_per_s']:8.2f} {row['ms_per_request']:8.1f} "
              f"{row['raw_ms_per_request']:8.1f}")
        for side in ("sender", "receiver"):
            stages = row[f"{side}_ms_per_request"]
            if stages:
                print(f"{'':<24}{side}: " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    return rows


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transports", default="inproc,zmq,ucx")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--shape", default="30,3,64", help="num_layers,num_kv_heads,head_dim")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--window", type=int, default=2, help="requests in flight per sender")
    p.add_argument("--modes", default=",".join(m.name for m in MODES),
                   help="comma-separated subset of: " + ", ".join(m.name for m in MODES))
    p.add_argument("--skip-steps", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    num_layers, heads, dim = (int(x) for x in args.shape.split(","))
    shape = Shape(num_layers, heads, dim, args.tokens)
    by_name = {m.name: m for m in MODES}
    modes = [by_name[n.strip()] for n in args.modes.split(",")]
    raw_modes = list({raw_twin(m): None for m in modes})
    torch.set_num_threads(1)
    print(f"KV of {shape.num_tokens} tokens, {shape}: {shape.kv_bytes / 1e6:.1f} MB bf16, "
          f"{shape.layer_wire_bytes(True) * num_layers / 1e6:.1f} MB FP8 + scales, one "
          f"message per layer; {args.requests} requests, window {args.window}, best of "
          f"{args.repeats}; {cpu_model()}")
    print(f"{'':<7} {'mode':<15} {'raw GB/s':>8} {'GB/s':>8} {'ratio':>6} {'KV GB/s':>8} "
          f"{'ms/req':>8} {'raw ms':>8}")
    results = {"cpu": cpu_model(), "shape": asdict(shape), "requests": args.requests,
               "window": args.window, "repeats": args.repeats, "rows": [], "skipped": {}}
    for name in args.transports.split(","):
        if name == "ucx":
            from pdserve.kvtransfer.ucx_transport import ucx_unavailable_reason

            if (reason := ucx_unavailable_reason()) is not None:
                print(f"ucx     skipped: {reason}")
                results["skipped"]["ucx"] = reason
                continue
        if name == "inproc":
            raw = run_inproc("raw", shape, raw_modes, args.requests, args.repeats)
            ours = run_inproc("kv", shape, modes, args.requests, args.repeats)
        else:
            raw, ours = run_two_processes(name, shape, modes, args.requests, args.repeats,
                                          args.window)
        results["rows"] += report(name, shape, modes, raw, ours, args.requests)
    if not args.skip_steps:
        results["steps"] = step_costs(shape)
        print(f"\nsingle-thread cost over the prompt's KV ({shape.kv_bytes / 1e6:.1f} MB bf16):")
        for row in results["steps"]:
            print(f"  {row['step']:<36} {row['ms']:8.1f} ms  {row['bf16_kv_gb_per_s']:6.2f} "
                  "GB/s of bf16 KV")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
