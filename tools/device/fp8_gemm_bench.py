"""FP8 GEMMs against bf16 on one CUDA GPU: a Qwen3-8B decoder layer's four GEMMs at each row count.

    python3 tools/device/fp8_gemm_bench.py [--out fp8_gemm.json] [--rows 1,4,16,32,64,128,256] [--table-only]
    python3 tools/device/fp8_gemm_bench.py --w8a8-sweep 8,16,32,64,128 [--out w8a8.json]

First the weight-only kernel at 1 row (CUDA cores) and 16 rows (tensor cores) under a few tile configurations
(BEST_1, BEST_16: the fastest, and the fastest for each GEMM; without a configuration the kernels take
layers/fp8_gemm.py's gemv_config and W8A16_CONFIG), then the gate_up GEMM with SiLU-and-mul in its epilogue against
the two kernels (--table-only skips these).

For each row count M: microseconds of the layer's GEMMs (qkv, o, gate_up, down) in bf16 (torch.mm), with the FP8
weight-only kernels (layers/fp8_gemm.py: weight_only), with the per-row input quantization + the W8A8 kernel
(w8a8, w8a8_config's tiles) and with the quantization + torch._scaled_mm, each replayed 50 times from a CUDA graph
(launch costs as in decode). The last line gives the largest M at which the weight-only kernels are still the
fastest: the value for MINISGL_FP8_WEIGHT_ONLY_ROWS.

--w8a8-sweep: the W8A8 kernel under every tile configuration of W8A8_TILES at each row count, through four distinct
weights of each shape, the input already quantized, gate_up with SiLU-and-mul in its epilogue; the fastest tiles
per GEMM (w8a8_config's source) against bf16 and torch._scaled_mm.
"""

from __future__ import annotations

import argparse
import json

import torch
from graph_timing import graph_us

from minisgl.layers.fp8_gemm import quantize_per_channel, quantize_rows, w8a8, weight_only

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}  # (K, N)


def sweep(weights: dict[str, tuple[torch.Tensor, ...]], rows: int, configs: list[dict[str, int]]) -> None:
    """The weight-only kernel at `rows` rows under each tile configuration; prints the fastest as BEST_<rows>."""
    print(f"weight-only kernel at {rows} rows, us per GEMM (qkv / o / gate_up / down) and the layer's sum, by tiles:")
    best: tuple[float, dict[str, int]] = (float("inf"), {})
    per_shape: dict[str, tuple[float, dict[str, int]]] = {}
    for cfg in configs:
        times = []
        for w, q, s in weights.values():
            x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
            times.append(graph_us(lambda: weight_only(x, q, s, config=cfg)))  # noqa: B023
        print(f"  {cfg}: {' / '.join(f'{t:.1f}' for t in times)} = {sum(times):.1f}", flush=True)
        best = min(best, (sum(times), cfg), key=lambda b: b[0])
        for name, t in zip(weights, times):
            per_shape[name] = min(per_shape.get(name, (float("inf"), {})), (t, cfg), key=lambda b: b[0])
    print(f"BEST_{rows} {best[0]:.1f} {json.dumps(best[1])}")
    for name, (t, cfg) in per_shape.items():
        print(f"  best for {name}: {t:.1f} us {json.dumps(cfg)}")


def distinct_weights(copies: int) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """`copies` distinct FP8 weights (per-channel quantized) of each shape, for timings through weights not in L2."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        name: [quantize_per_channel(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02)
               for _ in range(copies)]
        for name, (k, n) in SHAPES.items()
    }  # fmt: skip


def cold_layers(configs: list[dict[str, int]], layers: int = 8) -> None:
    """One row through `layers` distinct layers' weights, as decode reads them (no weight is in L2 when its GEMM
    starts; the sweeps above replay one weight, which L2 partly holds below ~50 MB): us per GEMM for each shape under
    each GEMV tile configuration (gate_up with SiLU-and-mul in its epilogue, as the MLP runs it), then a layer's four
    GEMMs chained with the default tiles against bf16's cuBLAS."""
    stack = distinct_weights(layers)
    x = {name: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for name, (k, _) in SHAPES.items()}
    print(f"one row, {layers} distinct layers' weights, us per GEMM (qkv / o / gate_up+SiLU / down), by tiles:")
    for cfg in configs:
        times = [
            graph_us(lambda: [weight_only(x[n], q, s, config=cfg, gate_up=n == "gate_up") for q, s in stack[n]], 10)  # noqa: B023
            / layers
            for n in SHAPES
        ]
        print(f"  {cfg}: {' / '.join(f'{t:.1f}' for t in times)} = {sum(times):.1f}", flush=True)

    def fp8_chain() -> None:
        for i in range(layers):
            for n in SHAPES:
                weight_only(x[n], *stack[n][i], gate_up=n == "gate_up")

    fp8_us = graph_us(fp8_chain, 10) / layers
    stack.clear()  # free the FP8 copies before the bf16 ones
    bf16 = [{n: torch.randn(nn, k, device="cuda", dtype=torch.bfloat16) for n, (k, nn) in SHAPES.items()}]
    bf16 += [{n: torch.randn_like(w) for n, w in bf16[0].items()} for _ in range(layers - 1)]
    bf16_us = graph_us(lambda: [torch.mm(x[n], w[n].t()) for w in bf16 for n in SHAPES], 10) / layers
    print(f"a layer's four GEMMs, cold, default tiles: FP8 {fp8_us:.1f} us against bf16 {bf16_us:.1f} us", flush=True)


def gate_up_epilogue(weights: dict[str, tuple[torch.Tensor, ...]]) -> None:
    """The MLP's gate_up GEMM then flashinfer's SiLU-and-mul, against the GEMM applying it in its epilogue
    (weight_only(gate_up=True)), at a few rows and, for one row, a few GEMV tiles."""
    import flashinfer

    _, q, s = weights["gate_up"]
    for m in (1, 2, 8, 16):
        x = torch.randn(m, q.shape[1], device="cuda", dtype=torch.bfloat16)
        apart = graph_us(lambda: flashinfer.activation.silu_and_mul(weight_only(x, q, s)))  # noqa: B023
        fused = graph_us(lambda: weight_only(x, q, s, gate_up=True))  # noqa: B023
        print(f"gate_up at {m} rows: GEMM + SiLU-and-mul {apart:.1f} us, SiLU-and-mul in the epilogue {fused:.1f} us")
    x = torch.randn(1, q.shape[1], device="cuda", dtype=torch.bfloat16)
    for bn, bk, w, st in [(4, 512, 2, 3), (2, 1024, 2, 2), (4, 1024, 4, 2), (8, 512, 4, 3), (2, 512, 2, 3)]:
        cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
        print(
            f"  fused gate_up, 1 row, {cfg}: {graph_us(lambda: weight_only(x, q, s, config=cfg, gate_up=True)):.1f} us"
        )  # noqa: B023


W8A8_TILES = [
    (bm, bn, bk, st, 8 if bm == 128 else 4)
    for bm in (16, 32, 64, 128)
    for bn in (32, 64, 128)
    for bk in (128, 256)
    for st in (3, 5)
]


def w8a8_sweep(rows_list: list[int], copies: int = 4) -> dict[str, object]:
    """The FP8 x FP8 kernel (w8a8) at each row count under each tile configuration, through `copies` distinct weights
    of each shape (as decode reads them: mostly not in L2), against bf16's cuBLAS and torch._scaled_mm (gate_up:
    then flashinfer's SiLU-and-mul; w8a8 applies it in its epilogue). Prints per M the fastest tiles of each GEMM
    and the layer's sums; returns them for the JSON."""
    import flashinfer

    stack = distinct_weights(copies)
    result: dict[str, object] = {}
    print(f"w8a8 sweep, {copies} weights a shape, us per GEMM: bf16 / _scaled_mm / best w8a8 (its tiles)")
    for m in rows_list:
        bf16_sum = scaled_sum = best_sum = 0.0
        best_cfgs = {}
        for name, (k, n) in SHAPES.items():
            gate_up = name == "gate_up"
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            qx, sx = quantize_rows(x)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            bf16 = graph_us(lambda: [torch.mm(x, w.t()) for w in ws], 10) / 2  # noqa: B023

            def via_scaled_mm(q, s):
                y = torch._scaled_mm(qx, q.t(), scale_a=sx, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)  # noqa: B023
                return flashinfer.activation.silu_and_mul(y) if gate_up else y  # noqa: B023

            base = graph_us(lambda: [via_scaled_mm(q, s) for q, s in stack[name]], 10) / copies  # noqa: B023
            ref = via_scaled_mm(*stack[name][0]).float()
            best = (float("inf"), {})
            for bm, bn, bk, st, warps in W8A8_TILES:
                if bm > max(16, m) * 2 or bm * 4 < m:
                    continue
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=st)
                try:
                    got = w8a8(qx, sx, *stack[name][0], torch.bfloat16, config=cfg, gate_up=gate_up).float()
                    t = graph_us(lambda: [w8a8(qx, sx, q, s, torch.bfloat16, config=cfg, gate_up=gate_up)  # noqa: B023
                                          for q, s in stack[name]], 10) / copies  # fmt: skip
                except Exception as e:  # noqa: BLE001 - tiles that do not fit the shared memory
                    print(f"    M={m} {name} {cfg}: {type(e).__name__}", flush=True)
                    continue
                if not torch.allclose(got, ref, atol=2e-2, rtol=2e-2):
                    raise SystemExit(f"w8a8 differs from _scaled_mm at M={m} {name} {cfg}")
                best = min(best, (t, cfg), key=lambda b: b[0])
            print(f"  M={m:3d} {name:8s} {bf16:7.1f} / {base:7.1f} / {best[0]:7.1f}  {json.dumps(best[1])}", flush=True)
            bf16_sum, scaled_sum, best_sum = bf16_sum + bf16, scaled_sum + base, best_sum + best[0]
            best_cfgs[name] = {"us": best[0], "config": best[1], "bf16_us": bf16, "scaled_mm_us": base}
        print(f"M={m:3d} layer: bf16 {bf16_sum:.1f} / _scaled_mm {scaled_sum:.1f} / w8a8 {best_sum:.1f} us", flush=True)
        result[str(m)] = best_cfgs
    return result


def scaled(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    qx, sx = quantize_rows(x)
    return torch._scaled_mm(qx, q.t(), scale_a=sx, scale_b=scale.view(1, -1), out_dtype=x.dtype)


def tile_sweeps(weights: dict[str, tuple[torch.Tensor, ...]]) -> None:
    """The weight-only kernels' tile sweeps (1 and 16 rows, then 32 and 64), the gate_up epilogue, the cold layers."""
    sweep(weights, 1, [
        dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
        for bn, bk, w, st in [(8, 1024, 4, 2), (8, 1024, 4, 3), (8, 2048, 4, 2), (8, 2048, 8, 2), (4, 2048, 4, 2),
                              (4, 1024, 2, 2), (16, 1024, 8, 2), (16, 512, 4, 3), (8, 512, 4, 3), (8, 512, 2, 3),
                              (2, 2048, 2, 2), (4, 4096, 4, 1)]
    ])  # fmt: skip
    sweep(weights, 16, [
        dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
        for bn, bk, w, st in [(32, 256, 4, 4), (32, 512, 4, 3), (16, 256, 2, 3), (64, 256, 4, 3)]
    ])  # fmt: skip
    for rows in (32, 64):
        sweep(weights, rows, [
            dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
            for bm, bn, bk, w, st in [(16, 32, 256, 4, 4), (16, 64, 256, 4, 3), (32, 32, 256, 4, 4),
                                      (32, 64, 128, 4, 4), (rows, 64, 128, 4, 3), (rows, 128, 64, 8, 3)]
        ])  # fmt: skip
    gate_up_epilogue(weights)
    cold_layers([{}] + [
        dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
        for bn, bk, w, st in [(8, 1024, 4, 2), (8, 512, 2, 3), (4, 2048, 4, 2), (4, 1024, 2, 3), (4, 512, 2, 4),
                              (2, 1024, 1, 3), (8, 256, 2, 4), (16, 512, 4, 3), (4, 2048, 8, 3)]
    ])  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--out", default="fp8_gemm.json")
    p.add_argument("--w8a8-sweep", default="", help="row counts: only the FP8 x FP8 kernel's tile sweep")
    p.add_argument("--table-only", action="store_true", help="only the table of the kernels by row count")
    args = p.parse_args()
    if args.w8a8_sweep:
        found = w8a8_sweep([int(r) for r in args.w8a8_sweep.split(",")])
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "w8a8": found}, f, indent=2)
        return
    weights = {}
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weights[name] = (w, *quantize_per_channel(w))
    if not args.table_only:
        tile_sweeps(weights)
    rows_out = []
    print(
        f"{'M':>5s} {'bf16':>7s} {'w8a16':>7s} {'w8a8':>7s} {'scaled':>7s}  us; per GEMM bf16 / w8a16 / w8a8 / scaled"
    )
    for m in [int(r) for r in args.rows.split(",")]:
        per: dict[str, list[float]] = {}
        for name, (w, q, s) in weights.items():
            x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
            per[name] = [
                graph_us(lambda: torch.mm(x, w.t())),  # noqa: B023
                graph_us(lambda: weight_only(x, q, s)),  # noqa: B023
                graph_us(lambda: w8a8(*quantize_rows(x), q, s, x.dtype)),  # noqa: B023
                graph_us(lambda: scaled(x, q, s)),  # noqa: B023
            ]
        totals = [sum(v[i] for v in per.values()) for i in range(4)]
        rows_out.append({"rows": m, "bf16_us": totals[0], "w8a16_us": totals[1], "w8a8_us": totals[2],
                         "scaled_mm_us": totals[3], "per": per})  # fmt: skip
        detail = " ".join(f"{n}={'/'.join(f'{t:.1f}' for t in v)}" for n, v in per.items())
        print(f"{m:5d} {' '.join(f'{t:7.1f}' for t in totals)}  {detail}", flush=True)
    faster = [r["rows"] for r in rows_out if r["w8a16_us"] <= min(r["w8a8_us"], r["scaled_mm_us"])]
    crossover = max(faster) if faster else 0
    layer_bytes = sum(w.numel() for w, _, _ in weights.values())
    print(f"layer weights {layer_bytes * 2 / 1e6:.0f} MB bf16, {layer_bytes / 1e6:.0f} MB fp8")
    print(f"WEIGHT_ONLY_ROWS {crossover}")
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows_out, "weight_only_rows": crossover}, f, indent=2)


if __name__ == "__main__":
    main()
