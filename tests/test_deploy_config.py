"""Deployment files, checked without Docker or Kubernetes: the compose file against the
official Compose-specification schema (vendored by check-jsonschema), every pdserve command
in compose and the Kubernetes manifests against the CLI's own parser, and the Grafana
dashboard's structure."""

from __future__ import annotations

import http.server
import importlib.resources
import json
import re
import shutil
import subprocess
import threading
from pathlib import Path

import jsonschema
import pytest
import yaml

from pdserve.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PDSERVE_SERVICES = {"api": "server", "prefill": "prefill-worker", "decode": "decode-worker"}
#: ${VAR}, ${VAR:-default}, ${VAR-default}
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def compose_schema() -> dict:
    ref = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(ref.joinpath("compose-spec.json").read_text())


def interpolate_defaults(node):
    """Compose interpolation with an empty environment, on parsed values as Compose does it
    (strings stay strings): every variable takes its default."""
    if isinstance(node, dict):
        return {k: interpolate_defaults(v) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate_defaults(v) for v in node]
    if isinstance(node, str):
        return INTERPOLATION.sub(lambda m: m.group(2) or "", node)
    return node


def load_compose(interpolated: bool) -> dict:
    doc = yaml.safe_load(COMPOSE.read_text())
    return interpolate_defaults(doc) if interpolated else doc


def parse_pdserve(argv: list[str]):
    """Parse ``pdserve ARGS`` with the real parser; fails the test on unknown flags or bad
    values (argparse exits)."""
    assert argv[0] == "pdserve", argv
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"not a valid pdserve invocation: {' '.join(argv)}")


def flag_for_variable(name: str) -> str:
    """PDSERVE_PREFILL_THRESHOLD -> --prefill-threshold."""
    return "--" + name.removeprefix("PDSERVE_").lower().replace("_", "-")


@pytest.mark.parametrize("interpolated", [False, True], ids=["raw", "defaults"])
def test_compose_file_passes_the_compose_spec_schema(interpolated):
    jsonschema.validate(load_compose(interpolated), compose_schema())


def test_compose_schema_rejects_a_broken_service():
    """The schema really constrains services (a guard against validating nothing)."""
    doc = load_compose(interpolated=True)
    doc["services"]["api"]["healthcheck"]["interval"] = ["not", "a", "duration"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, compose_schema())


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker is not installed")
def test_docker_compose_config_accepts_the_file():
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("docker has no compose plugin here")
    proc = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("service,subcommand", sorted(PDSERVE_SERVICES.items()))
def test_compose_service_command_is_a_real_pdserve_invocation(service, subcommand):
    args = parse_pdserve(load_compose(interpolated=True)["services"][service]["command"])
    assert args.command == subcommand
    if subcommand != "server":
        assert args.router == "tcp://api:5557"  # the router, by service name
        assert args.metrics_port == 9100 and args.metrics_host == "0.0.0.0"


def test_compose_variables_mirror_the_flags_they_set_and_are_in_env_example():
    """Each ``--flag ${PDSERVE_FLAG...}`` pair uses the flag's own name, and .env.example
    lists every variable the compose file reads."""
    doc = load_compose(interpolated=False)
    used = set(INTERPOLATION.findall(COMPOSE.read_text()))
    for service in PDSERVE_SERVICES:
        cmd = doc["services"][service]["command"]
        for flag, value in zip(cmd, cmd[1:]):
            m = INTERPOLATION.fullmatch(str(value))
            if flag.startswith("--") and m:
                assert flag == flag_for_variable(m.group(1)), (service, flag, value)
    example = (DEPLOY / ".env.example").read_text()
    listed = set(re.findall(r"^(\w+)=", example, re.M))
    assert {name for name, _ in used} <= listed


def test_compose_reserves_gpus_and_health_checks_every_service():
    services = load_compose(interpolated=True)["services"]
    assert set(services) == {*PDSERVE_SERVICES, "prometheus", "grafana"}
    for name, svc in services.items():
        assert "test" in svc["healthcheck"], name
    for name in ("prefill", "decode"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        assert str(services[name]["deploy"]["replicas"]) == "1"


def test_prometheus_scrapes_the_api_and_every_worker_replica():
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["pdserve-api"]["static_configs"][0]["targets"] == ["api:8000"]
    for role in ("prefill", "decode"):
        sd = jobs[f"pdserve-{role}"]["dns_sd_configs"][0]
        assert sd["names"] == [role] and sd["port"] == 9100


def k8s_documents() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_k8s_commands_are_real_pdserve_invocations_with_probes_and_gpus():
    docs = k8s_documents()
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    env = dict(config, POD_NAME="pdserve-decode-abc12")
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    for name, dep in deployments.items():
        container = dep["spec"]["template"]["spec"]["containers"][0]
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a)
                for a in container["command"]]
        args = parse_pdserve(argv)
        assert "readinessProbe" in container and "livenessProbe" in container, name
        if name != "pdserve-router":
            assert args.router == "tcp://pdserve-router:5557"  # Service DNS
            assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["metadata"]["name"] == "pdserve-router"
    assert {p["port"] for p in service["spec"]["ports"]} == {8000, 5557}


def k8s_containers() -> dict[str, dict]:
    """Deployment name -> its (only) container."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
            for d in k8s_documents() if d["kind"] == "Deployment"}


def test_k8s_router_is_ready_on_health_and_alive_on_live():
    """Readiness follows the workers (/health: a decode worker alive, not draining);
    liveness only the router's own loops (/live), so a lost worker never restarts it."""
    router = k8s_containers()["pdserve-router"]
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}


def test_k8s_clients_reach_only_ready_api_servers():
    """pdserve-router publishes not-ready pods (workers must register before the router is
    ready); clients' Service pdserve-api does not, so readiness gates their requests."""
    services = {d["metadata"]["name"]: d for d in k8s_documents() if d["kind"] == "Service"}
    api = services["pdserve-api"]["spec"]
    assert not api.get("publishNotReadyAddresses", False)
    assert api["selector"] == services["pdserve-router"]["spec"]["selector"]
    assert [p["port"] for p in api["ports"]] == [8000]


def test_k8s_runs_several_api_servers_and_workers_register_with_each():
    """Several front doors: the API server Deployment has more than one replica, and the
    Service the workers' --router names is headless, so its DNS name resolves to every
    replica (pdserve.worker_links makes one router link per address)."""
    docs = k8s_documents()
    router = next(d for d in docs if d["kind"] == "Deployment"
                  and d["metadata"]["name"] == "pdserve-router")
    assert router["spec"]["replicas"] > 1
    assert router["spec"]["strategy"]["type"] == "RollingUpdate"
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert services["pdserve-router"]["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("name", ["pdserve-prefill", "pdserve-decode"])
def test_k8s_workers_start_on_metrics_ready_when_registered_alive_on_metrics(name):
    container = k8s_containers()[name]
    assert container["startupProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert "pdserve:worker_registered" in " ".join(container["readinessProbe"]["exec"]["command"])
    assert container["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert container["livenessProbe"]["timeoutSeconds"] >= 1


def serve_text(text: str):
    """A local HTTP server answering every GET with ``text``; returns (server, port)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("registered, exit_code", [("1.0", 0), ("0.0", 1)])
def test_worker_readiness_probe_passes_only_once_the_worker_registered(registered, exit_code):
    """The probe's command, run against a /metrics in the worker's exposition format."""
    text = ('# TYPE pdserve:worker_registered gauge\n'
            'pdserve:worker_registered{model_name="m",worker_id="pdserve-decode-abc12",'
            f'role="decode"}} {registered}\n'
            'pdserve:num_requests_running{model_name="m",worker_id="w",role="decode"} 1.0\n')
    server, port = serve_text(text)
    try:
        command = k8s_containers()["pdserve-decode"]["readinessProbe"]["exec"]["command"]
        command = [c.replace("127.0.0.1:9100", f"127.0.0.1:{port}") for c in command]
        assert subprocess.run(command, timeout=10).returncode == exit_code
    finally:
        server.shutdown()
        server.server_close()


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "pdserve.json").read_text())


def test_grafana_dashboard_is_valid_dashboard_json_on_the_provisioned_datasource():
    dash = dashboard()
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" /
                         "prometheus.yml").read_text())["datasources"][0]
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["type"] == "timeseries" and panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["datasource"]["uid"] == ds["uid"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"] for t in panel["targets"])


def test_grafana_dashboard_covers_the_required_panels():
    text = " ".join(t["expr"] for p in dashboard()["panels"] for t in p["targets"])
    for metric in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "generation_tokens_total",
                   "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "route_decisions_total", "kv_transfer_bytes_sent_total",
                   "kv_transfer_seconds_bucket", "spec_decode_num_accepted_tokens_total",
                   "worker_restarts_total"):
        assert f"pdserve:{metric}" in text, metric
    assert "histogram_quantile(0.99" in text and "histogram_quantile(0.5" in text
