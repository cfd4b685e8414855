"""N-gram speculation on a GPU at the acceptance a trained model shows: a pattern recorded on the CPU, replayed.

    minisgl bench spec --batches 1 --record-pattern pattern.json          # the default model, on the CPU
    minisgl bench spec-replay --pattern pattern.json [--shape qwen3-0.6b] [--reps 3] [--batch 16]  # a GPU

Random weights accept nothing meaningful, so the GPU's figure comes from the default model's behaviour: `bench spec
--record-pattern` writes, per workload at batch 1, the prompt's and the output's lengths and each verify step (the
output position it started at, the tokens drafted and accepted). Here a model of a real shape with dummy weights
first decodes greedily without speculation (output O), then again with drafts taken from O and made wrong at the
recorded position of each step, so every step drafts and accepts exactly what the default model did; the output
must equal O (verification is exact whatever the drafts). Reported: tokens per second off and on (the median of
--reps, engines interleaved), the speed-up, the mean accepted length and whether the outputs are identical (where
not, whether each row parted at an exact tie of the plain run's two best tokens: bf16 dummy weights give nearly
flat distributions, and a verify step computes with other kernels than a decode step). With --batch N, N such
requests (distinct prompts, each its own output) decode together, every one replaying the pattern.

Every recorded step drafts as the CPU's policy decided, where a verify step costs little. With --policy the
recorded drafts stand in for the n-gram lookup instead (ReplayedLookup) and this device's policy decides which to
verify and how long, as it would with the default model's drafts; the accepted length is then the one measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from minisgl import env
from minisgl.bench import write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pattern", required=True, help="the JSON `bench spec --record-pattern` wrote")
    p.add_argument("--shape", default="qwen3-0.6b", help="the model shape (bench/throughput.py SHAPES)")
    p.add_argument("--tokenizer-dir", default=str(env.TOKENIZER_DIR.get() or "tok"), help="the model's tokenizer")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="requests decoded together, each replaying the pattern")
    p.add_argument(
        "--policy",
        action="store_true",
        help="the drafting policy decides which recorded drafts to verify and how many of their tokens (the recorded "
        "drafts stand in for the n-gram lookup), instead of every recorded step drafting as recorded",
    )
    p.add_argument("--json", help="also write the figures here")
    p.set_defaults(func=run)


class ReplayedDrafts:
    """Drafts from a known output, accepted as a recorded pattern says: at output position p the pattern's step
    (k drafted, a accepted) drafts output[p : p + k] with its token a made wrong (when a < k). Used in place of a
    Speculator's drafts() and may_draft()."""

    def __init__(self, output: list[int], steps: list[list[int]], vocab: int) -> None:
        self.output = output
        self.steps = {p: (k, a) for p, k, a in steps}
        self.vocab = vocab

    def draft(self, position: int) -> list[int]:
        k, a = self.steps.get(position, (0, 0))
        draft = list(self.output[position : position + k])
        if a < len(draft):
            draft[a] = (draft[a] + 1) % self.vocab  # the target chose output[position + a]: this one is rejected
        return draft

    def drafts(self, reqs: list[Any]) -> list[list[int]] | None:
        out = [self.draft(len(r.output_ids)) for r in reqs]
        return out if any(out) else None

    def may_draft(self, reqs: list[Any]) -> bool:
        # The host may lack each row's last token: a step at the next position may draft too.
        return any(len(r.output_ids) + lag in self.steps for r in reqs for lag in (0, 1))


class ReplayedLookup(ReplayedDrafts):
    """The recorded drafts in place of the n-gram lookup (speculative.propose), the drafting policy left to decide:
    at a recorded step's output position p0 the lookup finds its draft, and at a position p inside the step's
    accepted run (p0 < p < p0 + a) the rest of it, output[p : p0 + k] with the recorded miss at p0 + a (the passage
    the default model's lookup matched, continued); a 4-token context. Elsewhere nothing (after the miss the context
    is the model's own token, which the passage did not predict). Where the policy drafts fewer tokens or skips a
    step, the rest is decoded plainly."""

    def __init__(self, output: list[int], steps: list[list[int]], vocab: int, prompt_len: int) -> None:
        super().__init__(output, steps, vocab)
        self.prompt_len = prompt_len
        self.runs = sorted((p0, k, a) for p0, k, a in steps if k > 0)

    def propose(self, own: Any, shared: Any, k: int, min_n: int = 1) -> tuple[list[int], int]:
        p = len(own.tokens) - self.prompt_len
        for p0, k0, a0 in self.runs:
            if p == p0 or p0 < p < p0 + a0:
                draft = self.draft(p0)[p - p0 :][:k]
                return (draft, 4) if draft else ([], 0)
        return [], 0


class ReplayedBatch:
    """One replay per row of a batch, each row told by its prompt's first token: in place of a Speculator's drafts()
    and may_draft(), or of speculative.propose."""

    def __init__(self, replays: dict[int, Any]) -> None:
        self.replays = replays  # first prompt token -> ReplayedDrafts (or ReplayedLookup)

    def drafts(self, reqs: list[Any]) -> list[list[int]] | None:
        out = [self.replays[r.input_ids[0]].draft(len(r.output_ids)) for r in reqs]
        return out if any(out) else None

    def may_draft(self, reqs: list[Any]) -> bool:
        return any(self.replays[r.input_ids[0]].may_draft([r]) for r in reqs)

    def propose(self, own: Any, shared: Any, k: int, min_n: int = 1) -> tuple[list[int], int]:
        return self.replays[own.tokens[0]].propose(own, shared, k, min_n)


TIE = 0.02  # top-two logprob gap under which bf16 numerics of another kernel may pick the other token


def _parting(off: Any, on: Any, prompts: list[list[int]], max_tokens: int, reference: list[list[int]]) -> str:
    """Why outputs differ: "ties (k of n rows)" when each differing row parts from a plain run's output where that
    run's two best tokens were within TIE (a verify step computes its logits with other kernels than a decode step,
    so an exact tie may fall the other way), else "NO" (a real difference)."""
    from minisgl import SamplingParams  # lazy: `minisgl bench --help` loads every benchmark, not the engine

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    plain = off.generate(prompts, params, use_tqdm=False)
    spec = on.generate(prompts, params, use_tqdm=False)
    parted = 0
    for ref, p, s in zip(reference, plain, spec):
        parts = [next((i for i, (a, b) in enumerate(zip(p.token_ids, o)) if a != b), None) for o in (ref, s.token_ids)]
        for at in (i for i in parts if i is not None):
            top = sorted((lp for _, lp in p.logprobs[at][1]), reverse=True)
            if len(top) < 2 or top[0] - top[1] > TIE:
                return "NO"
        parted += any(i is not None for i in parts)
    return f"ties ({parted} of {len(prompts)} rows)"


def _timed(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def run(args: argparse.Namespace) -> None:
    from minisgl import LLM, SamplingParams  # lazy: `minisgl bench --help` loads every benchmark, not the engine
    from minisgl.bench.throughput import write_model_dir
    from minisgl.scheduler import speculative

    pattern = json.loads(Path(args.pattern).read_text())
    model_dir = write_model_dir(Path(args.tokenizer_dir), args.shape)
    off = LLM(str(model_dir), load_format="dummy")
    on = LLM(str(model_dir), load_format="dummy", speculative="ngram")
    vocab = off.model_config.vocab_size
    how = "its drafts, the policy deciding" if args.policy else "every recorded step"
    source = pattern.get("model", "?")
    print(f"# {args.shape} (dummy weights), batch {args.batch}, acceptance replayed from {source}: {how}")
    print(f"{'workload':<16}{'off tok/s':>12}{'on tok/s':>12}{'speedup':>9}{'accept':>8}  identical")
    results: dict[str, Any] = {}
    for name, case in pattern["workloads"].items():
        # Distinct prompts (row i starts with token 1000 + 7i), so that no row's prompt is another's cached prefix.
        prompts = [[1000 + (7 * i + j) % 5000 for j in range(case["prompt_len"])] for i in range(args.batch)]
        params = SamplingParams(temperature=0, max_tokens=case["output_len"], ignore_eos=True)
        _timed(off, prompts, params)  # the warm-up: the prompts are cached from now on
        _, reference = _timed(off, prompts, params)  # as every timed run computes it (a cached prompt's last token)
        if args.policy:
            lookups = {p[0]: ReplayedLookup(out, case["steps"], vocab, len(p)) for p, out in zip(prompts, reference)}
            speculative.propose = ReplayedBatch(lookups).propose
            sched = on.scheduler  # a fresh policy per workload: what it learnt of the last one does not carry over
            sched.spec = speculative.Speculator(sched.kv, sched.max_seq_len, sched.device.type)
        else:
            replay = ReplayedBatch(
                {p[0]: ReplayedDrafts(out, case["steps"], vocab) for p, out in zip(prompts, reference)}
            )
            on.scheduler.spec.drafts, on.scheduler.spec.may_draft = replay.drafts, replay.may_draft
        _timed(on, prompts, params)
        rates: dict[str, list[float]] = {"off": [], "on": []}
        identical = True
        before = on.scheduler.spec.stats()
        for _ in range(args.reps):
            for mode, llm in (("off", off), ("on", on)):
                seconds, tokens = _timed(llm, prompts, params)
                rates[mode].append(sum(map(len, tokens)) / seconds)
                identical &= tokens == reference
        steps = [s for s in case["steps"] if s[1] > 0]
        accept_len = 1 + sum(s[2] for s in steps) / len(steps) if steps else 1.0
        if args.policy:
            after = on.scheduler.spec.stats()
            rows = after["spec_verify_rows"] - before["spec_verify_rows"]
            accept_len = 1 + (after["spec_accepted_tokens"] - before["spec_accepted_tokens"]) / rows if rows else 1.0
        r = {mode: {"tok_s": statistics.median(v), "min": min(v), "max": max(v)} for mode, v in rates.items()}
        same = "yes" if identical else _parting(off, on, prompts, case["output_len"], reference)
        r.update(speedup=r["on"]["tok_s"] / r["off"]["tok_s"], accept_len=accept_len, identical=same)
        results[name] = r
        spread = f"({r['off']['min']:.0f}-{r['off']['max']:.0f} | {r['on']['min']:.0f}-{r['on']['max']:.0f})"
        print(
            f"{name:<16}{r['off']['tok_s']:>12.1f}{r['on']['tok_s']:>12.1f}{r['speedup']:>8.2f}x"
            f"{r['accept_len']:>8.2f}  {same}  {spread}",
            flush=True,
        )
    write_json({"shape": args.shape, "pattern": args.pattern, "batch": args.batch, "results": results}, args.json)
