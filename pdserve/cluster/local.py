"""``pdserve local-cluster``: the compose topology as processes, one network namespace per
role, so KV really crosses a network interface (see :mod:`pdserve.cluster.netns`).

    api     pdserve server          --host A --port 8000 --router-address tcp://A:5557
    api1..  pdserve server          (more API servers with ``--num-api``, each its own router)
    p0..    pdserve prefill-worker  --router tcp://A:5557[,tcp://A1:5557...] --metrics-host P
                                    --metrics-port 9100
    d0..    pdserve decode-worker   --router (the same list) --kv-host auto (binds 0.0.0.0,
                                    advertises its eth0 address) --metrics-port 9100

Every worker registers with every API server's router (:mod:`pdserve.worker_links`).

Processes run detached (own session), log to ``STATE_DIR/NAME/*.log`` and are listed in
``state.json`` there; ``--down`` stops them, kills anything still inside the namespaces and
deletes the namespaces.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from pdserve.cluster.netns import (
    Host,
    create_topology,
    delete_topology,
    list_namespaces,
    namespace_pids,
    run_in_namespace,
)

#: Ports every role uses inside its own namespace.
API_PORT = 8000
ROUTER_PORT = 5557
METRICS_PORT = 9100
#: Seconds processes get after SIGTERM before SIGKILL.
STOP_GRACE_S = 15.0
#: First three octets of the cluster's /24 (private, only inside the namespaces).
DEFAULT_SUBNET = "10.77.0"


def state_dir(name: str) -> Path:
    """Where a cluster keeps its logs and ``state.json``."""
    root = os.environ.get("PDSERVE_CLUSTER_DIR") or Path(tempfile.gettempdir()) / "pdserve-cluster"
    return Path(root) / name


@dataclass
class ClusterState:
    """What ``--down`` needs: the namespaces and the pids of the role processes."""

    name: str
    hosts: list[Host]
    pids: dict[str, int] = field(default_factory=dict)  # namespace -> pid

    @property
    def api(self) -> Host:
        """The API server's namespace (always the first host)."""
        return self.hosts[0]

    @property
    def apis(self) -> list[Host]:
        """Every API server's namespace (``--num-api``), the first one first."""
        return [h for h in self.hosts if h.role == "api"]

    @property
    def base_url(self) -> str:
        """The API server's root URL, reachable from inside the namespaces."""
        return f"http://{self.api.address}:{API_PORT}"

    def metrics_urls(self) -> dict[str, str]:
        """namespace -> ``/metrics`` URL of the process in it."""
        return {h.namespace: f"http://{h.address}:{API_PORT if h.role == 'api' else METRICS_PORT}"
                             "/metrics"
                for h in self.hosts}

    def save(self) -> None:
        """Write ``state.json`` (after every started process, so ``--down`` finds it)."""
        path = state_dir(self.name) / "state.json"
        path.write_text(json.dumps({"name": self.name, "pids": self.pids,
                                    "hosts": [asdict(h) for h in self.hosts]}, indent=2))

    @classmethod
    def load(cls, name: str) -> ClusterState | None:
        """The saved state of cluster ``name``, or None when there is none."""
        path = state_dir(name) / "state.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(data["name"], [Host(**h) for h in data["hosts"]], data["pids"])


def plan_hosts(name: str, num_prefill: int, num_decode: int,
               subnet: str = DEFAULT_SUBNET, num_api: int = 1) -> list[Host]:
    """The api hosts first, then prefill and decode hosts, with their addresses.

    Raises:
        ValueError: counts out of range (1..9 api and decode, 0..9 prefill).
    """
    if not 0 <= num_prefill <= 9 or not 1 <= num_decode <= 9 or not 1 <= num_api <= 9:
        raise ValueError("--num-prefill must be in 0..9, --num-decode and --num-api in 1..9")
    hosts = [Host("api", f"{name}-api" + (str(i) if i else ""), f"{subnet}.{10 + i}")
             for i in range(num_api)]
    hosts += [Host("prefill", f"{name}-p{i}", f"{subnet}.{20 + i}") for i in range(num_prefill)]
    hosts += [Host("decode", f"{name}-d{i}", f"{subnet}.{30 + i}") for i in range(num_decode)]
    return hosts


def role_command(host: Host, apis: list[Host], model: str | None, engine_argv: list[str],
                 server_argv: list[str]) -> list[str]:
    """The ``pdserve`` invocation of ``host`` (without the ``ip netns exec`` prefix); a
    worker registers with the router of every host in ``apis``."""
    base = [sys.executable, "-m", "pdserve.cli"]
    model_arg = [model] if model else []
    if host.role == "api":
        return [*base, "server", *model_arg, "--host", host.address, "--port", str(API_PORT),
                "--router-address", f"tcp://{host.address}:{ROUTER_PORT}", *server_argv]
    routers = ",".join(f"tcp://{api.address}:{ROUTER_PORT}" for api in apis)
    kind = "prefill-worker" if host.role == "prefill" else "decode-worker"
    cmd = [*base, kind, *model_arg, "--router", routers, "--worker-id", host.namespace,
           "--metrics-host", host.address, "--metrics-port", str(METRICS_PORT), *engine_argv]
    if host.role == "decode":
        cmd += ["--kv-host", "auto"]
    return cmd


def cluster_secret_file(name: str) -> Path:
    """The cluster's secret (CURVE keys, :mod:`pdserve.security`), made once, mode 0600."""
    path = state_dir(name) / "cluster-secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    return path


def _start(state: ClusterState, host: Host, cmd: list[str]) -> None:
    log = open(state_dir(state.name) / f"{host.namespace}.log", "wb")
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PDSERVE_CLUSTER_SECRET_FILE=str(cluster_secret_file(state.name)))
    proc = subprocess.Popen(["ip", "netns", "exec", host.namespace, *cmd], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    log.close()
    state.pids[host.namespace] = proc.pid
    state.save()


def _num_workers_up(api: Host) -> int:
    text = httpx.get(f"http://{api.address}:{API_PORT}/metrics", timeout=5).text
    return sum(1 for line in text.splitlines()
               if line.startswith("pdserve:worker_up{") and line.endswith(" 1.0"))


def wait_ready(state: ClusterState, timeout_s: float) -> None:
    """Block until every worker is registered with every API server and serves
    ``/metrics``.

    Raises:
        RuntimeError: a role process exited, or ``timeout_s`` passed.
    """
    num_workers = len(state.hosts) - len(state.apis)
    deadline = time.monotonic() + timeout_s

    def probe() -> bool:
        try:
            if any(_num_workers_up(api) < num_workers for api in state.apis):
                return False
            return all(httpx.get(url, timeout=5).status_code == 200
                       for url in state.metrics_urls().values())
        except httpx.HTTPError:
            return False

    while not run_in_namespace(state.api.namespace, probe):
        dead = [ns for ns, pid in state.pids.items() if not _pid_alive(pid)]
        if dead:
            raise RuntimeError(f"processes in {dead} exited; see {state_dir(state.name)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"cluster {state.name} not ready within {timeout_s:.0f} s; "
                               f"see {state_dir(state.name)}")
        time.sleep(0.5)


def up(name: str, num_prefill: int, num_decode: int, model: str | None,
       engine_argv: list[str], server_argv: list[str], timeout_s: float = 600.0,
       subnet: str = DEFAULT_SUBNET, num_api: int = 1) -> ClusterState:
    """Create the namespaces, start every role, wait until ready.

    On any failure everything created so far is torn down before the error propagates.

    Raises:
        ValueError: bad counts, or a cluster of that name already exists.
        RuntimeError: namespace setup failed or the cluster did not become ready.
    """
    hosts = plan_hosts(name, num_prefill, num_decode, subnet, num_api)
    taken = set(list_namespaces()) & {h.namespace for h in hosts}
    if taken:
        raise ValueError(f"namespaces {sorted(taken)} exist; run --down --name {name} first")
    state_dir(name).mkdir(parents=True, exist_ok=True)
    state = ClusterState(name, hosts)
    state.save()
    try:
        create_topology(name, hosts)
        for host in hosts:
            _start(state, host, role_command(host, state.apis, model, engine_argv, server_argv))
        wait_ready(state, timeout_s)
    except BaseException:
        down(name)
        raise
    return state


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def down(name: str) -> list[str]:
    """Stop the cluster's processes (SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`),
    kill whatever still runs inside its namespaces, delete the namespaces. Idempotent.

    Returns:
        The namespaces that were deleted.
    """
    state = ClusterState.load(name)
    prefix = f"{name}-"
    namespaces = [ns for ns in list_namespaces() if ns.startswith(prefix)]
    pids = list(state.pids.values()) if state else []
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)
    for ns in namespaces:
        for pid in namespace_pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for pid in pids:  # reap our own children (when `up` and `down` share a process)
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    delete_topology(name, [ns for ns in namespaces if ns != f"{name}-hub"])
    state_file = state_dir(name) / "state.json"
    state_file.unlink(missing_ok=True)
    return namespaces
