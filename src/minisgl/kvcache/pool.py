"""The paged KV pool: K and V for every layer, addressed by token slot (page * page_size + offset)."""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (2, num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.buffer = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def k(self, layer: int) -> torch.Tensor:
        """[num_slots, kv_heads, head_dim] keys of one layer."""
        return self.buffer[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer]

    def paged_k(self, layer: int) -> torch.Tensor:
        """[num_pages, page_size, kv_heads, head_dim] view (the layout paged kernels read)."""
        return self.buffer[0, layer].view(self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def paged_v(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer].view(self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def store(self, layer: int, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ([num_tokens, kv_heads, head_dim]) into the slots out_loc."""
        self.buffer[0, layer].index_copy_(0, out_loc, k.to(self.dtype))
        self.buffer[1, layer].index_copy_(0, out_loc, v.to(self.dtype))

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem
