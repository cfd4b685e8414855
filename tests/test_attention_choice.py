"""Which attention backend, page size and RoPE kernel a CUDA engine picks for a model's head size.

FlashInfer's kernels are built for head sizes 64, 128 and 256; its FA2 prefill JIT-builds any other size without a
check and then fails (32: "Invalid configuration", seen on the H100) or reads out of bounds and returns wrong results
(sizes not a multiple of 64: flashinfer-ai/flashinfer#4299), and its RoPE kernel refuses them ("Unsupported
head_dim", seen on the H100). "auto" must then run torch-native attention (pages of one token, as on the CPU) and
the rotary layer PyTorch's RoPE; naming a FlashInfer backend must be refused with a ConfigError before anything loads.
The engine's checks (attention/choice.py) are exercised here without a GPU: a CUDA device and FlashInfer
reported importable; tests/test_warmup.py runs a head_dim-32 model end to end on a GPU.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from minisgl.attention import choice
from minisgl.config import EngineConfig
from minisgl.errors import ConfigError
from minisgl.layers import rotary

BACKENDS = {name: object() for name in ("torch", "flashinfer", "fa3", "xqa")}


def shell(head_dim: int, attention_backend: str = "auto") -> SimpleNamespace:
    """The engine's choice for a CUDA device in bfloat16: its page size, and _backend_names(backends)."""
    config = EngineConfig(attention_backend=attention_backend)
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    page_size = choice.page_size_for(config, device, dtype, head_dim)
    target = choice.AttentionTarget(device, dtype, dtype, head_dim, page_size)
    return SimpleNamespace(
        page_size=page_size, _backend_names=lambda backends: choice.backend_names(config, backends, target)
    )


@pytest.fixture(autouse=True)
def flashinfer_importable(monkeypatch):
    monkeypatch.setattr(choice, "_importable", lambda name: name == "flashinfer")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_auto_runs_flashinfer_on_pages_of_16_for_the_sizes_it_is_built_for(head_dim):
    eng = shell(head_dim)
    assert eng.page_size == 16
    assert eng._backend_names(BACKENDS) == ("flashinfer", "flashinfer")
    for name, names in [
        ("flashinfer", ("flashinfer", "flashinfer")),
        ("fa3,flashinfer", ("fa3", "flashinfer")),
        ("torch,flashinfer", ("torch", "flashinfer")),
    ]:
        assert shell(head_dim, name)._backend_names(BACKENDS) == names


@pytest.mark.parametrize("head_dim", [32, 80, 96, 112, 160, 192])
def test_auto_runs_torch_attention_on_single_token_pages_for_other_sizes(head_dim, caplog):
    eng = shell(head_dim)
    assert eng.page_size == 1
    with caplog.at_level(logging.WARNING, logger="minisgl"):
        assert eng._backend_names(BACKENDS) == ("torch", "torch")
    assert f"head_dim {head_dim}" in caplog.text


@pytest.mark.parametrize("name", ["flashinfer", "fa3", "fa3,flashinfer", "torch,flashinfer", "xqa", "flashinfer,xqa"])
@pytest.mark.parametrize("head_dim", [32, 96])
def test_naming_a_flashinfer_backend_for_another_size_is_a_config_error(name, head_dim):
    with pytest.raises(ConfigError, match=f"head_dim .*{head_dim}"):
        shell(head_dim, name)._backend_names(BACKENDS)


def test_torch_attention_is_taken_for_any_size():
    assert shell(96, "torch")._backend_names(BACKENDS) == ("torch", "torch")


class FakeFlashInfer:
    """flashinfer's RoPE entry point as it behaves: the sizes it is built for are rotated (recorded), others refused."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.rope = self

    def apply_rope_with_cos_sin_cache_inplace(self, positions, q, k, head_dim, cos_sin, is_neox) -> None:
        if head_dim not in (64, 128, 256, 512):
            raise RuntimeError(f"Unsupported head_dim: {head_dim}")
        self.calls.append(head_dim)


@pytest.mark.parametrize("head_dim,fused", [(16, False), (32, False), (96, False), (64, True), (128, True)])
def test_rope_uses_flashinfer_only_for_its_head_sizes_and_matches_hf_otherwise(head_dim, fused, monkeypatch):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    fake = FakeFlashInfer()
    monkeypatch.setattr(rotary, "fused_ops", lambda x: fake)
    rope = rotary.RotaryEmbedding(head_dim, 64, 10000.0)
    gen = torch.Generator().manual_seed(head_dim)
    q, k = torch.randn(5, 4, head_dim, generator=gen), torch.randn(5, 2, head_dim, generator=gen)
    positions = torch.tensor([0, 3, 7, 8, 63])
    q_out, k_out = rope(positions, q.clone(), k.clone())
    assert fake.calls == ([head_dim] if fused else [])
    if not fused:  # PyTorch's RoPE ran: HF's formula on the same positions
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.outer(positions.float(), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # HF's layout: [batch, heads, tokens, head_dim], cos/sin [batch, tokens, head_dim]
        q_ref, k_ref = apply_rotary_pos_emb(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
        )
        torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1))
        torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1))
