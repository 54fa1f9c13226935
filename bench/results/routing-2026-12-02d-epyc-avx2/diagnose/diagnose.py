"""One Poisson run with --routing predicted, the server logging each decision (inputs and
estimates) to LOG; run from the repository root:

    python bench/results/routing-2026-12-02d-epyc-avx2/diagnose/diagnose.py 45 0.5 1 /tmp/decisions.jsonl
"""
import asyncio, json, os, secrets, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, "bench")
import mixed_load as ml
from routing_compare import warm_up

n, rate, seed, log = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
port, rport = ml.free_port(), ml.free_port()
router, secret = f"tcp://127.0.0.1:{rport}", secrets.token_hex(16)
server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("logged_server.py")), "server", "--port", str(port),
                           "--router-address", router, "--routing", "predicted", "--max-model-len", "4096"],
                          env=dict(os.environ, PDSERVE_CLUSTER_SECRET=secret, ROUTE_LOG=log),
                          stdout=subprocess.DEVNULL)
workers = [ml.launch("prefill-worker", router, "0", 1, secret), ml.launch("decode-worker", router, "1", 1, secret)]
base = f"http://127.0.0.1:{port}"
try:
    assert ml.wait_health(base, 200, server, 300)
    while ml.num_workers_up(base) < 2:
        time.sleep(0.5)
    asyncio.run(warm_up(base))
    with open(log, "a") as f:
        f.write(json.dumps({"mark": "measured run starts"}) + "\n")
    reqs = ml.workload(n, rate, seed=seed)
    res, elapsed = asyncio.run(ml.run_requests(base, reqs))
    out = ml.summarize("diag", reqs, res, elapsed)
    out["records"] = [{"arrival_s": q[0], "prompt_tokens": len(q[1]), "is_long": q[3], "ttft_s": r[0]}
                      for q, r in zip(reqs, res)]
    out["route_counts"] = ml.route_counts(base)
    json.dump(out, open(log + ".result.json", "w"), indent=1)
    print({k: v for k, v in out.items() if k != "records"})
finally:
    for p in workers + [server]:
        ml.stop_process(p, 10)
