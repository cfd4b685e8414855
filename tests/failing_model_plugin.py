"""A minisgl plugin for tests with real daemons: Llama architectures whose forward fails on purpose.

tests/test_daemon.py installs it for a daemon (an entry point in a temporary dist-info on its
PYTHONPATH), the way a third-party plugin is installed; it is never imported by the test process.
"""

from __future__ import annotations

from typing import Any

from minisgl.hooks import hookimpl

# A prompt holding these three tokens in a row crashes the forward of its batch.
POISON = [7, 8, 9]
NO_KERNEL = "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"


@hookimpl
def minisgl_register_architectures() -> dict[str, type]:
    import torch

    from minisgl.models.llama import LlamaForCausalLM

    class PoisonedLlamaForCausalLM(LlamaForCausalLM):
        """Llama, except that a forward over the POISON tokens raises (a request that crashes its batch)."""

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
            ids = input_ids.tolist()
            if any(ids[i : i + len(POISON)] == POISON for i in range(len(ids))):
                raise RuntimeError("poisoned batch: " + NO_KERNEL)
            return super().forward(input_ids, positions)

    class NoKernelLlamaForCausalLM(LlamaForCausalLM):
        """Llama on a machine without the kernel its dtype needs: every forward raises what torch raises then."""

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
            raise RuntimeError(NO_KERNEL)

    return {"PoisonedLlamaForCausalLM": PoisonedLlamaForCausalLM, "NoKernelLlamaForCausalLM": NoKernelLlamaForCausalLM}
