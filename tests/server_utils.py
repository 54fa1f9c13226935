"""Start and stop a real ``pdserve serve`` process for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def _port_block() -> range:
    """This test process's own block of ports, below the kernel's ephemeral range.

    A port taken with ``bind(0)`` comes from the ephemeral range, where any process's
    ``bind(0)`` (a worker's metrics server, a zmq random port) or outgoing connection can
    take it again before the test's server binds it: CI once saw an API server fail to
    bind while another test's server answered on its port. Ports below that range are
    handed out only by explicit choice, and each pytest-xdist worker takes its own block.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    start = 10000 if low > 12000 else 1024
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = max(64, (low - start) // 8)
    first = start + (index % 8) * size
    return range(first, min(first + size, low))


_PORTS = _port_block()
_next_port = [_PORTS.start + (os.getpid() * 7919) % len(_PORTS)]


def free_port() -> int:
    """A loopback TCP port that binds now and that no other test process hands out."""
    for _ in range(len(_PORTS)):
        port = _next_port[0]
        _next_port[0] = port + 1 if port + 1 < _PORTS.stop else _PORTS.start
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def worker_pids(server_pid: int, role: str) -> list[int]:
    """Live ``<role>-worker`` children of ``server_pid`` (one reaped between the listing and
    the read of its cmdline, e.g. a worker just killed, is not one)."""
    pids = []
    for pid in child_pids(server_pid):
        try:
            if f"{role}-worker".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue
    return pids


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_exit(pid: int, timeout_s: float) -> bool:
    """True once ``pid`` is gone (or a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def start_cli(*args: str, log_path: Path | None = None) -> subprocess.Popen:
    """``python -m pdserve.cli ARGS`` with unbuffered output (into ``log_path`` if given)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if log_path is None:
        return subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], env=env)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], env=env,
                                stdout=log, stderr=subprocess.STDOUT)


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_health(base: str, status: int, proc: subprocess.Popen, timeout_s: float) -> bool:
    """True once ``base``/health answers ``status``; False on timeout or if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == status:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def metrics(server) -> dict[str, float]:
    """Flat {name{labels}: value} of the server's /metrics."""
    text = httpx.get(f"{server.base}/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def wait_idle(server, timeout_s: float = 10.0) -> dict[str, float]:
    """Metrics once no request runs and no KV block is used, on the server and on every
    worker (or the last reading at ``timeout_s``).

    Worker gauges come from heartbeats (one a second), so a prefill worker's last report
    can show a prompt's blocks for up to a heartbeat after the decode side is idle; a leak
    stays nonzero past the timeout and fails the caller's assertion.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(server)
        idle = (m.get("pdserve:num_requests_running{}") == 0
                and m.get("pdserve:kv_cache_usage_perc{}") == 0
                and all(v == 0 for k, v in m.items()
                        if k.startswith(("pdserve:worker_kv_cache_usage_perc",
                                         "pdserve:worker_num_requests_running"))))
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


class ServerProcess:
    """``pdserve serve`` on a free loopback port; ``base_url`` ends in ``/v1``."""

    def __init__(self, *extra: str, colocated: bool = True,
                 startup_timeout_s: float = 240.0, log_path: Path | None = None) -> None:
        self.port = free_port()
        self.log_path = log_path  # None: the test run's own output
        self.base = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.base}/v1"
        self.proc = start_cli("serve", "--port", str(self.port), "--max-model-len", "2048",
                              "--num-kv-blocks", "512", *(["--colocated"] if colocated else []),
                              *extra, log_path=log_path)
        if wait_health(self.base, 200, self.proc, startup_timeout_s):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with {self.proc.returncode}")
        self.stop()
        raise RuntimeError("pdserve serve did not become healthy in time")

    def worker_pid(self) -> int:
        """Pid of the decode worker this ``pdserve serve`` launched (from /proc)."""
        pids = [pid for pid in child_pids(self.proc.pid)
                if b"decode-worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(pids) == 1, f"expected one decode-worker child, found {pids}"
        return pids[0]

    def stop(self, timeout_s: float = 30.0) -> int:
        return stop_process(self.proc, timeout_s)


def num_workers_up(server, role: str) -> int:
    """Alive workers of ``role`` according to the server's /metrics."""
    return sum(1 for key, value in metrics(server).items()
               if key.startswith("pdserve:worker_up{") and f"role={role}" in key and value == 1)


def wait_workers(server, role: str, count: int, timeout_s: float = 120.0) -> None:
    """Block until ``count`` workers of ``role`` are registered and alive."""
    deadline = time.monotonic() + timeout_s
    while num_workers_up(server, role) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} {role} workers came up")
        time.sleep(0.3)
