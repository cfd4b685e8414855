"""A minisgl plugin for tests with real daemons: Llama architectures whose forward fails on purpose, and
one that generates a script (for output paths a random model cannot reach, such as reasoning blocks).

tests/test_daemon.py installs it for a daemon (an entry point in a temporary dist-info on its
PYTHONPATH), the way a third-party plugin is installed; it is never imported by the test process.
"""

from __future__ import annotations

import os
from typing import Any

from minisgl.hooks import hookimpl

# A prompt holding these three tokens in a row crashes the forward of its batch.
POISON = [7, 8, 9]
NO_KERNEL = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
)


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

    class ScriptedLlamaForCausalLM(LlamaForCausalLM):
        """Greedy decoding follows $MINISGL_TEST_SCRIPT (comma-separated token ids, each once): a script token
        is followed by the next one, the last by EOS, any other token by the first. Each position's token id
        rides in its hidden state to compute_logits (the engine keeps the last position of each sequence)."""

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
            hidden = torch.zeros(len(input_ids), self.config.hidden_size)
            hidden[:, 0] = input_ids.float()
            return hidden

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            script = [int(t) for t in os.environ["MINISGL_TEST_SCRIPT"].split(",")]
            after = dict(zip(script, script[1:] + [self.config.eos_token_ids[0]]))
            logits = torch.full((hidden.shape[0], self.config.vocab_size), -30.0)
            for row, token in enumerate(hidden[:, 0].round().long().tolist()):
                logits[row, after.get(token, script[0])] = 30.0
            return logits

    return {
        "PoisonedLlamaForCausalLM": PoisonedLlamaForCausalLM,
        "NoKernelLlamaForCausalLM": NoKernelLlamaForCausalLM,
        "ScriptedLlamaForCausalLM": ScriptedLlamaForCausalLM,
    }
