"""Stop strings: the incremental check equals a brute-force search of the whole text, and costs O(new text)."""

from __future__ import annotations

import random
import time

import pytest

from minisgl.tokenizer import IncrementalDetokenizer


class PieceTokenizer:
    """Token i is PIECES[i]: multi-character pieces, so stops straddle token boundaries in every way."""

    PIECES = ["a", "b", "ab", "ba", "aab", "c", " ", "abc", "\n", "bb"]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.PIECES[i] for i in ids)


def reference(tokenizer, chunks, stops, min_tokens):
    """(text shown, stop matched, text shown after each chunk) by brute force: after each chunk, str.find over the
    whole text so far for a stop that ends in the min_tokens-th token's text or later; held back: the longest
    suffix of the text that is a proper prefix of a stop."""
    plain = IncrementalDetokenizer(tokenizer)  # no stops: shows all it decoded
    text, ids, shown = "", [], []
    for chunk in chunks:
        ids += chunk
        text += plain.add(chunk)
        if len(ids) >= min_tokens:
            boundary = len(tokenizer.decode(ids[: min_tokens - 1])) if min_tokens > 1 else 0
            hits = [(text.find(s, max(0, boundary - len(s) + 1)), s) for s in stops]
            hits = [(p, s) for p, s in hits if p >= 0]
            if hits:
                pos, s = min(hits)
                shown.append(text[:pos])
                return text[:pos], s, shown
        held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        shown.append(text[: len(text) - held])
    return text + plain.finish(), None, shown


def incremental(tokenizer, chunks, stops, min_tokens):
    detok = IncrementalDetokenizer(tokenizer, stops, min_tokens=min_tokens)
    out, shown = "", []
    for chunk in chunks:
        out += detok.add(chunk)
        shown.append(out)
        if detok.stopped is not None:
            return out, detok.stopped, shown
    return out + detok.finish(), None, shown


def random_case(rng: random.Random, vocab: int):
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    chunks, i = [], 0
    while i < len(ids):
        step = rng.choice([1, 1, 1, 2, 5])
        chunks.append(ids[i : i + step])
        i += step
    return ids, chunks


def random_stops(rng: random.Random, text: str) -> list[str]:
    stops = []
    for _ in range(rng.randrange(1, 5)):
        if text and rng.random() < 0.7:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randrange(1, 8)])  # one that occurs
        else:
            stops.append("".join(rng.choice("abc ") for _ in range(rng.randrange(1, 6))))
    return stops


def test_the_incremental_stop_check_equals_a_brute_force_search_on_random_cases():
    rng = random.Random(0)
    tok = PieceTokenizer()
    for _ in range(3000):
        ids, chunks = random_case(rng, len(tok.PIECES))
        stops = random_stops(rng, tok.decode(ids))
        min_tokens = rng.choice([0, 0, 1, 3, 10])
        assert incremental(tok, chunks, stops, min_tokens) == reference(tok, chunks, stops, min_tokens), (
            chunks,
            stops,
            min_tokens,
        )


def test_the_stop_check_equals_brute_force_on_a_real_tokenizer_with_multibyte_text(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(1)
    ids = tok.encode("Schöne Grüße 😀 — naïve café, 你好世界. ab ab abc " * 4)
    for _ in range(150):
        start = rng.randrange(len(ids) - 20)
        piece = ids[start : start + rng.randrange(10, 40)]
        chunks = [piece[i : i + rng.choice([1, 2, 3])] for i in range(0, len(piece), 3)]
        chunks = [c for c in chunks if c]
        stops = random_stops(rng, tok.decode(piece))
        assert incremental(tok, chunks, stops, 0) == reference(tok, chunks, stops, 0), (chunks, stops)


def test_the_stop_check_costs_the_same_per_token_late_in_a_long_output():
    """16 stops of 1024 characters that the text keeps almost matching: the 20,000th token costs what the first
    ones did (the old check was quadratic in the stop's length and read the whole text on every token)."""
    tok = PieceTokenizer()
    stops = ["a" * 1023 + "c" + str(i) for i in range(16)]
    detok = IncrementalDetokenizer(tok, stops)

    def timed(count: int) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            detok.add([0])  # "a": every stop's longest prefix stays a suffix of the text
        return time.perf_counter() - t0

    timed(2000)
    early = timed(2000)
    for _ in range(8):
        timed(2000)
    late = timed(2000)
    assert detok.stopped is None and late < 3 * early + 0.05
    assert len(detok.finish()) == 1023  # the held-back "a"s come out at the end


@pytest.mark.parametrize("stops", [["abc"], ["b", "abc"], ["ba", "aab"]])
def test_text_is_cut_before_the_earliest_stop(stops):
    tok = PieceTokenizer()
    ids = [0, 1, 4, 7, 5, 3]  # "a" "b" "aab" "abc" "c" "ba"
    text, stop, _ = incremental(tok, [[i] for i in ids], stops, 0)
    assert (text, stop) == reference(tok, [[i] for i in ids], stops, 0)[:2]
    assert stop is not None and stop not in text
