"""Benchmarks: `minisgl bench offline | agents` (each prints its figures; see docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minisgl bench", description="minisgl benchmarks")
    sub = parser.add_subparsers(dest="kind", required=True)
    from minisgl.bench import agents, offline, online

    offline.add_arguments(sub.add_parser("offline", help="offline throughput (LLM.generate), optionally vs HF generate"))
    online.add_arguments(sub.add_parser("online", help="Poisson arrivals against a daemon: TTFT, TPOT, throughput"))
    agents.add_arguments(sub.add_parser("agents", help="shared-prefix agent workload, radix vs naive"))
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    args.func(args)
