"""The remote-prefill handshake of one request, as an explicit state machine.

A request routed ``remote_prefill`` is prefilled by a prefill worker P and decoded by a
decode worker D. The router drives it through these states (the messages are in
:mod:`pdserve.messages`)::

    RESERVING ──reserved──► PREFILLING ──first_token──► AWAITING_KV ──kv_sent──► HANDED_OFF
        │  ▲                    │                                                  ▲
        └──┘ reserve_retry      └──kv_sent──► AWAITING_FIRST_TOKEN ──first_token───┘

    kv_failed (P's send or D's receive failed)   ─┐
    prefill_worker_lost (P died before the KV)    ├──► RECOMPUTING (D prefills itself)
    no_prefill_worker (none left once D reserved) ─┘

- RESERVING: D was asked to reserve blocks (``ExpectRemoteKV``); a refusal for capacity
  retries on the least-loaded decode worker, until the state's deadline.
- PREFILLING: P has the prompt (``PrefillRequest``); its first token and its KV are both
  outstanding. With layer-wise sends the KV can be fully sent before the first token
  arrives, hence the two orders.
- AWAITING_KV: the first token reached the client and D (``FirstToken``); KV still on the
  wire.
- AWAITING_FIRST_TOKEN: P reported the KV sent; its first token is not in yet.
- HANDED_OFF: D has both and runs the request like any other; P no longer matters. D can
  still report a KV it could not use (``KVTransferFailed``): then it recomputes.
- RECOMPUTING: D prefills the prompt itself after the tokens the client already has
  (``ResumeLocally``; the "recompute" failure policy). Late messages from P are ignored.

Every (state, event) pair not in :data:`TRANSITIONS` is ignored (a late or duplicate
message). Each state has a deadline (:data:`STATE_DEADLINES`, from the state's entry;
a self-transition keeps it): past it the router ends the wait (see
:meth:`pdserve.router.recovery.RequestRecovery.check_deadlines`). The request's exits (finished,
failed, timed out, worker lost, client gone) are the router's, in one method
(:meth:`pdserve.router.router.Router.end`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


class RemoteState(enum.Enum):
    """Where a remote-prefill request is in the handshake (see the module docstring)."""

    RESERVING = "reserving"
    PREFILLING = "prefilling"
    AWAITING_KV = "awaiting_kv"
    AWAITING_FIRST_TOKEN = "awaiting_first_token"
    HANDED_OFF = "handed_off"
    RECOMPUTING = "recomputing"


class RemoteEvent(enum.Enum):
    """What moves the handshake on."""

    RESERVED = "reserved"                    # D reserved blocks (KVReserved)
    RESERVE_RETRY = "reserve_retry"          # D refused for capacity: ask again
    FIRST_TOKEN = "first_token"              # P's PrefillDone
    KV_SENT = "kv_sent"                      # P's KVSent without error
    KV_FAILED = "kv_failed"                  # P's send failed, or D's KVTransferFailed
    PREFILL_WORKER_LOST = "prefill_worker_lost"
    NO_PREFILL_WORKER = "no_prefill_worker"  # D reserved but no prefill worker is alive


S, E = RemoteState, RemoteEvent

#: The allowed transitions; any other (state, event) pair is ignored.
TRANSITIONS: dict[tuple[RemoteState, RemoteEvent], RemoteState] = {
    (S.RESERVING, E.RESERVED): S.PREFILLING,
    (S.RESERVING, E.RESERVE_RETRY): S.RESERVING,
    (S.RESERVING, E.NO_PREFILL_WORKER): S.RECOMPUTING,
    (S.PREFILLING, E.FIRST_TOKEN): S.AWAITING_KV,
    (S.PREFILLING, E.KV_SENT): S.AWAITING_FIRST_TOKEN,
    (S.AWAITING_KV, E.KV_SENT): S.HANDED_OFF,
    (S.AWAITING_FIRST_TOKEN, E.FIRST_TOKEN): S.HANDED_OFF,
    **{(state, E.KV_FAILED): S.RECOMPUTING
       for state in (S.PREFILLING, S.AWAITING_KV, S.AWAITING_FIRST_TOKEN, S.HANDED_OFF)},
    **{(state, E.PREFILL_WORKER_LOST): S.RECOMPUTING
       for state in (S.PREFILLING, S.AWAITING_KV, S.AWAITING_FIRST_TOKEN)},
}

#: Each state's deadline: the :class:`~pdserve.router.router.RoutingConfig` field holding
#: it in seconds (0 there: none), or None for states the router does not time (D owns
#: the request).
STATE_DEADLINES: dict[RemoteState, str | None] = {
    S.RESERVING: "reserve_timeout_s",
    S.PREFILLING: "first_token_timeout_s",
    S.AWAITING_FIRST_TOKEN: "first_token_timeout_s",
    S.AWAITING_KV: "kv_timeout_s",
    S.HANDED_OFF: None,
    S.RECOMPUTING: None,
}

#: States in which the prefill worker still owes something (an abort reaches it).
PREFILL_WORKER_ACTIVE = frozenset({S.PREFILLING, S.AWAITING_FIRST_TOKEN, S.AWAITING_KV})


@dataclass
class RemotePrefill:
    """One request's handshake state.

    Attributes:
        prompt_token_ids: the prompt (resent on a reservation retry).
        params: its sampling parameters.
        state: the current :class:`RemoteState`.
        entered_s: ``time.monotonic()`` when ``state`` was entered.
        prefill_worker_id: P, once chosen.
        first_token_id: P's first token, once in.
        preferred_prefill_id: the P the routing policy chose (taken if still accepting
            once D has reserved blocks), or None.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    state: RemoteState = RemoteState.RESERVING
    entered_s: float = field(default_factory=time.monotonic)
    prefill_worker_id: str | None = None
    first_token_id: int | None = None
    preferred_prefill_id: str | None = None

    def fire(self, event: RemoteEvent, now_s: float | None = None) -> RemoteState | None:
        """Apply ``event``: the new state, or None when this state ignores the event
        (nothing changes). A self-transition keeps the state's entry time (its deadline)."""
        new = TRANSITIONS.get((self.state, event))
        if new is None:
            return None
        if new is not self.state:
            self.state = new
            self.entered_s = time.monotonic() if now_s is None else now_s
        return new

    def accepts(self, event: RemoteEvent) -> bool:
        """Whether :meth:`fire` would act on ``event`` now."""
        return (self.state, event) in TRANSITIONS

    def deadline_s(self, limits: object) -> float | None:
        """``time.monotonic()`` past which the state has waited too long, or None.

        Args:
            limits: an object with the fields :data:`STATE_DEADLINES` names (a
                :class:`~pdserve.router.router.RoutingConfig`).
        """
        name = STATE_DEADLINES[self.state]
        limit = 0.0 if name is None else float(getattr(limits, name))
        return self.entered_s + limit if limit > 0 else None

    @property
    def prefill_worker_active(self) -> bool:
        """Whether P still owes this request its first token or KV."""
        return self.prefill_worker_id is not None and self.state in PREFILL_WORKER_ACTIVE
