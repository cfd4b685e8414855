"""Benchmarks: `minisgl bench <name>` (each prints its figures; see docs/benchmarks.md).

Every module has add_arguments(parser) and a run(args); heavy or optional imports (zmq, litellm,
flashinfer, transformers) happen inside run, so `minisgl bench --help` works on any machine. An adapter's
benchmark lives with its adapter (integrations/, above bench in the layers) and is named here by module, loaded
only when it is the benchmark asked for.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from minisgl.lifetime import raise_on_sigterm

SUBCOMMANDS = {  # name -> (module under minisgl.bench, or an adapter's dotted module, one-line help)
    "offline": ("offline", "offline throughput (LLM.generate), optionally vs HF generate"),
    "online": ("online", "Poisson arrivals against a daemon: TTFT, TPOT, throughput"),
    "agents": ("agents", "shared-prefix agent workload, radix vs naive"),
    "hf-generate": ("transformers_minisgl.bench", "HF model.generate, unpatched vs patched with transformers_minisgl"),
    "routing": (
        "litellm_minisgl.bench",
        "cache-aware vs round-robin routing across two daemons behind a LiteLLM Router",
    ),
    "throughput": ("throughput", "GPU: the offline workload (256 requests, dummy model of a --shape)"),
    "tp": ("tp", "GPU: tensor-parallel parity, TP=2 vs TP=1 throughput, two nodes (2 GPUs)"),
    "cpu": ("cpu", "CPU decode: HF generate vs minisgl fp32, fp16 and int8 weights (1 and 32 requests)"),
    "profile": ("profile", "where the time goes: CPU GEMMs, a CPU decode step, GPU decode steps"),
    "spec": ("spec", "n-gram speculative decoding on/off: copy-with-edit, tool call, prose at batch 1 and 16"),
    "spec-replay": ("spec_replay", "GPU: n-gram speculation at the acceptance `bench spec --record-pattern` recorded"),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """Every benchmark's subcommand; an adapter's one gets its arguments only when it is `selected`."""
    parser = argparse.ArgumentParser(prog="minisgl bench", description="minisgl benchmarks")
    sub = parser.add_subparsers(dest="kind", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, formatter_class=argparse.RawDescriptionHelpFormatter)
        if "." in module and name != selected:
            continue  # importing an adapter imports litellm or transformers: only for the benchmark that runs
        bench = importlib.import_module(module if "." in module else f"minisgl.bench.{module}")
        sub_parser.description = bench.__doc__
        bench.add_arguments(sub_parser)
    return parser


def write_json(result: Any, path: str | None) -> None:
    """Save a benchmark's figures where --json points (nothing without it)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    raise_on_sigterm()  # `timeout` or `kill`: the children a benchmark started are stopped on the way out
    argv = argv if argv is not None else sys.argv[1:]
    selected = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(selected).parse_args(argv)
    args.func(args)
