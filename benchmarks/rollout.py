"""Rollout speed: covey's fast engine vs transformers generate (each in float32 and bfloat16) vs the roofline.

Realistic rollouts of the default task: the default model, arithmetic prompts, temperature 1,
up to 128 new tokens; useful tokens are those up to and including EOS. Each row runs the engines
alternately ``--repeats`` times on the same prompts and reports medians; ratios are taken within
the run. "fast oneDNN" is the float32 fast engine without covey's decode kernel (its products
through oneDNN's prepacked linear from ``PREPACKED_FLOAT32_FROM_ROWS`` rows, ``F.linear`` below);
"fast bf16 oneDNN" the bfloat16 one without it (oneDNN's prepacked linear at every row count).

The roofline is computed in the same run from the machine's measured matrix-product rate and copy
bandwidth (measured before each row; the highest of the run are taken, so that a slow moment cannot
lower the bound), for the dtype the engine runs in: a decode step reads every weight once (memory) and
does 2 FLOPs per weight per row (compute), whichever is slower. "full batch" assumes every row
runs for the whole rollout; "as sampled" counts, step by step, only the rows still running in
the rollouts actually measured (the least work that yields these completions); "stream alone" takes
only the memory bound (bfloat16's AMX tile products outrun the measured bfloat16 rate). A last table
times a decode step's matrix products alone, with the real weights, at 1 to 32 rows: what each way
of multiplying allows before any other work (``F.linear``; oneDNN's prepacked linear, in float32
from ``PREPACKED_FLOAT32_FROM_ROWS`` rows; covey's decode kernel, in bfloat16 where the CPU has AMX),
and the share of the roofline's least step time that the kernel's products alone reach: no rollout
built on them can reach a larger share.

    python -m benchmarks.rollout --repeats 3
    python -m benchmarks.rollout --repeats 3 --float32-only   # a CPU without bfloat16 instructions
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from benchmarks.common import (copy_gbps, decode_step_seconds, load_default, machine, matmul_gflops,
                               matrix_products_seconds, weights_per_step)
from covey.rollout.fast.engine import FastEngine
from covey.rollout import HFEngine, SamplingParams
from covey.data.tasks import arithmetic
from covey.data.text import encode_prompts


def run(engine, prompts, G, params, seed):
    start = time.perf_counter()
    rollout = engine.generate(prompts, G, params, seed=seed)
    return time.perf_counter() - start, rollout.lengths_B


def roofline(weights: int, lengths_B: torch.Tensor, limits: tuple[float, float, int], as_sampled: bool) -> float:
    """Useful tokens/s of an engine at the machine's limits producing completions of these lengths."""
    steps = int(lengths_B.max())
    rows = [int((lengths_B > t).sum()) if as_sampled else len(lengths_B) for t in range(steps)]
    return float(lengths_B.sum()) / sum(decode_step_seconds(weights, n, *limits) for n in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--float32-only", action="store_true",
                        help="leave out the bfloat16 engines (where the CPU multiplies bfloat16 in software)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer, eos = load_default()
    pad = tokenizer.pad_token_id
    engines = {"hf": HFEngine(model, pad, eos), "fast": FastEngine(model, pad, eos, tokenizer),
               "fast oneDNN": FastEngine(model, pad, eos, tokenizer, multiply="prepacked"),
               "hf bf16": HFEngine(model, pad, eos, bf16=True), "fast bf16": FastEngine(model, pad, eos, tokenizer, bf16=True),
               "fast bf16 oneDNN": FastEngine(model, pad, eos, tokenizer, bf16=True, multiply="prepacked")}
    if args.float32_only:
        engines = {name: engine for name, engine in engines.items() if "bf16" not in name}
    weights = weights_per_step(model)
    print(f"machine: {machine()}\n")
    rows = arithmetic("train")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    speed, measured, limits_seen = [], [], []
    for n_prompts, G in ((1, 8), (1, 16), (2, 8), (2, 16)):
        # the machine's limits, measured before each row: its pace moves within a run
        limits_seen.append((matmul_gflops(torch.float32),
                            float("nan") if args.float32_only else matmul_gflops(torch.bfloat16), copy_gbps()))
        prompts = encode_prompts(tokenizer, [r["prompt"] for r in rows[:n_prompts]], 512)
        for engine in engines.values():  # warm-up
            engine.generate(prompts, G, SamplingParams(max_new_tokens=4), seed=0)
        rates = {name: [] for name in engines}
        lengths = {name: [] for name in engines}
        for rep in range(args.repeats):
            for name, engine in engines.items():
                seconds, lengths_B = run(engine, prompts, G, params, seed=rep)
                rates[name].append(float(lengths_B.sum()) / seconds)
                lengths[name].append(lengths_B)
        median = collections.defaultdict(lambda: float("nan"), {name: statistics.median(r) for name, r in rates.items()})
        ratio = collections.defaultdict(lambda: float("nan"), {
            pair: statistics.median(f / h for f, h in zip(rates[pair[0]], rates[pair[1]]))
            for pair in (("fast", "hf"), ("fast", "fast oneDNN"), ("fast bf16", "hf bf16"), ("fast bf16", "hf"),
                         ("fast bf16", "fast bf16 oneDNN")) if pair[0] in rates})
        mean_length = statistics.mean(float(length.float().mean()) for ls in lengths.values() for length in ls)
        speed.append(f"| {n_prompts} x {G} | {median['hf']:.0f} | {median['fast']:.0f} | {ratio['fast', 'hf']:.2f}x | "
                     f"{median['fast oneDNN']:.0f} | {ratio['fast', 'fast oneDNN']:.2f}x | "
                     f"{median['hf bf16']:.0f} | {median['fast bf16']:.0f} | {ratio['fast bf16', 'hf bf16']:.2f}x | "
                     f"{ratio['fast bf16', 'hf']:.2f}x | {median['fast bf16 oneDNN']:.0f} | "
                     f"{ratio['fast bf16', 'fast bf16 oneDNN']:.2f}x | {mean_length:.0f} |")
        measured.append((f"{n_prompts} x {G}", rates, lengths))
        print(speed[-1], flush=True)
    # the roofline from the highest rates measured in the run: a slow moment cannot lower the bound
    fp32_rate, bf16_rate, gbps = (max(column) for column in zip(*limits_seen))
    print("\nmeasured before each row: matmul float32 " + ", ".join(f"{f:.0f}" for f, _, _ in limits_seen)
          + " GFLOP/s, bfloat16 " + ", ".join(f"{b:.0f}" for _, b, _ in limits_seen)
          + " GFLOP/s, copy " + ", ".join(f"{c:.1f}" for _, _, c in limits_seen) + " GB/s; the highest are the limits")
    # (rate, bandwidth, bytes per weight); bfloat16's products in AMX tiles outrun the measured
    # matrix-product rate: the stream alone bounds them
    fp32, bf16, bf16_stream = (fp32_rate, gbps, 4), (bf16_rate, gbps, 2), (float("inf"), gbps, 2)
    bounds = (("fast", fp32, False), ("fast", fp32, True), ("fast bf16", bf16, False), ("fast bf16", bf16, True),
              ("fast bf16", bf16_stream, False))
    roof = []
    for label, rates, lengths in measured:
        cells = []
        for name, limit, as_sampled in bounds:
            if name not in rates:
                cells.append("- | -")
                continue
            tokens_per_second = [roofline(weights, ls, limit, as_sampled) for ls in lengths[name]]
            fraction = statistics.median(r / b for r, b in zip(rates[name], tokens_per_second))
            cells.append(f"{statistics.median(tokens_per_second):.0f} | {fraction:.0%}")
        roof.append(f"| {label} | " + " | ".join(cells) + " |")
    print("\n| prompts x G | hf tok/s | fast tok/s | fast / hf | fast oneDNN tok/s | fast / fast oneDNN | hf bf16 tok/s "
          "| fast bf16 tok/s | fast bf16 / hf bf16 | fast bf16 / hf | fast bf16 oneDNN tok/s | "
          "fast bf16 / fast bf16 oneDNN | mean length |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(speed))
    print("\n| prompts x G | fp32 roofline, full batch | fast | fp32 roofline, as sampled | fast | "
          "bf16 roofline, full batch | fast bf16 | bf16 roofline, as sampled | fast bf16 | "
          "bf16 stream alone, full batch | fast bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(roof))
    print("\n| rows | float32, F.linear | float32, oneDNN | float32, covey's kernel | kernel / best other "
          "| products alone, share of the roofline | bfloat16, F.linear | bfloat16, oneDNN prepacked "
          "| bfloat16, covey's kernel | kernel / best other | products alone, share of the stream alone |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    # the least time of a decode step at the run's limits, as in the roofline above: the products alone
    # already take this share of it, which bounds the share any whole rollout on them can reach (the
    # kernel's products where it runs here, else the faster of the other two ways)
    from covey.rollout.fast import decode_kernel

    least = {torch.float32: fp32, torch.bfloat16: bf16_stream}
    arms = {dtype: ("plain", "prepacked", *(("kernel",) if decode_kernel.available(dtype) else ()))
            for dtype in ((torch.float32,) if args.float32_only else (torch.float32, torch.bfloat16))}
    for n in (1, 2, 4, 8, 16, 24, 32):
        cells = []
        for dtype, ways in arms.items():
            seconds = {name: [] for name in ways}
            for _ in range(3):  # alternating, so the ratios are taken side by side
                for name in ways:
                    seconds[name].append(matrix_products_seconds(model, n, dtype, multiply=name))
            best_other = [min(pair) for pair in zip(seconds["plain"], seconds["prepacked"])]
            used = seconds["kernel"] if "kernel" in ways else best_other
            ratio = (f"{statistics.median(a / b for a, b in zip(best_other, used)):.2f}x" if "kernel" in ways
                     else "- (the kernel does not run here)")
            share = decode_step_seconds(weights, n, *least[dtype]) / statistics.median(used)
            cells.append(" | ".join(f"{statistics.median(seconds[name]) * 1e3:.1f} ms" if name in seconds else "-"
                                    for name in ("plain", "prepacked", "kernel")) + f" | {ratio} | {share:.0%}")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
