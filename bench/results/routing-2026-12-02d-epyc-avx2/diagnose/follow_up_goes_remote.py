"""PredictedTTFTPolicy on a follow-up chat turn: 1,008 of 1,100 prompt tokens cached on D."""
from pdserve.messages import Heartbeat, RegisterWorker
from pdserve.router.policy import PredictedTTFTPolicy, RouteRequest, ThresholdPolicy
from pdserve.router.registry import WorkerInfo


def worker(role, num_running, rate):
    info = RegisterWorker(f"{role}-0", role, "m", 4096, 16, 2048, 1,
                          kv_address="tcp://127.0.0.1:1" if role == "decode" else None)
    w = WorkerInfo(info, 0.0, Heartbeat(f"{role}-0", num_running, 0, 1000, 0.1,
                                        prefill_tokens_per_s=rate))
    w.remote_overhead_s = 0.05
    return w


class View:
    def __init__(self, d, p):
        self.d, self.p = d, p

    def accepting(self, role):
        return [self.d] if role == "decode" else [self.p]

    def num_cached_tokens(self, worker, ids):
        return 1008 if worker is self.d else 0


prompt = list(range(1100))
for num_running in (0, 4, 8, 11, 12, 16):
    view = View(worker("decode", num_running, 250.0), worker("prefill", 0, 250.0))
    req = RouteRequest("r", prompt)
    print(f"D running {num_running:2d}: threshold -> {ThresholdPolicy(512).route(req, view).kind:14s}"
          f" predicted -> {PredictedTTFTPolicy(512).route(req, view).kind}")
