"""Rollout speed: covey's fast engine vs transformers generate vs the machine's roofline.

Realistic rollouts of the default task: the default model, arithmetic prompts, temperature 1,
up to 128 new tokens; useful tokens are those up to and including EOS. Each row runs both engines
alternately ``--repeats`` times on the same prompts and reports medians; the ratio is taken
within the run.

    python benchmarks/rollout.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import copy_gbps, decode_roofline, load_default, machine, matmul_gflops
from covey.fast_rollout import FastEngine
from covey.rollout import HFEngine, SamplingParams
from covey.tasks import arithmetic
from covey.text import encode_prompts


def useful_tokens_per_second(engine, prompts, G, params, seed):
    start = time.perf_counter()
    rollout = engine.generate(prompts, G, params, seed=seed)
    seconds = time.perf_counter() - start
    return int(rollout.lengths_B.sum()) / seconds, float(rollout.lengths_B.float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer, eos = load_default()
    engines = {"hf": HFEngine(model, tokenizer.pad_token_id, eos),
               "fast": FastEngine(model, tokenizer.pad_token_id, eos, tokenizer)}
    gflops, gbps = matmul_gflops(), copy_gbps()
    print(f"machine: {machine()}; measured fp32 matmul {gflops:.0f} GFLOP/s, copy {gbps:.1f} GB/s\n")
    rows = arithmetic("train")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    print("| prompts x G | hf tok/s | fast tok/s | fast / hf | roofline tok/s | fast / roofline | mean length |")
    print("|---|---|---|---|---|---|---|")
    for n_prompts, G in ((1, 8), (1, 16), (2, 8), (2, 16)):
        prompts = encode_prompts(tokenizer, [r["prompt"] for r in rows[:n_prompts]], 512)
        engines["fast"].generate(prompts, G, SamplingParams(max_new_tokens=4), seed=0)  # warm-up
        rates = {name: [] for name in engines}
        lengths = []
        for rep in range(args.repeats):
            for name, engine in engines.items():
                rate, mean_length = useful_tokens_per_second(engine, prompts, G, params, seed=rep)
                rates[name].append(rate)
                lengths.append(mean_length)
        hf, fast = statistics.median(rates["hf"]), statistics.median(rates["fast"])
        ratios = [f / h for f, h in zip(rates["fast"], rates["hf"])]
        roof = decode_roofline(model, n_prompts * G, gflops, gbps)
        print(f"| {n_prompts} x {G} | {hf:.0f} | {fast:.0f} | {statistics.median(ratios):.2f}x | {roof:.0f} | "
              f"{fast / roof:.0%} | {statistics.mean(lengths):.0f} |", flush=True)


if __name__ == "__main__":
    main()
