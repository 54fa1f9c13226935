"""Errors raised by kvtransfer; every one is a :class:`KVTransferError`."""

from __future__ import annotations


class KVTransferError(Exception):
    """A KV transfer failed; the receiver should free the request's blocks and recover."""


class KVFormatError(KVTransferError):
    """A message does not follow the wire format (bad header, sizes that do not match)."""


class KVChecksumError(KVTransferError):
    """A message's payload or scales do not match the checksum in its header."""


class KVTransferTimeout(KVTransferError, TimeoutError):
    """A send, receive or connection did not complete within its deadline."""
