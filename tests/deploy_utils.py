"""A disaggregated topology from separate ``pdserve server | prefill-worker | decode-worker``
processes on loopback, each worker serving its own ``/metrics`` (as compose runs them)."""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server_utils import free_port, start_cli, stop_process, wait_health, wait_workers

#: Small engine settings: quick start-up and little memory on shared CI cores.
SMALL_ENGINE = ["--max-model-len", "1024", "--num-kv-blocks", "128"]
METRIC_NAME = re.compile(r"pdserve:[A-Za-z0-9_:]+")


def scrape(url: str) -> dict[str, float]:
    """``{sample name{sorted labels}: value}`` of one ``/metrics`` endpoint."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def sample_names(samples: dict[str, float]) -> set[str]:
    """The sample names (``pdserve:x_total``, ``..._bucket``) without labels."""
    return {key.split("{", 1)[0] for key in samples}


def total(samples: dict[str, float], name: str) -> float:
    """Sum of every series of sample ``name``."""
    return sum(v for k, v in samples.items() if k.split("{", 1)[0] == name)


class SplitCluster:
    """API server + one prefill and one decode worker, all on 127.0.0.1.

    Args:
        prefill_threshold: prompts with at least this many tokens are prefilled remotely.
    """

    def __init__(self, prefill_threshold: int = 64, startup_timeout_s: float = 300.0) -> None:
        self.port, router_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.base}/v1"
        router = f"tcp://127.0.0.1:{router_port}"
        self.metrics_ports = {"prefill": free_port(), "decode": free_port()}
        self.procs = [start_cli("server", "--port", str(self.port), "--router-address", router,
                                "--max-model-len", "1024",
                                "--prefill-threshold", str(prefill_threshold))]
        try:
            for role, port in self.metrics_ports.items():
                self.procs.append(start_cli(f"{role}-worker", "--router", router,
                                            "--worker-id", f"{role}-0", "--metrics-port",
                                            str(port), *SMALL_ENGINE))
            if not wait_health(self.base, 200, self.procs[0], startup_timeout_s):
                raise RuntimeError("pdserve server did not become healthy")
            for role in self.metrics_ports:
                wait_workers(self, role, 1, startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def metrics_urls(self) -> dict[str, str]:
        """role -> ``/metrics`` URL (``api`` for the server)."""
        urls = {"api": f"{self.base}/metrics"}
        urls.update({role: f"http://127.0.0.1:{port}/metrics"
                     for role, port in self.metrics_ports.items()})
        return urls

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc)
