"""The paged KV pool: K and V for every layer, addressed by token slot (page * page_size + offset).

The pool may store fp8 (`kv_cache_dtype="fp8_e4m3"` / `"fp8_e5m2"`, vLLM's and SGLang's option): half the
bytes of bf16, so twice the tokens in the same memory and half the reads of decode attention. Values are
saturated to the format's range and rounded once when stored (no scale factor, as vLLM and SGLang without
calibrated scales); attention reads them back in the model's dtype.
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


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
        model_dtype: torch.dtype | None = None,
    ) -> None:
        """dtype: what the pool stores; model_dtype: what attention computes in (default: dtype)."""
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.model_dtype = model_dtype or dtype
        self.is_fp8 = dtype in FP8_DTYPES.values()
        # What reads of the pool give: the model's dtype for fp8 (upcast), else what is stored.
        self.read_dtype = self.model_dtype if self.is_fp8 else dtype
        self._fp8_max = torch.finfo(dtype).max if self.is_fp8 else 0.0
        self.device = torch.device(device)
        shape = (2, num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        # Each layer's (keys, values) views, made once: a layer's store or read takes no indexing ops.
        self.layer_kv = [(self.buffer[0, layer], self.buffer[1, layer]) for layer in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def k(self, layer: int) -> torch.Tensor:
        """[num_slots, kv_heads, head_dim] keys of one layer."""
        return self.layer_kv[layer][0]

    def v(self, layer: int) -> torch.Tensor:
        return self.layer_kv[layer][1]

    def paged_k(self, layer: int) -> torch.Tensor:
        """[num_pages, page_size, kv_heads, head_dim] view (the layout paged kernels read)."""
        return self.buffer[0, layer].view(self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def paged_v(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer].view(self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """x as the pool holds it (fp8: saturated and rounded), in the pool's dtype."""
        if self.is_fp8:
            return x.clamp(-self._fp8_max, self._fp8_max).to(self.dtype)
        return x if x.dtype == self.dtype else x.to(self.dtype)  # no dispatch per layer when nothing converts

    def as_read(self, x: torch.Tensor) -> torch.Tensor:
        """x as a read of the pool gives it back after storing (fp8: rounded, then upcast)."""
        if not self.is_fp8 and x.dtype == self.dtype:
            return x
        return self.as_stored(x).to(self.read_dtype)

    def store(self, layer: int, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ([num_tokens, kv_heads, head_dim]) into the slots out_loc."""
        for dst, x in zip(self.layer_kv[layer], (k, v)):
            src = self.as_stored(x)
            if self.is_fp8:  # byte copies: not every device implements indexing ops for fp8
                dst, src = dst.view(torch.uint8), src.view(torch.uint8)
            dst.index_copy_(0, out_loc, src)

    def gather(self, layer: int, which: int, slots: torch.Tensor) -> torch.Tensor:
        """[len(slots), kv_heads, head_dim] keys (which=0) or values (1) of one layer, in read_dtype."""
        src = self.layer_kv[layer][which]
        if not self.is_fp8:
            return src.index_select(0, slots)
        return src.view(torch.uint8).index_select(0, slots).view(self.dtype).to(self.read_dtype)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem
