"""Mixture-of-experts members of the Llama family: Qwen3-MoE, Mixtral and Qwen2-MoE (with its shared expert).

The decoder is llama.py's (its sparse layers hold a layers/moe.py FusedMoE as their MLP); what differs is the
checkpoint's names: each expert's projections are separate tensors, stacked here into the layer's
gate_up_proj [E, 2I, H] and down_proj [E, H, I], and Mixtral calls the block block_sparse_moe and its
projections w1 (gate), w3 (up) and w2 (down).
"""

from __future__ import annotations

import re

from minisgl.models.llama import LlamaForCausalLM

# ".experts.<e>.<projection>.weight" -> index of the projection in FusedMoE's shard ids.
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PROJECTION = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


class MoeForCausalLM(LlamaForCausalLM):
    def parameter_for(self, hf_name: str) -> tuple[str, int | str | tuple[int, int] | None]:
        hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        match = _EXPERT.search(hf_name)
        if match is None:
            return super().parameter_for(hf_name)
        proj = _PROJECTION[match.group(2)]
        target = "gate_up_proj" if proj < 2 else "down_proj"
        return f"{hf_name[: match.start()]}.{target}", (int(match.group(1)), proj)
