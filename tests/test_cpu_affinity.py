"""Worker cores and threads: the CPU-list syntax, the default split, and a real process
pinned by ``apply_worker_cpus`` (read back from the kernel and from torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.cpu_affinity import (
    WorkerCpus,
    available_cpus,
    format_cpu_list,
    parse_cpu_list,
    plan_worker_cpus,
)


def test_parse_cpu_list_ranges_and_singles():
    assert parse_cpu_list("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cpu_list("5, 1,1") == (1, 5)


@pytest.mark.parametrize("bad", ["", "a", "3-1", "-1", "1-x"])
def test_parse_cpu_list_rejects_bad_lists(bad):
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list(bad)


def test_format_cpu_list_inverts_parse():
    assert format_cpu_list((0, 1, 2, 6, 8, 9)) == "0-2,6,8-9"
    assert parse_cpu_list(format_cpu_list((0, 1, 2, 6, 8, 9))) == (0, 1, 2, 6, 8, 9)


def test_default_plan_gives_decode_every_core_and_prefill_one_thread_fewer():
    prefill, decode = plan_worker_cpus((0, 1), num_prefill=1, num_decode=1)
    assert decode == [WorkerCpus((0, 1), 2)]
    assert prefill == [WorkerCpus((0, 1), 1)]


def test_default_plan_splits_cores_among_workers_of_a_role():
    prefill, decode = plan_worker_cpus(tuple(range(8)), num_prefill=2, num_decode=2)
    assert [d.cpus for d in decode] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [p.cpus for p in prefill] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [p.num_threads for p in prefill] == [3, 3]
    # colocated / no decode worker: a prefill worker keeps all its threads
    prefill, _ = plan_worker_cpus((0, 1), num_prefill=1, num_decode=0)
    assert prefill == [WorkerCpus((0, 1), 2)]


def test_explicit_cores_override_the_default():
    prefill, decode = plan_worker_cpus((0, 1, 2, 3), 1, 1, prefill_cpus=(3,),
                                       decode_cpus=(0, 1, 2))
    assert prefill == [WorkerCpus((3,), 1)] and decode == [WorkerCpus((0, 1, 2), 3)]
    assert decode[0].argv() == ["--cpus", "0-2", "--threads", "3"]


def _applied_in_child(cpus: str, threads: str) -> dict:
    code = ("import json, os, torch; from pdserve.cpu_affinity import apply_worker_cpus, "
            "parse_cpu_list; a = apply_worker_cpus(parse_cpu_list(%r), %s); "
            "print(json.dumps({'kernel': sorted(os.sched_getaffinity(0)), "
            "'torch': torch.get_num_threads(), 'cpus': list(a.cpus)}))" % (cpus, threads))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_apply_pins_the_process_and_sets_torch_threads():
    first = available_cpus()[0]
    got = _applied_in_child(str(first), "None")
    assert got == {"kernel": [first], "torch": 1, "cpus": [first]}
    if len(available_cpus()) >= 2:
        two = format_cpu_list(available_cpus()[:2])
        got = _applied_in_child(two, "1")
        assert got["kernel"] == list(available_cpus()[:2]) and got["torch"] == 1


def test_apply_refuses_cores_outside_the_process_mask():
    from pdserve.cpu_affinity import apply_worker_cpus

    beyond = max(available_cpus()) + 64
    with pytest.raises(ValueError, match="not available"):
        apply_worker_cpus((beyond,), None)


def test_worker_cli_rejects_a_bad_cpu_list():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "decode-worker", "--router",
                          "tcp://127.0.0.1:1", "--cpus", "3-1"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert "--cpus" in out.stderr and "bad CPU list" in out.stderr
    assert "Traceback" not in out.stderr


def test_transfer_threads_run_at_a_lower_priority_than_the_worker():
    """background_priority (the KV sender's and inbox's threads call it) lowers the calling
    thread's nice value alone: the process's main thread keeps its own."""
    import threading

    from pdserve.cpu_affinity import TRANSFER_THREAD_NICE, background_priority

    if not hasattr(threading, "get_native_id") or not sys.platform.startswith("linux"):
        pytest.skip("per-thread priorities are Linux's")
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []

    def run() -> None:
        background_priority()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [max(main, TRANSFER_THREAD_NICE)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main
