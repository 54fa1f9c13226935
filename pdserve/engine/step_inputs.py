"""One step's scheduled requests flattened into the rows the model computes."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.scheduler import ScheduledRequest


@dataclass
class StepInputs:
    """The step's rows, request after request in schedule order.

    A request computing tokens ``[start, end)`` adds ``end - start`` rows: its tokens from
    ``start`` and then its ``k`` draft tokens, at positions ``start .. end - 1``.

    Attributes:
        input_ids, positions, slots: per row, its token, position and KV cache slot
            (``block_table[p // block_size] * block_size + p % block_size``).
        query_lens, seq_lens, block_tables: per request, its rows this step, its context
            length after the step and its block table.
        query_starts: per request, its first row.
        plain: the requests that sample one token, each with its last row.
        verify: the requests that verify ``k`` drafts, each with its first verified row
            (the ``k + 1`` rows from there).
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    query_starts: list[int]
    plain: list[tuple[ScheduledRequest, int]]
    verify: list[tuple[ScheduledRequest, int]]

    @classmethod
    def build(cls, scheduled: list[ScheduledRequest], block_size: int) -> StepInputs:
        """Flatten ``scheduled`` (host lists only; nothing touches the device)."""
        bs = block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        query_starts: list[int] = []
        plain: list[tuple[ScheduledRequest, int]] = []
        verify: list[tuple[ScheduledRequest, int]] = []
        for s in scheduled:
            req, n, k = s.request, s.num_new_tokens, s.num_spec_tokens
            start = req.num_computed_tokens
            end = start + n
            bt = req.block_table
            query_starts.append(len(input_ids))
            input_ids.extend(req.token_ids[start:end - k])
            input_ids.extend(s.spec_token_ids)
            positions.extend(range(start, end))
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            block_tables.append(bt)
            if s.is_sampling:
                last_row = len(input_ids) - 1
                if k:
                    verify.append((s, last_row - k))
                else:
                    plain.append((s, last_row))
        return cls(input_ids, positions, slots, query_lens, seq_lens, block_tables,
                   query_starts, plain, verify)
