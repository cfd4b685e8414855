"""Prompt size: a prompt is measured before it is tokenized, and tokenizing one never stalls the others.

Unit tests check the bounds of RequestPreparer against the real tokenizer's token counts (brute force). Daemon tests
send a 30 MB prompt (as text and as chat messages) and a prompt the bound lets through to the tokenizer beside a
normal stream, read in another process: its gaps between tokens stay under MAX_GAP_S (beyond the machine's own
jitter: the stream's gaps without the big request) and its tokens equal the offline engine's; the big request fails
with the typed error naming the limit; afterwards the daemon answers, no KV page is held and the text worker's
memory is back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Iterator

import psutil
import pytest
from tests.daemon_fixtures import daemon_runtime_dir, start_serve  # noqa: F401 - fixtures
from tests.test_faults_hostile import assert_no_page_leaked, settled

from minisgl import errors
from minisgl.client import Client
from minisgl.core import SamplingParams
from minisgl.runtime.protocol import Detokenize, Generate, Tokenize

NUM_PAGES = 2048
NORMAL_IDS = [4, 5, 6, 7]
STREAM_TOKENS = 400  # long enough to run through the big request (the tiny model's context is 512)
CHARS_PER_TOKEN = 8192  # the daemon's max_chars_per_token: a MB of text passes the bound and is tokenized
MAX_GAP_S = 1.0
MB = 2**20
WORDS = ["hello", "world", "token", "the", "of", "inference", "\n", "  ", "1234", "é", "日本", "🙂"]


def words(n: int, seed: int = 0, vocabulary: list[str] = WORDS) -> str:
    """n characters of mixed text (ASCII, whitespace runs, accents, CJK, emoji)."""
    import random

    rng = random.Random(seed)
    mean = sum(map(len, vocabulary)) / len(vocabulary) + 1
    out, size = [], 0
    while size < n:  # words drawn in bulk: 30 MB one at a time takes seconds
        out.append(" ".join(rng.choices(vocabulary, k=int((n - size) / mean) + 16)) + " ")
        size += len(out[-1])
    return "".join(out)[:n]


# ---------------------------------------------------------------------------- the bounds, against brute force


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def preparer_of(tokenizer: Any, context: int, **limits: Any) -> Any:
    from minisgl.config import EngineConfig
    from minisgl.runtime.tokenizer_worker import RequestPreparer

    config = EngineConfig(**limits).to_dict()
    return RequestPreparer(tokenizer, {"context_length": context, "model_type": "llama", "config": config})


def longest_entry_text(tokenizer: Any) -> str:
    """The text of the vocabulary's longest entry (for SmolLM2, a newline and 80 spaces)."""
    entry = max(tokenizer.get_vocab(), key=len)
    return tokenizer.convert_tokens_to_string([entry])


def near_bound_texts(tokenizer: Any, context: int, per_token: int) -> list[str]:
    """Texts of about the most characters the bound lets through, some of them at the fewest tokens there are."""
    limit = (context - 1) * per_token
    pieces = [longest_entry_text(tokenizer), "#" * 80, "=" * 64, " " * 100, "\n", "日本語", "🙂", words(500)]
    texts = []
    for piece in pieces:
        for size in (limit - per_token, limit - 1, limit, limit + 1, limit + per_token):
            texts.append((piece * (size // len(piece) + 1))[:size])
    return texts


@pytest.mark.parametrize("context", [16, 64])
def test_the_char_bound_refuses_only_what_the_exact_count_refuses(tokenizer, context):
    """Every text is refused iff the real tokenizer gives it at least `context` tokens; the bound (no tokenizing)
    refuses only texts that are surely too long, and the exact check still refuses those it lets through."""
    preparer = preparer_of(tokenizer, context)
    per_token = preparer.char_bound.chars_per_token
    assert per_token == max(map(len, tokenizer.get_vocab())) == 81  # SmolLM2's: "\n" and 80 spaces
    seen = set()
    for text in near_bound_texts(tokenizer, context, per_token):
        real = len(tokenizer.encode(text))
        if real >= context:
            with pytest.raises(errors.PromptTooLongError) as e:
                preparer.prepare(Generate("r", prompt=text))
            by_bound = "max_chars_per_token" in str(e.value)
            assert by_bound == (len(text) > (context - 1) * per_token), (len(text), real, str(e.value))
            seen.add("bound" if by_bound else "exact")
        else:
            assert len(preparer.prepare(Generate("r", prompt=text)).input_ids) == real
            seen.add("fits")
    assert seen == {"bound", "exact", "fits"}  # texts at the bound that fit, and some the bound passes but do not


def test_the_char_bound_holds_for_chat_messages_on_the_rendered_text(tokenizer):
    """A conversation is measured as the template renders it (HF's own rendering is the reference here)."""
    context = 64
    preparer = preparer_of(tokenizer, context)
    limit = (context - 1) * preparer.char_bound.chars_per_token
    fill = longest_entry_text(tokenizer)
    seen = set()
    for content_len in range(1000, limit + 200, 250):  # the template adds a system prompt of ~20 tokens
        messages = [{"role": "user", "content": (fill * (content_len // len(fill) + 1))[:content_len]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        real = len(tokenizer.encode(text, add_special_tokens=False))
        if real >= context:
            with pytest.raises(errors.PromptTooLongError) as e:
                preparer.prepare(Generate("r", messages=messages))
            assert ("max_chars_per_token" in str(e.value)) == (len(text) > limit)
            seen.add("bound" if len(text) > limit else "exact")
        else:
            assert preparer.prepare(Generate("r", messages=messages)).input_ids == tokenizer.encode(
                text, add_special_tokens=False
            )
            seen.add("fits")
    assert seen == {"bound", "exact", "fits"}, seen


def test_a_30_mb_prompt_is_refused_by_the_bound_in_milliseconds(tokenizer):
    preparer = preparer_of(tokenizer, 8192)
    for msg in (
        Generate("r", prompt="x" * 30 * MB),
        Generate("r", messages=[{"role": "user", "content": "y" * 30 * MB}]),
    ):
        t0 = time.monotonic()
        with pytest.raises(errors.PromptTooLongError, match="max_chars_per_token"):
            preparer.prepare(msg)
        assert time.monotonic() - t0 < 2.0  # tokenizing it takes about a minute


def test_the_pool_measures_a_message_before_decoding_its_text_with_the_same_outcome(tokenizer):
    """A large message is measured with its text still UTF-8 bytes (no decode): the same refusals as decoded."""
    from minisgl.limits import chars_of
    from minisgl.runtime.protocol import encode
    from minisgl.runtime.text_worker import TextWorker

    mixed = words(100_000)
    assert chars_of(mixed.encode()) == len(mixed) == chars_of(mixed)
    preparer = preparer_of(tokenizer, 64)
    limit = 63 * preparer.char_bound.chars_per_token
    cases = {
        "bound": Generate("r", prompt=mixed[: limit + 1]),
        "bound ": Generate("r", messages=[{"role": "user", "content": mixed[:limit]}]),
        "tokens but": Generate("r", prompt=mixed[:200]),
        "": Generate("r", prompt=mixed[:20]),
    }
    for words_of_outcome, msg in cases.items():
        outcomes = []
        for prepare in (lambda: preparer.prepare(msg), lambda: TextWorker._prepare(preparer, encode(msg))):
            try:
                outcomes.append(prepare().input_ids)
            except errors.PromptTooLongError as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1], outcomes
        expected = "max_chars_per_token" if words_of_outcome.startswith("bound") else words_of_outcome
        assert expected in str(outcomes[0]) if expected else isinstance(outcomes[0], list), outcomes[0]


def bpe_tokenizer(normalizer: Any = None, pre_tokenizer: Any = None, model: str = "BPE") -> Any:
    """A small tokenizer trained here, with the given normalizer and pre-tokenizer (byte-level by default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [words(2000, seed) for seed in range(20)] + ["ᾤ" * 256] * 50  # long tokens of a composed character
    if model == "WordPiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer: Any = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]"])
    else:
        tok = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if pre_tokenizer is None else pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


ADVERSARIAL = [
    "ω\u0313\u0301\u0345" * 2048,  # NFC composes each four into one character (U+1FA4), 256 of those a token
    "#" * 5000,
    " " * 5000,
    "\n" + " " * 80,
    "<|strip|>" + " " * 3000 + "<|strip|>" + "\t" * 3000,  # an added token that absorbs whitespace beside it
    words(3000),
]


def test_fewest_tokens_is_a_lower_bound_of_the_real_count_for_every_kind_of_tokenizer(tokenizer):
    from tokenizers import AddedToken, normalizers, pre_tokenizers

    from minisgl.runtime.tokenizer_worker import MAX_COMPOSED, CharBound

    stripping = bpe_tokenizer()
    stripping.add_tokens([AddedToken("<|strip|>", lstrip=True, rstrip=True)])
    kinds = {
        "smollm2": (tokenizer, 81, True),
        "nfc byte-level": (bpe_tokenizer(normalizers.NFC()), "composed", True),
        "stripping added token": (stripping, "longest", False),
        "bert-like": (
            bpe_tokenizer(normalizers.BertNormalizer(), pre_tokenizers.BertPreTokenizer(), "WordPiece"),
            None,
            True,
        ),
        "whitespace split": (bpe_tokenizer(None, pre_tokenizers.WhitespaceSplit()), None, True),
    }
    for name, (tok, per_token, whitespace) in kinds.items():
        bound = CharBound.of(tok)
        longest = max(map(len, tok.get_vocab()))
        expected = {"composed": longest * MAX_COMPOSED, "longest": longest}.get(per_token, per_token)  # type: ignore[arg-type]
        assert bound == CharBound(expected, whitespace if expected else True), name
        for text in ADVERSARIAL:
            assert bound.fewest_tokens(text) <= len(tok.encode(text, add_special_tokens=False)), (name, text[:20])
    assert CharBound.of(kinds["bert-like"][0], 10) == CharBound(10)  # the knob bounds any tokenizer


def test_max_request_chars_refuses_a_request_before_it_is_rendered(tokenizer):
    preparer = preparer_of(tokenizer, 1 << 20, max_request_chars=10_000, max_chars_per_token=10**6)
    big = "x" * 10_001
    cases = [
        Generate("r", prompt=big),
        Generate("r", messages=[{"role": "user", "content": "a" * 6000}, {"role": "user", "content": "b" * 6000}]),
        Generate(
            "r", messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": big}}]
        ),
        Generate("r", input_ids=[5] * 10_001),
        Generate("r", messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"x": big}),
    ]
    for msg in cases:
        with pytest.raises(errors.PromptTooLongError, match="max_request_chars"):
            preparer.prepare(msg)
    for msg in (Tokenize("r", prompt=big), Detokenize("r", [5] * 10_001)):
        with pytest.raises(errors.PromptTooLongError, match="max_request_chars"):
            preparer.tokenize(msg) if isinstance(msg, Tokenize) else preparer.detokenize(msg)
    half = "hello " * 800
    assert preparer.prepare(Generate("r", prompt=half)).input_ids == tokenizer.encode(half)
    assert preparer.tokenize(Tokenize("r", prompt=half)).input_ids == tokenizer.encode(half)


def test_token_ids_past_the_context_are_refused_before_each_is_looked_at(tokenizer):
    preparer = preparer_of(tokenizer, 512)
    with pytest.raises(errors.PromptTooLongError, match="512 tokens but the context window is 512"):
        preparer.prepare(Generate("r", input_ids=["not an id"] * 512))  # type: ignore[list-item]


# ---------------------------------------------------------------------------- a real daemon


@pytest.fixture(scope="module")
def launched(tiny_model_dir, daemon_runtime_dir) -> Iterator[SimpleNamespace]:  # noqa: F811
    address, log = f"ipc://{daemon_runtime_dir}/size.sock", daemon_runtime_dir / "size.log"
    args = ["--model", str(tiny_model_dir("llama")), "--device", "cpu", "--num-pages", str(NUM_PAGES)]
    args += ["--address", address, "--max-chars-per-token", str(CHARS_PER_TOKEN)]
    proc = start_serve(args, log)
    try:
        yield SimpleNamespace(address=address, log=log, proc=proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def expected(launched, tiny_model_dir) -> list[int]:
    """The offline engine's greedy tokens of the normal stream (in this process, no daemon)."""
    from minisgl.llm import LLM

    with LLM(str(tiny_model_dir("llama")), num_pages=NUM_PAGES) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)
        return list(llm.generate([NORMAL_IDS], params, use_tqdm=False)[0].token_ids)


@pytest.fixture(scope="module")
def served(launched, expected) -> Iterator[SimpleNamespace]:
    from minisgl.runtime.launcher import wait_ready

    wait_ready(launched.address, 300, proc=launched.proc, log_path=launched.log)
    with Client("tiny", launched.address, auto_start=False, timeout=300) as client:
        text = psutil.Process(client.stats()["workers"]["text"])
        yield SimpleNamespace(**vars(launched), client=client, text=text)


# The normal stream, in a process of its own: the big request's encoding in this one must not delay its reads.
STREAM_SCRIPT = """
import json, sys, time
from minisgl.client import Client
from minisgl.core import SamplingParams
ids, stamps = [], []
with Client("tiny", sys.argv[1], auto_start=False, timeout=120) as c:
    params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2]), ignore_eos=True)
    for chunk in c.stream([int(t) for t in sys.argv[3].split(",")], params):
        if not ids:
            print("started", flush=True)
        ids += chunk.token_ids
        stamps.append(time.monotonic())
print(json.dumps({"ids": ids, "stamps": stamps}), flush=True)
"""


class OtherProcessStream:
    def __init__(self, address: str) -> None:
        ids = ",".join(map(str, NORMAL_IDS))
        argv = [sys.executable, "-c", STREAM_SCRIPT, address, str(STREAM_TOKENS), ids]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> "OtherProcessStream":
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "started"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:
            self.proc.wait(120)

    def result(self) -> tuple[list[int], list[float]]:
        out, _ = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, out
        got = json.loads(out.strip().splitlines()[-1])
        return got["ids"], got["stamps"]


def big_request(case: str) -> tuple[Any, str]:
    """(the prompt the Client sends, words of the typed error's message)."""
    if case == "30 MB prompt":
        return "x" * 30 * MB, "max_chars_per_token"
    if case == "30 MB of chat messages":
        # ASCII: the daemon decodes a message in its loop, and 30 MB of emoji and CJK take 4x longer
        content = words(30 * MB, vocabulary=[w for w in WORDS if w.isascii()])
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
        return messages, "max_chars_per_token"
    assert case == "2 MB prompt the bound lets through"  # the text worker tokenizes it, then counts its tokens
    return words(2 * MB), "tokens but the context window is 512"


@pytest.mark.parametrize("case", ["30 MB prompt", "30 MB of chat messages", "2 MB prompt the bound lets through"])
def test_a_big_prompt_beside_a_stream_fails_alone_and_the_stream_keeps_its_pace(served, expected, case):
    prompt, words_of_error = big_request(case)
    settled(served.client)
    rss_before = served.text.memory_info().rss
    outcome: dict[str, Any] = {}

    def send() -> None:
        t0 = time.monotonic()
        try:
            served.client.generate(prompt, SamplingParams(max_tokens=2))
        except errors.MiniSGLError as e:
            outcome["error"] = e
        outcome["sent"], outcome["answered"] = t0, time.monotonic()

    with OtherProcessStream(served.address) as stream:
        big = threading.Thread(target=send)
        big.start()
        with Client("tiny", served.address, auto_start=False, timeout=120) as other:
            t0 = time.monotonic()
            small = other.tokenize("a small request")  # answered while the big one is prepared
            small_s = time.monotonic() - t0
        big.join(300)
        ids, stamps = stream.result()
    assert isinstance(outcome.get("error"), errors.PromptTooLongError), outcome
    assert words_of_error in str(outcome["error"]), outcome["error"]
    assert ids == expected
    assert stamps[-1] > outcome["sent"], "the stream ended before the big request was sent"
    beside = [b - a for a, b in zip(stamps, stamps[1:]) if b > outcome["sent"] and a < outcome["answered"]]
    alone = [b - a for a, b in zip(stamps, stamps[1:]) if b <= outcome["sent"] or a >= outcome["answered"]]
    jitter = max(alone, default=0.0)  # the machine's own (a loaded CI runner's), without the big request
    assert max(beside) < MAX_GAP_S + jitter, (max(beside), jitter, outcome["answered"] - outcome["sent"])
    assert small == served.client.tokenize("a small request") and small_s < MAX_GAP_S + 1.0, small_s
    after = served.client.generate(NORMAL_IDS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert after.token_ids == expected[:8]
    assert_no_page_leaked(served.client)
    deadline = time.monotonic() + 10
    while served.text.memory_info().rss - rss_before > 64 * MB and time.monotonic() < deadline:
        time.sleep(0.2)  # the worker releases its memory once the pool is idle
    assert served.text.memory_info().rss - rss_before < 64 * MB, (rss_before / MB, served.text.memory_info().rss / MB)


def test_an_abort_of_a_request_still_in_the_tokenizer_pool_stops_it(served):
    """An abort that arrives while its request waits in the text worker's pool (behind two big ones) is held until
    the request goes on to the scheduler: the request ends "abort" at once instead of running to max_tokens."""
    settled(served.client)
    blockers = [threading.Thread(target=refused, args=(served.address, words(2 * MB, seed))) for seed in (1, 2)]
    for b in blockers:
        b.start()
    time.sleep(0.5)  # both big prompts are in the pool
    # Past the pool's size in bytes (an unused key the chat template leaves out), a few tokens once rendered.
    messages = [{"role": "user", "content": "hi", "padding": "p" * 100_000}]
    stream = served.client.stream(messages, SamplingParams(max_tokens=400, ignore_eos=True), rid="held-abort")
    served.client.abort("held-abort")
    chunks = list(stream)
    for b in blockers:
        b.join(300)
    assert chunks[-1].finish_reason == "abort", chunks[-1]
    assert sum(len(c.token_ids) for c in chunks) < 400
    assert_no_page_leaked(served.client)


def refused(address: str, prompt: str) -> None:
    with Client("tiny", address, auto_start=False, timeout=300) as c, pytest.raises(errors.PromptTooLongError):
        c.generate(prompt, SamplingParams(max_tokens=2))
