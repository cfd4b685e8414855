"""The offline engine against HF transformers: greedy parity, caches, chunking, paging, sampling, errors."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl import LLM, SamplingParams, errors

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
MAX_NEW = 12


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """8 prompts of different lengths; the last four share a 24-token prefix with each other."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(24)]
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (3, 9, 17, 40)]
    prompts += [shared + [rng.randrange(10, vocab) for _ in range(n)] for n in (1, 5, 13, 30)]
    return prompts


def hf_greedy(model_dir, prompts: list[list[int]], max_new: int, **gen_kwargs) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new,
                pad_token_id=eos if isinstance(eos, int) else (eos or [0])[0],
                **gen_kwargs,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


def trim_after_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@pytest.fixture(scope="module", params=FAMILIES)
def family_ref(request, tiny_model_dir):
    model_dir = tiny_model_dir(request.param)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    prompts = make_prompts(vocab)
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    return model_dir, prompts, ref


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def assert_parity(llm: LLM, prompts, ref) -> list:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    eos = set(llm.model_config.eos_token_ids)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == trim_after_eos(r, eos), f"prompt {i} (len {len(prompts[i])}) diverged"
    llm.check_integrity()
    return outs


# Every family runs every feature: radix and naive caches, page sizes 1 and 16, chunked prefill.
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(cache="radix", page_size=1),
        dict(cache="radix", page_size=16, max_prefill_tokens=16),  # chunked: smaller than the prompts
        dict(cache="naive", page_size=16),
    ],
    ids=["radix-p1", "radix-p16-chunked", "naive-p16"],
)
def test_greedy_generate_matches_hf_transformers(family_ref, engine_kwargs):
    model_dir, prompts, ref = family_ref
    llm = LLM(str(model_dir), **engine_kwargs)
    first = assert_parity(llm, prompts, ref)
    second = assert_parity(llm, prompts, ref)  # the prompts are now in the prefix cache
    if engine_kwargs["cache"] == "radix":
        assert sum(o.cached_tokens for o in second) > 0
        # Shared 24-token prefix of the last four prompts: within the first run, later ones hit it too.
        assert sum(o.cached_tokens for o in first) > 0
    else:
        assert all(o.cached_tokens == 0 for o in first + second)


def test_decode_with_the_dense_kv_copy_matches_hf_as_the_batch_changes(family_ref, monkeypatch):
    """CPU decode appends to a dense copy of the batch's KV while the batch is unchanged and rebuilds it
    from the pool when requests join (3 running at a time) or finish (EOS): tokens still equal HF's."""
    from minisgl.attention.torch_native import DecodeMirror

    modes = []
    plan = DecodeMirror.plan

    def spy(self, *args, **kwargs):
        modes.append(plan(self, *args, **kwargs))
        return modes[-1]

    monkeypatch.setattr(DecodeMirror, "plan", spy)
    model_dir, prompts, ref = family_ref
    assert_parity(LLM(str(model_dir), max_running_requests=3), prompts, ref)
    assert modes.count("append") > modes.count("full") >= 3  # rebuilt at each change, appended in between


def test_smollm2_greedy_matches_hf_transformers(smollm2_dir):
    prompts_text = [
        "The capital of France is",
        "Once upon a time",
        "def fibonacci(n):",
        "The three primary colors are",
        "In 1492, Columbus",
        "Water boils at",
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
        "Machine learning is a field of study that",
    ]
    llm = LLM(str(smollm2_dir), page_size=16)
    prompts = [llm.tokenizer.encode(t) for t in prompts_text]
    ref = hf_greedy(smollm2_dir, prompts, 16)
    assert_parity_n(llm, prompts, ref, 16)


def assert_parity_n(llm, prompts, ref, n):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    eos = set(llm.model_config.eos_token_ids)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == trim_after_eos(r, eos), f"prompt {i} diverged"
    llm.check_integrity()


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return LLM("smollm2")


def test_smollm2_chat_answers_paris(smollm2):
    out = smollm2.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=32)
    )
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")
    smollm2.check_integrity()


def test_chat_many_conversations_returns_a_list(smollm2):
    convs = [[{"role": "user", "content": q}] for q in ("Hi!", "What is 2+2?")]
    outs = smollm2.chat(convs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert isinstance(outs, list) and len(outs) == 2
    smollm2.check_integrity()


def test_chat_template_kwargs_reach_the_template(smollm2, monkeypatch):
    # A template with Qwen3's switch (SmolLM2's own has no variable); HF renders the reference.
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    )
    tok = smollm2.tokenizer
    monkeypatch.setattr(tok, "chat_template", template)
    messages = [{"role": "user", "content": "Hi"}]
    out = smollm2.chat(messages, SamplingParams(max_tokens=1), chat_template_kwargs={"enable_thinking": False})
    ref = tok.encode(tok.apply_chat_template(messages, tokenize=False, enable_thinking=False), add_special_tokens=False)
    assert out.prompt_token_ids == ref and tok.decode(ref).endswith("</think>\n\n")
    with pytest.raises(errors.InvalidRequestError, match="tokenize"):
        smollm2.chat(messages, chat_template_kwargs={"tokenize": True})
    smollm2.check_integrity()


def test_same_seed_same_output_different_seed_different_output(smollm2):
    prompt = "Write a short poem about the ocean."
    p = lambda seed: SamplingParams(temperature=1.0, max_tokens=24, seed=seed)  # noqa: E731
    a = smollm2.generate([prompt], p(1), use_tqdm=False)[0].token_ids
    others = ["Tell me a joke.", "List some fruits:", "Describe a cat."]
    # Same seed inside a different batch: the same draw.
    b = smollm2.generate(others + [prompt], [p(7)] * 3 + [p(1)], use_tqdm=False)[-1].token_ids
    c = smollm2.generate([prompt], p(2), use_tqdm=False)[0].token_ids
    assert a == b
    assert a != c
    smollm2.check_integrity()


def test_stop_strings_are_trimmed_and_stop_reason_reported(smollm2):
    ref = smollm2.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[
        0
    ]
    word = ref.text.split()[1] if len(ref.text.split()) > 1 else ref.text.strip()[:3]
    out = smollm2.generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=16, stop=[word]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.outputs[0].matched_stop == word
    assert word not in out.text and ref.text.startswith(out.text)
    smollm2.check_integrity()


def min_tokens_stop_reference(tokenizer, free_ids: list[int], stop: str, min_tokens: int) -> str:
    """vLLM's rule, by brute force over the unconstrained greedy answer: the first stop string that ends in the text of
    the min_tokens-th token or later cuts the text; earlier ones do not count."""
    boundary = len(tokenizer.decode(free_ids[: min_tokens - 1], skip_special_tokens=True))
    start = max(0, boundary - len(stop) + 1)  # an occurrence from here on ends after the boundary
    for k in range(min_tokens, len(free_ids) + 1):
        text = tokenizer.decode(free_ids[:k], skip_special_tokens=True)
        if text.find(stop, start) >= 0:
            return text[: text.find(stop, start)]
    return tokenizer.decode(free_ids, skip_special_tokens=True)


def test_min_tokens_holds_back_stop_strings_too_as_vllm(smollm2):
    prompt = ["The capital of France is"]
    free = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    first_word = free.text.split()[0]  # a stop string the first token already completes
    for min_tokens in (0, 1, 6):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[first_word], min_tokens=min_tokens)
        out = smollm2.generate(prompt, params, use_tqdm=False)[0]
        want = min_tokens_stop_reference(smollm2.tokenizer, free.token_ids, first_word, max(min_tokens, 1))
        assert out.text == want, min_tokens
        assert len(out.token_ids) >= min_tokens and free.token_ids[: len(out.token_ids)] == out.token_ids
    smollm2.check_integrity()


def test_stop_token_ids_and_max_tokens(smollm2):
    ref = smollm2.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 8
    stop_tok = ref.token_ids[3]
    out = smollm2.generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_tok]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: ref.token_ids.index(stop_tok) + 1]
    # the stop token's id stays in token_ids, its text is left out (vLLM's and SGLang's default)
    assert out.text == smollm2.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
    chat = smollm2.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=False),
        use_tqdm=False,
    )
    if chat.finish_reason == "stop":  # ended by EOS: its text (<|im_end|>) is not in the answer either
        assert chat.text == smollm2.tokenizer.decode(chat.token_ids[:-1], skip_special_tokens=False)
        assert chat.token_ids[-1] in smollm2.eos_token_ids


def test_n_samples_share_the_prompt_and_logprobs_are_reported(smollm2):
    out = smollm2.generate(
        ["Tell me about the moon."],
        SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=3, logprobs=2),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 3
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        lp, alts = o.logprobs[0]
        assert lp <= 0 and len(alts) == 2
    smollm2.check_integrity()


def test_prompt_logprobs_match_hf_and_skip_the_prefix_cache(tiny_model_dir):
    """Per prompt token: log_softmax of HF's (fp32) logits at the previous position, top-k alternatives too;
    across prefill chunks, with a cached prefix (recomputed: cached tokens have no logits), and for n > 1."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rng = random.Random(7)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(10, vocab) for _ in range(40)]
    prompts = [shared + [rng.randrange(10, vocab) for _ in range(n)] for n in (5, 30)] + [[rng.randrange(10, vocab)]]
    llm = LLM(str(model_dir), max_prefill_tokens=16)  # 45- and 70-token prompts: several chunks each
    llm.generate([shared + [1, 2]], SamplingParams(max_tokens=1), use_tqdm=False)  # the shared prefix is cached
    outs = llm.generate(
        prompts,
        [
            SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
            SamplingParams(temperature=1.0, max_tokens=2, prompt_logprobs=0, n=2, seed=1),
            SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
        ],
        use_tqdm=False,
    )
    for prompt, out, k in zip(prompts, outs, (3, 0, 2)):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        assert out.cached_tokens == 0  # computed, not read from the cache
        for t in range(1, len(prompt)):
            lp, alts = got[t]
            assert lp == pytest.approx(float(ref[t - 1, prompt[t]]), abs=1e-4)
            top = ref[t - 1].topk(k) if k else None
            assert [a for a, _ in alts] == (top.indices.tolist() if k else [])
            assert [v for _, v in alts] == pytest.approx(top.values.tolist() if k else [], abs=1e-4)
    assert outs[1].outputs[1].token_ids  # the second sample ran too (it reads the prompt from the cache)
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None
    llm.check_integrity()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_embed_is_hf_last_hidden_state_of_the_last_token_normalised(tiny_model_dir, family):
    """LLM.embed against HF: the last layer's hidden state (after the final norm) at the last prompt token,
    L2-normalised; across prefill chunks, with a cached prefix (the prefix cache serves embeddings too) and mixed with
    generation."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir(family)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rng = random.Random(3)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(10, vocab) for _ in range(40)]
    prompts = [shared + [rng.randrange(10, vocab) for _ in range(n)] for n in (3, 30)] + [[rng.randrange(10, vocab)]]
    llm = LLM(str(model_dir), max_prefill_tokens=16)  # several chunks per prompt
    llm.generate([shared + [1, 2]], SamplingParams(max_tokens=1), use_tqdm=False)  # the shared prefix is cached
    got = llm.embed(prompts)
    for prompt, vector in zip(prompts, got):
        with torch.no_grad():
            last = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        ref = torch.nn.functional.normalize(last, dim=-1)
        assert len(vector) == hf.config.hidden_size
        torch.testing.assert_close(torch.tensor(vector), ref, atol=2e-5, rtol=1e-4)
    again = llm.embed(prompts[1])[0]  # now its prompt is cached but for the last token
    torch.testing.assert_close(torch.tensor(again), torch.tensor(got[1]), atol=1e-5, rtol=1e-4)
    # Generation next to an embedding request (same batches) is unchanged by it.
    alone = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].token_ids
    llm.scheduler.add_request("e", prompts[2], SamplingParams(), embed=True)
    llm.scheduler.add_request("g", prompts[0], SamplingParams(temperature=0, max_tokens=4))
    outs: dict[str, list] = {"e": [], "g": []}
    while llm.has_work:
        for out in llm.step():
            outs[out.rid].append(out)
    assert [t for o in outs["g"] for t in o.new_token_ids] == alone
    assert len(outs["e"]) == 1 and outs["e"][0].finished
    torch.testing.assert_close(torch.tensor(outs["e"][0].embedding), torch.tensor(got[2]), atol=1e-5, rtol=1e-4)
    with pytest.raises(errors.InvalidRequestError):
        llm.embed([])
    llm.check_integrity()


def test_repetition_penalty_matches_hf(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    from transformers import AutoConfig

    prompts = make_prompts(AutoConfig.from_pretrained(str(model_dir)).vocab_size, seed=5)[:3]
    ref = hf_greedy(model_dir, prompts, MAX_NEW, repetition_penalty=1.5)
    llm = LLM(str(model_dir))
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, repetition_penalty=1.5), use_tqdm=False
    )
    eos = set(llm.model_config.eos_token_ids)
    assert [o.token_ids for o in outs] == [trim_after_eos(r, eos) for r in ref]


def test_logit_bias_matches_hf_sequence_bias(tiny_model_dir):
    """OpenAI's logit_bias (string keys, as JSON sends them) against HF generate's sequence_bias with the same
    single-token biases: a forbidden favourite and a boosted outsider change the greedy output the same way."""
    model_dir = tiny_model_dir("llama")
    from transformers import AutoConfig

    prompts = make_prompts(AutoConfig.from_pretrained(str(model_dir)).vocab_size, seed=9)[:3]
    llm = LLM(str(model_dir))
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    favourite, outsider = greedy[0].token_ids[0], 17
    bias = {str(favourite): -100.0, str(outsider): 6.5}
    ref = hf_greedy(model_dir, prompts, MAX_NEW, sequence_bias={(favourite,): -100.0, (outsider,): 6.5})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, logit_bias=bias), use_tqdm=False)
    eos = set(llm.model_config.eos_token_ids)
    assert [o.token_ids for o in outs] == [trim_after_eos(r, eos) for r in ref]
    assert outs[0].token_ids != greedy[0].token_ids and favourite not in outs[0].token_ids
    for bad in ({"x": 1.0}, {"5": 101.0}, {"-1": 1.0}, [1, 2]):
        with pytest.raises(errors.InvalidRequestError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(errors.InvalidRequestError, match="logit_bias"):
        llm.generate(prompts[:1], SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    llm.check_integrity()


def test_small_kv_pool_retracts_and_all_64_requests_finish_identically(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    rng = random.Random(1)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(4, 30))] for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    big = LLM(str(model_dir)).generate(prompts, params, use_tqdm=False)
    small_llm = LLM(str(model_dir), num_pages=200, page_size=4)  # 800 slots for ~64 * 41 tokens
    small = small_llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in small] == [o.token_ids for o in big]
    assert all(o.finish_reason == "length" for o in small)
    small_llm.check_integrity()


def test_long_prompts_that_each_fit_a_small_pool_alone_all_finish_as_with_a_big_pool(tiny_model_dir):
    """Chunked prefills of the next prompts must not starve the decoding request of pages: it used to be cut short
    ("length", after a single token at times) when a partly prefilled prompt held the rest of the pool. Each
    request fits the pool alone (200 + 40 tokens, 256 slots), so each finishes as it does with a big pool."""
    model_dir = tiny_model_dir("llama")
    prompts = [[(17 * i + j) % 900 + 20 for j in range(200)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = LLM(str(model_dir)).generate(prompts, params, use_tqdm=False)
    small_llm = LLM(str(model_dir), num_pages=64, page_size=4, max_prefill_tokens=32)
    small = small_llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in small] == [o.token_ids for o in big]
    assert [o.finish_reason for o in small] == ["length"] * 4
    assert [o.cached_tokens for o in small] == [o.cached_tokens for o in big]
    small_llm.check_integrity()


def test_generate_keeps_no_per_step_outputs_alive(tiny_model_dir, monkeypatch):
    """generate gathers each sequence's tokens into one list and drops the per-step TokenOutputs as it reads them.
    Kept, they were ~2 objects per generated token, and Python's full garbage collections over them stopped the loop
    that feeds the GPU for ~0.3 s at a time (measured on one H100)."""
    import gc

    from minisgl.core import TokenOutput

    llm = LLM(str(tiny_model_dir("llama")))
    sched, step, alive = llm.scheduler, llm.scheduler.step, []

    def counting_step():
        outs = step()
        if not sched.has_work:  # the last step: every output so far would still be held
            alive.append(sum(isinstance(o, TokenOutput) for o in gc.get_objects()))
        return outs

    monkeypatch.setattr(sched, "step", counting_step)
    prompts = [[11 + i, 12, 13] for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [40] * 8
    assert alive and alive[-1] <= 2 * len(prompts), f"{alive[-1]} TokenOutputs alive for 8 x 40 tokens"


def test_abort_by_request_id_frees_pages(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("qwen2")))
    sched = llm.scheduler
    sched.add_request("a", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    sched.add_request("b", list(range(40, 60)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    outs = sched.step() + sched.step()
    sched.abort("a")
    while sched.has_work:
        outs += sched.step()
    final = {o.rid: o for o in outs if o.finished}
    assert final["a"].finish_reason == "abort" and final["b"].finish_reason == "length"
    llm.check_integrity()
    assert sched.stats()["req_pages"] == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(temperature=-0.5),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(n=0),
        dict(temperature="hot"),
        dict(temperature=float("nan")),
        dict(repetition_penalty=float("nan")),
        dict(top_p=float("inf")),
        dict(seed=2**70),
        dict(seed=1.5),
        dict(stop_token_ids=["a"]),
        dict(stop_token_ids="12"),
        dict(n=True),
        dict(max_tokens=True),
        dict(min_tokens="3"),
    ],
)
def test_bad_sampling_params_raise_invalid_request(kwargs):
    with pytest.raises(errors.InvalidRequestError):
        SamplingParams(**kwargs)
    with pytest.raises(errors.InvalidRequestError):  # as a client's mapping: the same typed error, never a 500
        SamplingParams.from_dict(kwargs)


def test_bad_requests_raise_typed_errors_and_leak_nothing(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), max_seq_len=64)
    with pytest.raises(errors.InvalidRequestError):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(errors.InvalidRequestError):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(errors.PromptTooLongError):
        # The good prompt must not be queued either: nothing fails half-way.
        llm.generate([[5, 6, 7], list(range(10, 110))], use_tqdm=False)
    assert not llm.scheduler.has_work
    with pytest.raises(errors.ConfigError):
        LLM(str(tiny_model_dir("llama")), cache="lru")
    llm.check_integrity()


@pytest.mark.parametrize(
    "backend,match",
    [
        ("xqa,flashinfer", "decode kernel"),
        ("xqa", "needs a CUDA GPU"),
        ("flashinfer,xqa", "needs a CUDA GPU"),
        ("flash", "unknown attention backend"),
        ("a,b,c", "NAME or PREFILL,DECODE"),
    ],
)
def test_attention_backend_names_are_checked_before_anything_loads(tiny_model_dir, backend, match):
    """XQA (attention/xqa.py) only decodes: as a prefill backend it is refused; alone it means 'flashinfer,xqa',
    which, like any GPU backend, is refused on the CPU with a clear error."""
    with pytest.raises(errors.ConfigError, match=match):
        LLM(str(tiny_model_dir("llama")), attention_backend=backend)


MARK = 7  # a prompt holding this token id makes the patched forward raise (the other prompts use ids >= 10)


def _failing_forward(engine, phases: set[str]):
    """engine.forward that raises like a kernel this CPU lacks when its batch (of one of `phases`) holds a MARK
    prompt."""
    forward = engine.forward

    def run(batch):
        if batch.phase.value in phases and any(MARK in r.input_ids[: r.prompt_len] for r in batch.reqs):
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")
        return forward(batch)

    return run


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_failing_forward_fails_its_batch_frees_its_pages_and_the_engine_goes_on(
    tiny_model_dir, monkeypatch, phase, overlap
):
    model_dir = tiny_model_dir("llama")
    extra = {"extra": {"overlap_on_cpu": True}} if overlap else {"disable_overlap": True}
    llm = LLM(str(model_dir), page_size=4, **extra)
    sched = llm.scheduler
    monkeypatch.setattr(sched.engine, "forward", _failing_forward(sched.engine, {phase}))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    early, bad, late = list(range(10, 40)), [11, MARK, 13, 14, 15], list(range(50, 60))
    sched.add_request("early", early, params)
    outs = sched.step() + sched.step()  # "early" decodes before the others arrive
    sched.add_request("bad", bad, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, n=2))
    sched.add_request("late", late, params)
    while sched.has_work:
        outs += sched.step()
    final = {(o.rid, o.index): o for o in outs if o.finished}
    assert set(final) == {("early", 0), ("bad", 0), ("bad", 1), ("late", 0)}  # every sequence is answered
    for index in (0, 1):
        assert final["bad", index].finish_reason == "abort" and final["bad", index].error_type == "EngineError"
        assert "avx512bw" in final["bad", index].error
    # The batch's other requests fail with it: "late" shares the prefill; the decode batch holds everyone.
    failed = {rid for (rid, _), o in final.items() if o.error_type == "EngineError"}
    assert failed == ({"bad", "late"} if phase == "prefill" else {"bad", "late", "early"})
    llm.check_integrity()
    assert sched.stats()["req_pages"] == 0 and not sched.has_work
    # The engine still serves, and correctly: greedy output equals HF transformers'.
    monkeypatch.undo()
    got = llm.generate(
        [early, late], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False
    )
    ref = hf_greedy(model_dir, [early, late], MAX_NEW)
    assert [o.token_ids for o in got] == ref
    if phase == "prefill":  # "early" never shared a batch with the failing request: it finished normally
        tokens = [t for o in outs if o.rid == "early" for t in o.new_token_ids]
        assert tokens == ref[0] and final["early", 0].error is None
    llm.check_integrity()


def test_generate_raises_engine_error_when_a_forward_fails_and_leaves_nothing_in_flight(tiny_model_dir, monkeypatch):
    llm = LLM(str(tiny_model_dir("qwen2")))
    monkeypatch.setattr(llm.scheduler.engine, "forward", _failing_forward(llm.scheduler.engine, {"prefill", "decode"}))
    with pytest.raises(errors.EngineError, match="avx512bw"):
        llm.generate([[20, 21, 22], [30, MARK, 32]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.scheduler.has_work
    llm.check_integrity()
    assert llm.stats()["req_pages"] == 0
    assert (
        len(llm.generate([[20, 21, 22]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0].token_ids)
        == 4
    )


def test_an_engine_that_cannot_run_a_forward_fails_at_start_with_a_clear_error(tiny_model_dir, monkeypatch):
    """Start-up runs one tiny forward: a dtype/kernel this machine cannot run fails LLM(...) itself, not a request."""
    from minisgl.models.llama import LlamaForCausalLM

    def no_kernel(self, input_ids, positions):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(LlamaForCausalLM, "forward", no_kernel)
    with pytest.raises(
        errors.EngineError, match=r"bfloat16 on cpu cannot run on this machine.*avx_ne_convert.*--dtype"
    ):
        LLM(str(tiny_model_dir("llama")), dtype="bfloat16")


def test_bfloat16_runs_on_every_cpu(tiny_model_dir):
    """bf16 works whether or not this CPU can pack bf16 for oneDNN (AVX2-only CPUs use F.linear)."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16")
    out = llm.generate(
        [list(range(10, 30))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].token_ids) == 6 and out[0].error is None
    llm.check_integrity()


def test_unset_max_tokens_runs_to_the_end_of_the_context_window(tiny_model_dir):
    """SamplingParams(max_tokens=None) (what the daemon's front ends send) stops at the context window."""
    llm = LLM(str(tiny_model_dir("llama")), max_seq_len=64)
    prompt = list(range(10, 30))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(prompt) + len(out.token_ids) == 64
    assert out.finish_reason == "length"
    llm.check_integrity()


def test_vllm_prompt_dicts_are_prompts_and_other_inputs_raise_typed_errors(tiny_model_dir):
    """vLLM's {"prompt": text} and {"prompt_token_ids": ids} prompts answer as HF does on those tokens; a dict was
    read as its list of keys (the text "prompt" was generated for). Malformed prompts or sampling_params are typed
    errors, never a wrong answer or an AttributeError."""
    from transformers import AutoTokenizer

    model_dir = tiny_model_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text, ids = "The capital of France is", [17, 300, 4000, 52]
    ref = hf_greedy(model_dir, [tokenizer.encode(text), ids], 6)
    llm = LLM(str(model_dir), kv_cache_gb=0.05)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [tokenizer.encode(text), ids]
    assert [o.token_ids for o in outs] == ref
    assert llm.generate({"prompt": text}, greedy, use_tqdm=False)[0].token_ids == ref[0]
    for bad in (
        {"prompt": text, "multi_modal_data": {}},
        {"promt": text},
        {"prompt": ids},
        {"prompt_token_ids": text},
        [{"prompt": text}, 5],
        None,
        7,
        [None],
    ):
        with pytest.raises(errors.InvalidRequestError):
            llm.generate(bad, greedy, use_tqdm=False)
    for bad_params in ({"max_tokens": 3}, [{"max_tokens": 3}], "greedy"):
        with pytest.raises(errors.InvalidRequestError, match="SamplingParams"):
            llm.generate([text], bad_params, use_tqdm=False)
    assert not llm.has_work
    llm.check_integrity()
