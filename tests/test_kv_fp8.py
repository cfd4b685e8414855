"""An fp8 KV cache (kv_cache_dtype="fp8_e4m3" / "fp8_e5m2") against HF transformers whose cache rounds K and V
the same way: saturated to the format's range, rounded once, read back in the model's dtype."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from minisgl import LLM, SamplingParams
from minisgl.errors import ConfigError
from minisgl.kvcache.pool import FP8_DTYPES

PROMPT = [(7 * i + 3) % 500 + 10 for i in range(45)]


class RoundingCache(DynamicCache):
    """HF's dynamic cache, but every key and value goes through `fp8` on the way in (the reference)."""

    def __init__(self, fp8: torch.dtype, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fp8 = fp8

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        top = torch.finfo(self.fp8).max
        rounded = [x.clamp(-top, top).to(self.fp8).to(x.dtype) for x in (key_states, value_states)]
        return super().update(*rounded, layer_idx, *args, **kwargs)


def hf_logprobs(model, ids: list[int], fp8: torch.dtype | None) -> torch.Tensor:
    cache = RoundingCache(fp8, config=model.config) if fp8 is not None else DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prompt_logprobs_and_greedy_tokens_equal_hf_with_an_fp8_rounding_cache(tiny_model_dir, family, kv):
    model_dir = tiny_model_dir(family)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    fp8 = FP8_DTYPES[kv]
    ref = hf_logprobs(hf, PROMPT, fp8)
    plain = hf_logprobs(hf, PROMPT, None)
    # The prompt in chunks of 16 (later chunks read the earlier ones' keys from the pool), then a rerun that
    # extends the cached prefix; greedy decoding reads every earlier token from the fp8 pool.
    with LLM(str(model_dir), kv_cache_dtype=kv, max_prefill_tokens=16) as llm:
        for _ in range(2):
            out = llm.generate(
                [PROMPT],
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0),
                use_tqdm=False,
            )[0]
            got = torch.tensor([e[0] for e in out.prompt_logprobs[1:]])  # (logprob, top-k) per token, None first
            want = torch.stack([ref[i - 1, PROMPT[i]] for i in range(1, len(PROMPT))])
            torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
        # The same model with a full-precision cache scores differently: the fp8 path is what ran.
        assert max(abs(float(plain[i - 1, PROMPT[i]] - want[i - 1])) for i in range(1, len(PROMPT))) > 1e-3
        cached = llm.generate(
            [PROMPT + [42]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )[0]
    with torch.no_grad():
        hf_tokens = []
        for prompt in (PROMPT, PROMPT + [42]):
            gen = hf.generate(
                torch.tensor([prompt]),
                past_key_values=RoundingCache(fp8, config=hf.config),
                max_new_tokens=12,
                min_new_tokens=12,
                do_sample=False,
            )
            hf_tokens.append(gen[0, len(prompt) :].tolist())
    assert [out.token_ids, cached.token_ids] == hf_tokens


def test_an_fp8_pool_holds_more_tokens_in_the_same_memory_and_bad_names_are_refused(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    pages = {}
    for kv in ("auto", "fp8"):
        with LLM(str(model_dir), kv_cache_dtype=kv, kv_cache_gb=0.01) as llm:  # float32 model on the CPU
            pages[kv] = llm.scheduler.stats()["total_pages"]
    assert pages["fp8"] == pytest.approx(4 * pages["auto"], abs=4)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM(str(model_dir), kv_cache_dtype="int4")
