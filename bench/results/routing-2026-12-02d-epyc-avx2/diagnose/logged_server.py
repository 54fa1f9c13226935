"""`pdserve server` with every PredictedTTFTPolicy decision logged (inputs and estimates)
to $ROUTE_LOG as JSON lines. Wraps the policy at import; pdserve's files are untouched."""
import json
import os
import sys
import time

from pdserve.router import policy as pol

_route = pol.PredictedTTFTPolicy.route
_log = open(os.environ["ROUTE_LOG"], "a", buffering=1)


def _worker(w):
    load = w.load
    return {"id": w.worker_id, "rate": w.prefill_tokens_per_s, "queued": w.num_prefill_tokens_queued,
            "reported_queued": None if load is None else load.num_prefill_tokens_queued,
            "running": None if load is None else load.num_running,
            "waiting": None if load is None else load.num_waiting,
            "load_score": w.load_score, "kv_Bps": w.kv_bytes_per_s,
            "kv_B_per_tok": w.kv_bytes_per_token, "overhead_s": w.remote_overhead_s}


def route(self, request, workers):
    decision = _route(self, request, workers)
    rec = {"t": time.time(), "id": request.request_id, "num_tokens": len(request.prompt_token_ids)}
    if decision is not None:
        d, cached = decision.decode, decision.num_cached_tokens
        local = pol.local_estimate(d, len(request.prompt_token_ids) - cached)
        remotes = [pol.remote_estimate(p, len(request.prompt_token_ids))
                   for p in workers.accepting("prefill")]
        rec |= {"kind": decision.kind, "cached": cached, "decode": _worker(d),
                "prefill": [_worker(p) for p in workers.accepting("prefill")],
                "local": None if local is None else [local.ttft_s, local.stall_s],
                "remote": [None if e is None else [e.ttft_s, e.stall_s] for e in remotes]}
    _log.write(json.dumps(rec) + "\n")
    return decision


pol.PredictedTTFTPolicy.route = route

from pdserve.cli import main  # noqa: E402

sys.exit(main())
