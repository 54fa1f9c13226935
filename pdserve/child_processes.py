"""Child processes of ``pdserve serve``: starting a worker (or an extra API server) that
dies with its parent, and stopping them all."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys

#: Seconds a child worker gets to exit after SIGTERM before SIGKILL.
WORKER_STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: ask the kernel to SIGTERM this child when its parent dies (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def spawn_pdserve(argv: list[str], cluster_keys=None) -> subprocess.Popen:
    """Start ``pdserve ARGV`` as a child process that dies with us, logging at this
    process's level (``pdserve --log-level``). The cluster secret travels in the child's
    environment (never on its command line); without keys the child runs
    ``--insecure-no-auth``."""
    from pdserve.security import SECRET_ENV, SECRET_FILE_ENV

    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    auth_argv = ["--insecure-no-auth"]
    if cluster_keys is not None:
        env.update(cluster_keys.child_env())
        auth_argv = []
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", level, *argv, *auth_argv]
    return subprocess.Popen(cmd, preexec_fn=die_with_parent, env=env)


def spawn_worker(kind: str, model: str | None, router_address: str,
                 engine_argv: list[str], worker_id: str,
                 cluster_keys=None) -> subprocess.Popen:
    """Start ``pdserve <kind>`` (``decode-worker``/``prefill-worker``) registering with
    ``router_address`` (comma-separated: several routers) as ``worker_id``
    (:func:`spawn_pdserve`)."""
    return spawn_pdserve([kind, *([model] if model else []), "--router", router_address,
                          "--worker-id", worker_id, *engine_argv], cluster_keys)


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM, wait up to the grace period, then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=WORKER_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
