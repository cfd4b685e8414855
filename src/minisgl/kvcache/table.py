"""Rows of the page table: one per request in flight, mapping its positions to KV slots."""

from __future__ import annotations

import torch


class TableManager:
    def __init__(self, max_rows: int, max_seq_len: int, device: torch.device | str = "cpu") -> None:
        self.max_rows = max_rows
        self.max_seq_len = max_seq_len
        self.page_table = torch.zeros((max_rows, max_seq_len), dtype=torch.int64, device=device)
        # Lowest rows first: a small batch then touches few rows of the table.
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int | None:
        """A free row, or None when every row is taken."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._in_use.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._in_use:
            raise ValueError(f"page table row {row} is not in use (freed twice?)")
        self._in_use.remove(row)
        self._free_rows.append(row)
