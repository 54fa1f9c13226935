"""KV transfer after a real prefill: from the prefill worker's last layer done to the blocks
written on the decode worker, vs the raw transport moving the same bytes (issue 22).

Two processes run what the workers run, over zmq or UCX on loopback:

  P  the SmolLM2-135M engine (default configuration) prefills a prompt (random token ids,
     --tokens) with its KV exported layer by layer: the engine's layer hook copies each
     layer's blocks as soon as the forward has written it (``LLMEngine.kv_layer_sink``)
     and the real KV sender thread quantizes it to FP8, checksums and pushes it, while the
     forward computes the next layers. ``t_last_layer`` is stamped in the hook of the last
     layer (after its block copy, ~0.1 ms).
  D  the real decode worker (``DecodeWorker``, its loop driven by hand, the test's zmq
     socket standing in for the router) reserves blocks for the prompt (ExpectRemoteKV)
     and gets the first token (FirstToken) at once; its real KV inbox verifies each
     message and dequantizes it straight into the reserved blocks, layer by layer, while
     P still computes the later layers; once all are in, the worker's poll installs the
     request (``complete_remote_prefill``, nothing left to write) and ``t_written`` is
     stamped. D's cache is touched once at start (a fresh worker's cache is calloc'ed:
     first writes fault its pages in). The real worker loop polls for the complete KV
     between engine steps, or every 50 ms when idle (IDLE_POLL_S); here it polls every
     0.2 ms.

exposed = t_written - t_last_layer is the transfer time the prefill did not hide. End to
end throughput = the request's FP8 wire bytes / exposed; raw = the same bytes as one buffer
per layer through the same transport, back to back, between two other processes
(``bench/kv_transfer.py``'s raw baseline), measured right after each prefill. Ratio =
e2e / raw = raw seconds / exposed seconds. Both processes share the 2 cores (P's forward
uses both): this is the contention the workers see on one machine.

    python bench/kv_transfer_prefill.py [--transports zmq,ucx] [--tokens 1536,2048,3072]
                                        [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import time
from pathlib import Path

import torch

from kv_transfer import Mode, ProcessPair, Shape, cpu_model

TIMEOUT_S = 120.0


def _engine():
    from pdserve.engine import LLM
    from pdserve.engine.loader import DEFAULT_MODEL

    return LLM(DEFAULT_MODEL, load_progress=False, max_model_len=4096).engine


def decode_main(name: str, conn) -> None:
    """D: the real decode worker's remote-prefill path, driven by hand: reserve
    (ExpectRemoteKV), the first token (FirstToken), then its loop's poll until installed."""
    import zmq

    from pdserve.decode_worker.kv_lifecycle import KVDeadlines
    from pdserve.decode_worker.worker import DecodeWorker
    from pdserve.engine import SamplingParams
    from pdserve.messages import ExpectRemoteKV, FirstToken

    engine = _engine()
    engine.runner.kv_cache.zero_()  # touch every page, as a worker that has run a while has
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # the router's end: takes what the worker reports
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = DecodeWorker(engine, f"tcp://127.0.0.1:{port}", "d-bench", "m",
                          kv_transport=name,  # the first token comes at once, not after
                          kv_deadlines=KVDeadlines(receiving_s=600.0))  # P's prefill
    stamps: dict[str, float] = {}
    write = worker.inbox.writer

    def timed_write(rid, decoded):
        written = write(rid, decoded)
        stamps["last_write"] = time.monotonic()
        return written

    worker.inbox.writer = timed_write
    conn.send(worker.inbox.address)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    while (command := conn.recv()) is not None:
        rid, prompt = command
        worker.handle(ExpectRemoteKV(rid, prompt, params, time.time()))
        worker.handle(FirstToken(rid, 1000))
        conn.send("reserved")
        deadline = time.monotonic() + TIMEOUT_S
        while rid in worker.remote and time.monotonic() < deadline:
            worker.poll_extra()
            time.sleep(0.0002)
        t_written = time.monotonic()
        assert rid in engine.requests, "the KV was not installed"
        worker.abort(rid)
        while router.poll(0):
            router.recv_multipart()
        conn.send((stamps["last_write"], t_written))
    worker.close()
    router.close(0)


def prefill_main(name: str, address: str, conn) -> None:
    """P: a real prefill streaming its KV layer by layer through the real sender thread."""
    from pdserve.engine import SamplingParams
    from pdserve.prefill_worker.kv_sender import KVJob, KVSenderThread

    engine = _engine()
    num_layers = engine.arch.num_layers
    reports: queue.Queue = queue.Queue()
    sender = KVSenderThread(name, True, TIMEOUT_S, lambda *a: reports.put(a))
    stamps: dict[int, float] = {}

    def sink(rid, layer, kv, scales, num_tokens):
        stamps[layer] = time.monotonic()
        sender.submit(KVJob(rid, kv, num_tokens, address, layer_start=layer,
                            num_layers=num_layers, scales=scales))

    engine.kv_layer_sink = sink
    params = SamplingParams(temperature=0.0, max_tokens=1)
    conn.send("ready")
    while (command := conn.recv()) is not None:
        rid, prompt = command
        stamps.clear()
        t0 = time.monotonic()
        engine.add_request(rid, prompt, params, export_kv=True)
        while engine.has_unfinished_requests:
            engine.step()
        _, num_bytes, seconds, error, push_s = reports.get(timeout=TIMEOUT_S)
        assert error is None, error
        conn.send({"t_start": t0, "t_first_layer": stamps[0],
                   "t_last_layer": stamps[num_layers - 1], "wire_bytes": num_bytes,
                   "sender_push_s": push_s, "sender_seconds": seconds})
    sender.close()


def measure(name: str, token_counts: list[int], repeats: int) -> list[dict]:
    """For each prompt length: the best of ``repeats`` prefills, each with its raw twin."""
    ctx = multiprocessing.get_context("spawn")
    d_conn, d_child = ctx.Pipe()
    p_conn, p_child = ctx.Pipe()
    d_proc = ctx.Process(target=decode_main, args=(name, d_child), daemon=True)
    d_proc.start()
    address = d_conn.recv()
    p_proc = ctx.Process(target=prefill_main, args=(name, address, p_child), daemon=True)
    p_proc.start()
    assert p_conn.recv() == "ready"
    rows = []
    try:
        for num_tokens in token_counts:
            raw_pair = ProcessPair(name, "raw", Shape(num_tokens=num_tokens), window=1)
            best: dict | None = None
            g = torch.Generator().manual_seed(num_tokens)
            for rep in range(repeats + 1):  # the first is warm-up
                prompt = torch.randint(100, 40000, (num_tokens,), generator=g).tolist()
                rid = f"r{num_tokens}-{rep}"
                d_conn.send((rid, prompt))
                assert d_conn.recv() == "reserved"
                p_conn.send((rid, prompt))
                p = p_conn.recv()
                t_last_write, t_written = d_conn.recv()
                raw: dict = {}
                raw_pair.run(Mode("fp8", True), 2, raw)
                row = {"transport": name, "tokens": num_tokens, **p, "t_written": t_written,
                       "prefill_s": p["t_last_layer"] - p["t_start"],
                       "exposed_s": t_written - p["t_last_layer"],
                       "last_layer_to_d_s": t_last_write - p["t_last_layer"],
                       "install_s": t_written - t_last_write,
                       "raw_s": raw["fp8"][0] / 2}
                row["ratio"] = row["raw_s"] / row["exposed_s"]
                if rep and (best is None or row["exposed_s"] < best["exposed_s"]):
                    best = row
            raw_pair.close()
            rows.append(best)
            b = best
            print(f"{name:<5} {num_tokens:>6} {b['prefill_s']:9.2f} {b['wire_bytes'] / 1e6:8.1f} "
                  f"{b['exposed_s'] * 1e3:10.1f} {b['raw_s'] * 1e3:8.1f} "
                  f"{b['wire_bytes'] / b['exposed_s'] / 1e9:8.2f} "
                  f"{b['wire_bytes'] / b['raw_s'] / 1e9:8.2f} {b['ratio']:6.2f} "
                  f"{b['sender_push_s'] * 1e3:9.1f} {b['last_layer_to_d_s'] * 1e3:9.1f} "
                  f"{b['install_s'] * 1e3:9.1f}")
    finally:
        for conn in (d_conn, p_conn):
            conn.send(None)
        for proc in (d_proc, p_proc):
            proc.join(20)
            if proc.is_alive():
                proc.kill()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transports", default="zmq,ucx")
    p.add_argument("--tokens", default="1536,2048,3072")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    print(f"SmolLM2-135M prefill -> FP8 KV -> decode engine's blocks; best of {args.repeats}; "
          f"{cpu_model()}")
    print(f"{'':<5} {'tokens':>6} {'prefill s':>9} {'wire MB':>8} {'exposed ms':>10} "
          f"{'raw ms':>8} {'e2e GB/s':>8} {'raw GB/s':>8} {'ratio':>6} {'push ms':>9} "
          f"{'to D ms':>9} {'install':>9}")
    rows = []
    for name in args.transports.split(","):
        if name == "ucx":
            from pdserve.kvtransfer.ucx_transport import ucx_unavailable_reason

            if (reason := ucx_unavailable_reason()) is not None:
                print(f"ucx skipped: {reason}")
                continue
        rows += measure(name, [int(t) for t in args.tokens.split(",")], args.repeats)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
