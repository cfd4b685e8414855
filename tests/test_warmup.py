"""The start-up warm-up (scheduler/step.py): two prompts over more than 16 pages prefilled in one batch, then one
decode step of both, shrunk to what the pool, the prefill budget and the context allow; nothing stays behind."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import Phase
from minisgl.engine.engine import Engine


@pytest.mark.parametrize(
    "kwargs, shapes",
    [
        (dict(page_size=4), [(Phase.PREFILL, [65, 65]), (Phase.DECODE, [1, 1])]),  # 16 pages and a token each
        (dict(page_size=4, max_prefill_tokens=48), [(Phase.PREFILL, [24, 24]), (Phase.DECODE, [1, 1])]),
        (dict(page_size=4, num_pages=10), [(Phase.PREFILL, [19, 19]), (Phase.DECODE, [1, 1])]),  # 5 pages each
        (dict(page_size=1, num_pages=3), [(Phase.PREFILL, [1]), (Phase.DECODE, [1])]),  # half a pool: 0 tokens
        (dict(page_size=1, num_pages=1), [(Phase.PREFILL, [1])]),  # no room for the decoded token
    ],
)
def test_warmup_batches_and_gives_everything_back(tiny_model_dir, monkeypatch, kwargs, shapes):
    seen = []
    forward = Engine.forward_and_sample

    def spy(self, batch, *a, **k):
        seen.append((batch.phase, list(batch.extend_lens), list(batch.prefix_lens)))
        return forward(self, batch, *a, **k)

    monkeypatch.setattr(Engine, "forward_and_sample", spy)
    llm = LLM(str(tiny_model_dir("llama")), disable_overlap=True, **kwargs)
    warm = seen[: len(shapes)]
    assert [(phase, extends) for phase, extends, _ in warm] == shapes
    if len(shapes) == 2:  # the decode step reads each prompt's whole KV
        assert warm[1][2] == warm[0][1]
    sched = llm.scheduler
    assert sched.cache.free_pages == sched.cache.num_pages and sched.cache.cached_pages == 0
    llm.check_integrity()
    if sched.cache.num_pages >= 10:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 2
    assert sched.cache.match_len([0] * 8) == 0  # the warm-up's prompts were not cached
