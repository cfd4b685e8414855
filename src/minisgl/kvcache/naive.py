"""The no-reuse prefix cache: nothing is ever cached, so every request computes its whole prompt."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from minisgl.kvcache.base import MatchResult, PrefixCache


class NaiveCache(PrefixCache):
    def __init__(self, page_size: int, device: torch.device | str = "cpu") -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)

    def match_prefix(self, token_ids: Sequence[int], start: Any = None) -> MatchResult:
        return MatchResult(None, self._empty)

    def locate(self, token_ids: Sequence[int], start: Any = None) -> tuple[int, Any]:
        return 0, None

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        # "All of it was already cached": the caller keeps, and so frees, every slot it offered.
        return len(token_ids)

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def evict(self, num_pages: int) -> torch.Tensor:
        return self._empty

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def protected_pages(self) -> int:
        return 0

    def reset(self) -> list[torch.Tensor]:
        return []
