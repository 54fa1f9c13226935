"""The decode worker's KV inbox with hidden sections: a transfer whose KV messages announce
one is handed on only with it, in either arrival order; a section that is corrupt, does not
match the announcement, or has a malformed header ends the transfer with a reason (or is
dropped unread), and the inbox keeps receiving."""

from __future__ import annotations

import queue
import time

import msgspec
import pytest
import torch

from pdserve.decode_worker.kv_inbox import KVInbox
from pdserve.kvtransfer.hidden import encode_hidden
from pdserve.kvtransfer.wire import encode_kv
from pdserve.prefill_worker.kv_sender import KVJob, KVSenderThread

NUM_LAYERS, NUM_TOKENS, WIDTH = 2, 20, 8


@pytest.fixture()
def link():
    """(inbox, sender thread, raw sender) over one inproc transport."""
    inbox = KVInbox("inproc", NUM_LAYERS, torch.float32, stale_after_s=30.0)
    done: queue.Queue = queue.Queue()
    sender = KVSenderThread("inproc", False, 10.0, lambda *a: done.put(a))
    sender.transport = inbox.transport  # inproc: one transport object holds the queues
    raw = inbox.transport.create_sender(inbox.address, timeout_s=5.0)
    yield inbox, sender, raw
    sender.close()
    inbox.close()


def _kv(seed=0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(NUM_LAYERS, 2, 2, 16, 3, 64)  # 20 tokens in 2 blocks of 16


def _hidden(seed=1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(NUM_TOKENS - 4, WIDTH).to(torch.bfloat16)


def _kv_job(rid, kv, hidden_size=WIDTH) -> KVJob:
    return KVJob(rid, kv, NUM_TOKENS, "", hidden_size=hidden_size)


def _hidden_job(rid, hidden) -> KVJob:
    return KVJob(rid, None, NUM_TOKENS, "", hidden=hidden,
                 hidden_start=NUM_TOKENS - len(hidden))


def _submit(sender, inbox, *jobs) -> None:
    for job in jobs:
        job.dest_address = inbox.address
        sender.submit(job)


def test_transfer_is_ready_with_its_hidden_section(link):
    inbox, sender, _ = link
    kv, hidden = _kv(), _hidden()
    _submit(sender, inbox, _kv_job("r", kv), _hidden_job("r", hidden))
    rid, (got_kv, scales, got_hidden, start) = inbox.ready.get(timeout=10)
    assert rid == "r" and scales is None and start == 4
    assert torch.equal(got_kv, kv) and torch.equal(got_hidden, hidden)
    assert got_hidden.dtype == torch.bfloat16  # as sent; the engine casts
    assert inbox.num_bytes_received == kv.numel() * 4 + hidden.numel() * 2


def test_hidden_section_may_arrive_first(link):
    inbox, sender, _ = link
    _submit(sender, inbox, _hidden_job("r", _hidden()))
    time.sleep(0.3)
    assert inbox.ready.empty()
    _submit(sender, inbox, _kv_job("r", _kv()))
    rid, item = inbox.ready.get(timeout=10)
    assert rid == "r" and torch.equal(item[2], _hidden())


def test_announced_section_is_awaited_and_a_plain_transfer_is_not(link):
    inbox, sender, _ = link
    _submit(sender, inbox, _kv_job("waits", _kv()), _kv_job("plain", _kv(), hidden_size=0))
    rid, item = inbox.ready.get(timeout=10)
    assert rid == "plain" and item[2] is None
    time.sleep(0.3)
    assert inbox.ready.empty()  # "waits" is held for its hidden section
    inbox.stale_after_s = 0.0
    time.sleep(0.5)  # the receive loop drops stale entries while idle
    assert not inbox._kv_done and not inbox._partial


def test_section_that_does_not_match_the_announcement_fails_the_transfer(link):
    inbox, sender, _ = link
    _submit(sender, inbox, _kv_job("r", _kv(), hidden_size=WIDTH * 2),
            _hidden_job("r", _hidden()))
    assert inbox.ready.get(timeout=10) == ("r", "format")
    assert not inbox._kv_done and not inbox._hidden


def test_corrupt_section_fails_the_transfer_and_the_inbox_goes_on(link):
    inbox, sender, raw = link
    _submit(sender, inbox, _kv_job("bad", _kv()))
    enc = encode_hidden("bad", _hidden(), hidden_start=4, num_tokens=NUM_TOKENS)
    payload = enc.payload.copy()
    payload[5] ^= 0x01
    raw.send(enc.header, (payload, enc.scales), timeout_s=5.0)
    assert inbox.ready.get(timeout=10) == ("bad", "checksum")
    _submit(sender, inbox, _kv_job("good", _kv()), _hidden_job("good", _hidden()))
    assert inbox.ready.get(timeout=10)[0] == "good"


@pytest.mark.parametrize("change", [{"hidden_size": 0}, {"version": 1}, {"num_blocks": 3},
                                    {"section": "bogus"}, {"version": 99}])
def test_malformed_hidden_header_is_dropped_unread(link, change):
    inbox, sender, raw = link
    enc = encode_hidden("r", _hidden(), hidden_start=4, num_tokens=NUM_TOKENS)
    bad = msgspec.structs.replace(enc.header, **change)
    raw.send(bad, enc.buffers, timeout_s=5.0)
    deadline = time.monotonic() + 10
    while inbox.num_dropped == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert inbox.num_dropped == 1 and inbox.ready.empty()
    _submit(sender, inbox, _kv_job("r", _kv()), _hidden_job("r", _hidden()))
    assert inbox.ready.get(timeout=10)[0] == "r"


def test_kv_and_hidden_headers_of_one_transfer_agree():
    """What the sender thread puts on the wire for a transfer with a hidden section."""
    kv_header = encode_kv("r", _kv(), layer_start=0, num_tokens=NUM_TOKENS, use_fp8=False,
                          hidden_size=WIDTH).header
    hidden_header = encode_hidden("r", _hidden(), hidden_start=4,
                                  num_tokens=NUM_TOKENS).header
    assert (kv_header.hidden_size, kv_header.num_tokens) == \
        (hidden_header.hidden_size, hidden_header.num_tokens)


def test_a_repeated_layer_fails_the_transfer_instead_of_completing_it(link):
    """Layer 0 sent twice must not stand in for layer 1 (it completed the transfer with
    layer 1 never written)."""
    inbox, _, raw = link
    layer0 = encode_kv("r", _kv()[:1], layer_start=0, num_tokens=NUM_TOKENS, use_fp8=False)
    raw.send(layer0.header, layer0.buffers, timeout_s=5.0)
    raw.send(layer0.header, layer0.buffers, timeout_s=5.0)
    assert inbox.ready.get(timeout=10) == ("r", "format")


def test_blocks_of_another_shape_are_dropped_unread():
    inbox = KVInbox("inproc", NUM_LAYERS, torch.float32, block_shape=(16, 3, 32))
    try:
        raw = inbox.transport.create_sender(inbox.address, timeout_s=5.0)
        msg = encode_kv("r", _kv(), layer_start=0, num_tokens=NUM_TOKENS, use_fp8=False)
        raw.send(msg.header, msg.buffers, timeout_s=5.0)
        deadline = time.monotonic() + 10
        while inbox.num_dropped == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inbox.num_dropped == 1
        with pytest.raises(queue.Empty):
            inbox.ready.get(timeout=0.3)
    finally:
        inbox.close()
