"""The decode side of a remotely prefilled request, as an explicit state machine.

The router reserves blocks on this worker for a prompt a prefill worker P computes; P
pushes the KV here and the router forwards P's first token. On this worker the request
moves through these states (the events are what the worker sees)::

    RESERVED ──first_token──► RECEIVING ──kv_complete──► READY ──installed──► RUNNING
        │                                                  ▲ │ (first_token: stays; the
        └──────────────────kv_complete─────────────────────┘ │  worker installs at once)
    RESERVED / RECEIVING / READY ──kv_bad, deadline──► FAILED ──resume──► RECOMPUTING
    RESERVED / RECEIVING / READY ──resume (the router gave up on P)──────► RECOMPUTING
    any state but RUNNING / RECOMPUTING ──abort──► ABORTED;  FAILED ──deadline──► ABORTED

- RESERVED: blocks held; neither the first token nor the whole KV is in (the prefill may
  still be running on P; layers may already be arriving).
- RECEIVING: the first token is in, so P's prefill ended: the rest of the KV is on the wire.
- READY: every layer arrived and verified; waiting for the first token to install it.
- RUNNING: the KV is in the blocks and the request in the running batch (the engine owns it).
- FAILED: the KV broke (checksum, format, does not fit) or a deadline passed: the blocks are
  freed at once and the router told (``KVTransferFailed``); it answers ``ResumeLocally``
  (recompute, the default policy) or aborts the request.
- RECOMPUTING: prefilling the prompt here (the engine owns it; it gets new blocks).
- ABORTED: the router aborted it, or it never answered a failure in time.

Every (state, event) pair not in :data:`TRANSITIONS` is ignored (a late or duplicate
message: e.g. KV completing after a deadline). Each live state has a deadline
(:data:`STATE_DEADLINES`, from the state's entry; a self-transition keeps it). Entering
FAILED, RECOMPUTING or ABORTED releases the request's KV (its blocks and any partly received
layers) through one function, the worker's ``_release_kv``, whichever path got there.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch


class KVState(enum.Enum):
    """Where a remotely prefilled request is on this worker (see the module docstring)."""

    RESERVED = "reserved"
    RECEIVING = "receiving"
    READY = "ready"
    RUNNING = "running"
    FAILED = "failed"
    RECOMPUTING = "recomputing"
    ABORTED = "aborted"


class KVEvent(enum.Enum):
    """What moves it on."""

    FIRST_TOKEN = "first_token"  # the router forwarded P's first token
    KV_COMPLETE = "kv_complete"  # every layer arrived intact
    INSTALLED = "installed"      # the KV is written into the blocks; decoding starts
    KV_BAD = "kv_bad"            # a message failed its checksum or format, or does not fit
    DEADLINE = "deadline"        # the state's deadline passed
    RESUME = "resume"            # the router: recompute here (ResumeLocally)
    ABORT = "abort"              # the router: stop (AbortRequests), or this worker gave up


S, E = KVState, KVEvent
LIVE = (S.RESERVED, S.RECEIVING, S.READY)

#: The allowed transitions; any other (state, event) pair is ignored.
TRANSITIONS: dict[tuple[KVState, KVEvent], KVState] = {
    (S.RESERVED, E.FIRST_TOKEN): S.RECEIVING,
    (S.RESERVED, E.KV_COMPLETE): S.READY,
    (S.RECEIVING, E.KV_COMPLETE): S.READY,
    (S.READY, E.FIRST_TOKEN): S.READY,
    (S.READY, E.INSTALLED): S.RUNNING,
    **{(state, E.KV_BAD): S.FAILED for state in LIVE},
    **{(state, E.DEADLINE): S.FAILED for state in LIVE},
    **{(state, E.RESUME): S.RECOMPUTING for state in (*LIVE, S.FAILED)},
    **{(state, E.ABORT): S.ABORTED for state in (*LIVE, S.FAILED)},
    (S.FAILED, E.DEADLINE): S.ABORTED,
}

#: Each state's deadline: the :class:`KVDeadlines` field holding it in seconds, or None
#: (the engine owns the request, or it is gone).
STATE_DEADLINES: dict[KVState, str | None] = {
    S.RESERVED: "reserved_s",
    S.RECEIVING: "receiving_s",
    S.READY: "ready_s",
    S.FAILED: "failed_s",
    S.RUNNING: None,
    S.RECOMPUTING: None,
    S.ABORTED: None,
}

#: Entering one of these releases the request's reserved blocks and partial KV.
RELEASES_KV = frozenset({S.FAILED, S.RECOMPUTING, S.ABORTED})
#: Out of this worker's lifecycle table once entered (the engine owns it, or it is gone).
FINAL = frozenset({S.RUNNING, S.RECOMPUTING, S.ABORTED})


@dataclass(frozen=True)
class KVDeadlines:
    """Seconds each state may last (0: no deadline).

    Attributes:
        reserved_s: blocks held before the first token and the whole KV are in: a backstop
            for a router that forgot the request (its own first-token deadline, 600 s by
            default, normally acts first).
        receiving_s: from the first token (the end of the prefill) to the whole KV
            (``--kv-transfer-timeout``).
        ready_s: from the whole KV to the first token (it travels P -> router -> here).
        failed_s: for the router's answer to a reported failure; past it the request is
            aborted here.
    """

    reserved_s: float = 900.0
    receiving_s: float = 10.0
    ready_s: float = 10.0
    failed_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("reserved_s", "receiving_s", "ready_s", "failed_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


@dataclass
class RemoteKV:
    """One remotely prefilled request on this worker.

    Attributes:
        num_prompt_tokens: tokens whose KV the reservation holds blocks for.
        state: the current :class:`KVState`; ``entered_s`` its ``time.monotonic()`` entry.
        kv: the received ``(kv, FP8 scales or None, hidden or None, hidden_start)`` once
            complete (see KVInbox.ready), the arguments after the first token of
            ``LLMEngine.complete_remote_prefill``.
        first_token_id: P's first token once forwarded.
        failure: why it failed ("timeout", "checksum", "format"), once FAILED.
    """

    num_prompt_tokens: int
    state: KVState = KVState.RESERVED
    entered_s: float = field(default_factory=time.monotonic)
    kv: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int] | None = None
    first_token_id: int | None = None
    failure: str | None = None

    def fire(self, event: KVEvent, now_s: float | None = None) -> KVState | None:
        """Apply ``event``: the new state, or None when this state ignores it (nothing
        changes). A self-transition keeps the state's entry time (its deadline)."""
        new = TRANSITIONS.get((self.state, event))
        if new is None:
            return None
        if new is not self.state:
            self.state = new
            self.entered_s = time.monotonic() if now_s is None else now_s
        return new

    def deadline_s(self, deadlines: KVDeadlines) -> float | None:
        """``time.monotonic()`` past which the state has lasted too long, or None."""
        name = STATE_DEADLINES[self.state]
        limit = 0.0 if name is None else float(getattr(deadlines, name))
        return self.entered_s + limit if limit > 0 else None

    @property
    def accepts_kv(self) -> bool:
        """Whether KV messages for it may still be stored (its blocks are reserved and the
        KV is not complete yet)."""
        return self.state in (KVState.RESERVED, KVState.RECEIVING)
