"""transformers_minisgl: a patched model.generate returns what transformers' own generate returns.

The reference is always the unpatched transformers generate on the same model object
(type(model).generate), fp32 on the CPU, greedy.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

from transformers_minisgl import (
    UnsupportedGenerationError,
    minisgl_generate,
    patch_generate,
    sync_weights,
    unpatch_generate,
)
from transformers_minisgl.generate import prepare

ENGINE = dict(kv_cache_gb=0.1, max_running_requests=16)  # small: several engines live in one process
TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def add(a, b):",
    "Water boils at a temperature of",
]
NEW = 12


def load(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def patched(request, tiny_model_dir):
    model, tokenizer = load(tiny_model_dir(request.param))
    patch_generate(model, **ENGINE)
    yield model, tokenizer
    unpatch_generate(model)


def hf_generate(model, *args, **kwargs):
    """transformers' own generate, whatever the instance's generate is."""
    return type(model).generate(model, *args, **kwargs)


def batch(tokenizer, texts=TEXTS):
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any(), "the batch must be left-padded"
    return dict(input_ids=enc.input_ids, attention_mask=enc.attention_mask)


def assert_same(model, **kwargs):
    ref = hf_generate(model, **kwargs)
    out = model.generate(**kwargs)
    assert out.dtype == torch.long and out.device == ref.device
    assert out.shape == ref.shape, f"{tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.equal(out, ref), f"\nminisgl:\n{out}\ntransformers:\n{ref}"
    return ref


def early_stop_tokens(ref: torch.Tensor, prompt_len: int, count: int) -> list[int]:
    """Tokens that end some rows mid-way but not every row: first new tokens (after the first) of different rows."""
    new = ref[:, prompt_len:].tolist()
    picked: list[int] = []
    for row in new:
        for tok in row[2:-2]:
            if tok not in picked and not all(tok in other for other in new):
                picked.append(tok)
                break
        if len(picked) == count:
            return picked
    pytest.skip("no token ends some rows early and not others")


def test_greedy_left_padded_batch_matches_transformers(patched):
    model, tokenizer = patched
    assert_same(model, **batch(tokenizer), max_new_tokens=NEW, do_sample=False)
    # Again: the prompts now come from the prefix cache.
    assert_same(model, **batch(tokenizer), max_new_tokens=NEW, do_sample=False)


def test_early_eos_pads_finished_rows_and_stops_when_all_are_done(patched):
    model, tokenizer = patched
    inputs = batch(tokenizer)
    prompt_len = inputs["input_ids"].shape[1]
    free = hf_generate(model, **inputs, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    eos = early_stop_tokens(free, prompt_len, 1)[0]
    ref = assert_same(model, **inputs, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=1)
    assert (ref[:, prompt_len:] == eos).any(dim=1).any() and (ref[:, -1] == 1).any(), "no row finished early"
    # min_new_tokens masks eos until enough tokens exist.
    assert_same(model, **inputs, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=1, min_new_tokens=6)


def test_eos_token_id_list_and_pad_falls_back_to_eos(patched):
    model, tokenizer = patched
    inputs = batch(tokenizer)
    prompt_len = inputs["input_ids"].shape[1]
    free = hf_generate(model, **inputs, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    eos = early_stop_tokens(free, prompt_len, 2)
    model.generation_config.pad_token_id, saved = None, model.generation_config.pad_token_id
    try:
        assert_same(model, **inputs, max_new_tokens=NEW, eos_token_id=eos)  # pad = eos[0], as transformers does
    finally:
        model.generation_config.pad_token_id = saved


def test_num_return_sequences_and_max_length(patched):
    model, tokenizer = patched
    inputs = batch(tokenizer)
    # transformers refuses greedy with num_return_sequences > 1; top_k=1 sampling is greedy and allowed.
    with pytest.raises(ValueError, match="num_return_sequences"):
        model.generate(**inputs, max_new_tokens=6, num_return_sequences=3)
    ref = assert_same(model, **inputs, max_new_tokens=6, do_sample=True, top_k=1, num_return_sequences=3)
    assert ref.shape[0] == 3 * len(TEXTS)
    ref = assert_same(model, **inputs, max_length=inputs["input_ids"].shape[1] + 5)
    assert ref.shape[1] == inputs["input_ids"].shape[1] + 5


def stop_word(tokenizer, ref: torch.Tensor, prompt_len: int) -> str:
    """A word the first row generates after a few tokens."""
    words = [tokenizer.decode([t]).strip() for t in ref[0, prompt_len + 3 :].tolist()]
    word = next((w for w in words if len(w) >= 2 and w.isalpha()), None)
    if word is None:
        pytest.skip("no word-like token in the first row")
    return word


def test_stop_strings_stop_rows_like_transformers(patched):
    model, tokenizer = patched
    inputs = batch(tokenizer)
    prompt_len = inputs["input_ids"].shape[1]
    free = hf_generate(model, **inputs, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    word = stop_word(tokenizer, free, prompt_len)
    assert_same(model, **inputs, max_new_tokens=NEW, stop_strings=[word], tokenizer=tokenizer)


def test_smollm2_matches_transformers_with_every_option_at_once(smollm2_dir):
    model, tokenizer = load(smollm2_dir)
    inputs = batch(tokenizer)
    prompt_len = inputs["input_ids"].shape[1]
    with minisgl_generate(model, **ENGINE):
        free = assert_same(model, **inputs, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
        eos = early_stop_tokens(free, prompt_len, 2)
        ref = assert_same(
            model,
            **inputs,
            max_length=prompt_len + 10,
            eos_token_id=eos,
            do_sample=True,
            top_k=1,
            num_return_sequences=2,
            stop_strings=[stop_word(tokenizer, free, prompt_len)],
            tokenizer=tokenizer,
        )
    assert ref.shape[0] == 2 * len(TEXTS)
    assert any(set(row) & set(eos) for row in ref[:, prompt_len:].tolist()), "no row finished early"


def test_return_dict_in_generate_has_transformers_structure(patched):
    model, tokenizer = patched
    inputs = batch(tokenizer)
    ref = hf_generate(model, **inputs, max_new_tokens=5, return_dict_in_generate=True)
    out = model.generate(**inputs, max_new_tokens=5, return_dict_in_generate=True)
    assert type(out) is type(ref)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.scores is None and ref.scores is None
    assert set(out.keys()) <= set(ref.keys())  # past_key_values stays None: the KV lives in minisgl's pool


def test_text_iterator_streamer_yields_the_same_text(patched):
    model, tokenizer = patched
    inputs = tokenizer(["Once upon a time"], return_tensors="pt")
    texts = []
    for generate in (lambda **kw: hf_generate(model, **kw), model.generate):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        generate(**inputs, max_new_tokens=NEW, streamer=streamer)
        texts.append("".join(streamer))
    assert texts[0] and texts[0] == texts[1]


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.tolist())

    def end(self):
        self.calls.append("end")


def test_streamer_gets_the_prompt_then_one_column_per_step_then_end(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer, TEXTS[:2])
    prompt_len = inputs["input_ids"].shape[1]
    free = hf_generate(model, **inputs, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    eos = early_stop_tokens(free, prompt_len, 1)[0]
    records = []
    with minisgl_generate(model, **ENGINE):
        for generate in (lambda **kw: hf_generate(model, **kw), model.generate):
            streamer = RecordingStreamer()
            generate(**inputs, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=1, streamer=streamer)
            records.append(streamer.calls)
    assert records[0] == records[1]


def test_generation_follows_weights_changed_in_memory(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer)
    kwargs = dict(**inputs, max_new_tokens=8, do_sample=False)
    with minisgl_generate(model, **ENGINE):
        before = assert_same(model, **kwargs)
        with torch.no_grad():  # changes the prompts' KV too: the prefix cache must not serve the old one
            model.model.layers[0].self_attn.v_proj.weight.mul_(3.0)
            model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
        after = assert_same(model, **kwargs)
        assert not torch.equal(before, after)
        # A write PyTorch does not count (through .data) is picked up by sync_weights.
        model.lm_head.weight.data.mul_(-1.0)
        sync_weights(model)
        assert_same(model, **kwargs)


def test_the_engine_follows_the_model_to_another_dtype(tiny_model_dir):
    """model.to(...) after patching: generate runs where the model now is, as transformers' would (the engine kept
    its first dtype, and on a GPU a model moved with .cuda() went on generating on the CPU)."""
    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer)
    kwargs = dict(**inputs, max_new_tokens=8, do_sample=False)
    with minisgl_generate(model, **ENGINE):
        assert_same(model, **kwargs)
        model.to(torch.bfloat16)
        model.generate(**kwargs)
        engine = model._minisgl_generate.llm.scheduler.engine.model
        assert {p.dtype for p in engine.parameters()} == {torch.bfloat16}
        model.to(torch.float32)  # back, with the weights rounded to bfloat16 on the way
        assert_same(model, **kwargs)
        assert {p.dtype for p in engine.parameters()} == {torch.bfloat16}  # the bf16 engine was shut down, not reused
        assert {p.dtype for p in model._minisgl_generate.llm.scheduler.engine.model.parameters()} == {torch.float32}


def test_a_custom_max_length_criteria_sets_the_length_as_in_transformers(tiny_model_dir):
    """stopping_criteria=[MaxLengthCriteria(...)] takes the place of the one transformers builds from max_new_tokens,
    longer or shorter (the patched generate stopped at max_new_tokens regardless)."""
    from transformers import MaxLengthCriteria, StoppingCriteriaList

    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer, TEXTS[:2])
    prompt_len = inputs["input_ids"].shape[1]
    with minisgl_generate(model, fallback=False, **ENGINE):
        for max_length, max_new in ((prompt_len + 12, 5), (prompt_len + 3, 10)):
            criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=max_length)])
            ref = assert_same(model, **inputs, max_new_tokens=max_new, eos_token_id=None, stopping_criteria=criteria)
            assert ref.shape[1] == max_length


def test_a_custom_eos_criteria_replaces_eos_token_id_as_in_transformers(tiny_model_dir):
    """stopping_criteria=[EosTokenCriteria(b)] with eos_token_id=a: transformers stops rows on b only (and pads them);
    the engine stopped on a too and the call failed."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import EosTokenCriteria

    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer)
    prompt_len = inputs["input_ids"].shape[1]
    free = hf_generate(model, **inputs, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    ignored, stop = early_stop_tokens(free, prompt_len, 2)
    with minisgl_generate(model, fallback=False, **ENGINE):
        ref = assert_same(
            model,
            **inputs,
            max_new_tokens=NEW,
            eos_token_id=ignored,
            pad_token_id=1,
            stopping_criteria=StoppingCriteriaList([EosTokenCriteria(eos_token_id=stop)]),
        )
    assert (ref[:, prompt_len:] == ignored).any() and (ref[:, -1] == 1).any()


def test_unpatch_restores_transformers_generate(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir("qwen3"))
    original = model.generate
    patch_generate(model, **ENGINE)
    assert model.generate.__func__ is not original.__func__
    unpatch_generate(model)
    assert "generate" not in vars(model) and model.generate.__func__ is original.__func__
    assert not hasattr(model, "_minisgl_generate")
    with minisgl_generate(model, **ENGINE):
        assert hasattr(model, "_minisgl_generate")
    assert "generate" not in vars(model)


def test_unsupported_options_fall_back_with_one_warning(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer, TEXTS[:2])
    ref = hf_generate(model, **inputs, max_new_tokens=4, num_beams=2)
    with minisgl_generate(model, **ENGINE):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = model.generate(**inputs, max_new_tokens=4, num_beams=2)
            second = model.generate(**inputs, max_new_tokens=4, num_beams=2)
        ours = [w for w in caught if "minisgl cannot run" in str(w.message)]
        assert len(ours) == 1 and "beam_search" in str(ours[0].message)
        assert torch.equal(first, ref) and torch.equal(second, ref)
        # output_scores needs transformers' per-step logits: it falls back too, scores included.
        with pytest.warns(UserWarning, match="output_scores"):
            out = model.generate(**inputs, max_new_tokens=3, return_dict_in_generate=True, output_scores=True)
        assert len(out.scores) == 3


def test_fallback_false_raises_a_typed_error(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer, TEXTS[:2])
    with minisgl_generate(model, fallback=False, **ENGINE):
        with pytest.raises(UnsupportedGenerationError, match="no_repeat_ngram|NoRepeatNGram"):
            model.generate(**inputs, max_new_tokens=4, no_repeat_ngram_size=2)
        model.generate(**inputs, max_new_tokens=4)  # supported calls still run


def test_parameters_resolve_like_transformers(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer, TEXTS[:2])

    def params(**kwargs):
        kwargs = {**inputs, **kwargs}
        return prepare(model, None, kwargs.pop("generation_config", None), None, None, kwargs, 512, frozenset()).params

    sampled = params(do_sample=True, max_new_tokens=5)
    assert sampled.top_k == 50 and sampled.temperature == 1.0 and sampled.max_tokens == 5  # transformers' defaults
    assert params(max_new_tokens=5, temperature=0.3, top_k=7).greedy  # do_sample=False: greedy whatever else
    config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=9)
    p = params(generation_config=config)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.7, -1, 0.9, 9)
    p = params(generation_config=config, temperature=0.5, repetition_penalty=1.3)  # call kwargs win
    assert (p.temperature, p.repetition_penalty) == (0.5, 1.3)
    model.generation_config.max_new_tokens = 7  # the model's own generation_config fills what the call leaves out
    assert params().max_tokens == 7 and params(max_new_tokens=3).max_tokens == 3
    assert params(generation_config=GenerationConfig(do_sample=True)).max_tokens == 7


def test_repetition_penalty_and_sampling_on_a_padded_batch(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer)
    with minisgl_generate(model, **ENGINE):
        assert_same(model, **inputs, max_new_tokens=NEW, repetition_penalty=1.3)
        out = model.generate(**inputs, max_new_tokens=6, do_sample=True, top_p=0.9, num_return_sequences=2)
    assert out.shape[0] == 2 * len(TEXTS)
    assert torch.equal(out[:, : inputs["input_ids"].shape[1]], inputs["input_ids"].repeat_interleave(2, dim=0))


def test_set_seed_reproduces_a_sampled_call_as_in_transformers(tiny_model_dir):
    from transformers import set_seed

    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer, [TEXTS[0]] * 3 + [TEXTS[1]])  # identical prompts: each row draws its own sample

    def sampled(seed):
        set_seed(seed)
        return model.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=0, num_return_sequences=2)

    with minisgl_generate(model, **ENGINE):
        first, again, other = sampled(1234), sampled(1234), sampled(1)
        set_seed(1234)
        draws = [model.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=0) for _ in range(2)]
    assert torch.equal(first, again)  # transformers' contract: set_seed(s) then generate() gives the same sample
    assert not torch.equal(first, other)
    assert not torch.equal(draws[0], draws[1])  # consecutive calls draw afresh, as transformers' do
    new = first[:, inputs["input_ids"].shape[1] :].tolist()
    assert len({tuple(row) for row in new[:6]}) > 1  # identical prompts and their n samples are not one stream


def test_custom_logits_processors_compose_with_the_configs_like_transformers(tiny_model_dir):
    """logits_processor=[...] runs before the warpers transformers builds from the config, and on top of them:
    a custom temperature leaves a greedy call greedy, and a custom top-k narrows the config's."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer, TEXTS[:3])
    with minisgl_generate(model, fallback=False, **ENGINE):
        assert_same(
            model, **inputs, max_new_tokens=6, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)])
        )
        # do_sample with transformers' default top_k=50 and a custom top-k of 1: greedy in transformers.
        assert_same(
            model,
            **inputs,
            max_new_tokens=6,
            do_sample=True,
            logits_processor=LogitsProcessorList([TopKLogitsWarper(1)]),
        )


def minisgl_distribution(logits: torch.Tensor, params) -> torch.Tensor:
    """The distribution minisgl's sampler draws the next token from (no penalties): softmax at the temperature,
    then its min-p / top-k / top-p filter, renormalised."""
    from minisgl.core import Req
    from minisgl.engine.sampler import SamplingInfo, _filter_probs

    reqs = [Req(f"r{i}", [1], params, 1) for i in range(logits.shape[0])]
    info = SamplingInfo.from_reqs(reqs, logits.shape[-1], logits.device)
    if info.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = _filter_probs(torch.softmax(logits.float() / info.temperature, dim=-1), info)
    return probs / probs.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize(
    "kwargs,custom,runs",
    [
        (dict(temperature=0.05, top_k=0, top_p=0.6), [], True),
        (dict(temperature=0.05, top_k=20, top_p=0.92, min_p=0.05), [], False),  # transformers: min-p after top-p
        (dict(temperature=0.7, top_k=0), [("TemperatureLogitsWarper", 0.1)], True),  # temperatures multiply
        (dict(temperature=0.05, top_k=40), [("TopKLogitsWarper", 3)], True),  # the smaller k wins
        (dict(temperature=0.05, top_k=0), [("TopPLogitsWarper", 0.6)], False),  # top-p before the temperature
        (dict(temperature=0.05, top_k=0), [("MinPLogitsWarper", 0.5)], False),  # min-p before the temperature
        # The order minisgl samples in: temperature, min-p, then top-p over what min-p kept.
        (dict(top_k=0, top_p=0.92), [("TemperatureLogitsWarper", 0.05), ("MinPLogitsWarper", 0.05)], True),
    ],
)
def test_sampling_draws_from_transformers_distribution_or_falls_back(tiny_model_dir, kwargs, custom, runs):
    """The first step's distribution: transformers' processed scores (output_scores) against minisgl's sampler
    fed the raw logits (output_logits) and the SamplingParams the call resolves to; or the call is refused."""
    from transformers.generation import logits_process as lp

    model, tokenizer = load(tiny_model_dir("llama"))
    inputs = batch(tokenizer)
    kwargs = dict(**inputs, do_sample=True, max_new_tokens=1, **kwargs)
    processors = lp.LogitsProcessorList([getattr(lp, name)(value) for name, value in custom])
    if not runs:  # patched generate hands this call to transformers
        with pytest.raises(UnsupportedGenerationError):
            prepare(model, None, None, processors, None, kwargs, 512, frozenset())
        return
    params = prepare(model, None, None, processors, None, kwargs, 512, frozenset()).params
    ref = hf_generate(
        model,
        **kwargs,
        logits_processor=processors,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    want = torch.softmax(ref.scores[0].float(), dim=-1)
    got = minisgl_distribution(ref.logits[0], params)
    assert torch.equal(got > 0, want > 0), (
        f"kept {(got > 0).sum(-1).tolist()} tokens, transformers {(want > 0).sum(-1).tolist()}"
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
