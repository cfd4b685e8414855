"""Keep a minisgl engine on the live transformers model's current weights.

The engine is built from the model's config and state_dict (its own copy of the weights, in
its fused layout). Before every generate call a WeightWatcher compares a fingerprint of the
model's parameters with the one taken at the last sync: for each parameter its identity, its
storage pointer and its autograd version counter. That catches everything that goes through
PyTorch's in-place ops (optimizer.step, load_state_dict, `with torch.no_grad(): p.add_(...)`)
as well as replaced parameters and `.to()`. On a change every weight is copied again into the
engine (in place, so CUDA graphs stay valid) and the prefix cache is dropped: its KV was
computed with the old weights.

Writes through `param.data` bypass the version counter; call sync_weights(model) after those.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minisgl import LLM

logger = logging.getLogger("minisgl")

Fingerprint = list[tuple[str, int, int, int]]


def fingerprint(model: torch.nn.Module) -> Fingerprint:
    """(name, identity, storage pointer, version) per parameter: a few integers each, no data read."""
    return [(name, id(p), p.data_ptr(), p._version) for name, p in model.named_parameters()]


class WeightWatcher:
    """Re-loads the engine's weights from the model when the model's parameters changed."""

    def __init__(self, model: torch.nn.Module, llm: "LLM") -> None:
        self.model = model
        self.llm = llm
        self.synced = fingerprint(model)
        self.num_syncs = 0

    def changed(self) -> bool:
        return fingerprint(self.model) != self.synced

    def sync_if_changed(self) -> bool:
        if not self.changed():
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """Copy every weight of the model into the engine and forget the KV computed with the old ones."""
        with torch.no_grad():
            self.llm.load_weights(self.model.state_dict().items())
        self.synced = fingerprint(self.model)
        self.num_syncs += 1
        logger.info("transformers_minisgl: weights changed, re-synced the engine and cleared its prefix cache")
