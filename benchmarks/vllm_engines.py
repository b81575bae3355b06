"""covey's fast engine against colocated vLLM on this machine: rollouts and whole GRPO steps, in float32
and bfloat16, side by side in one run, with vLLM's start-up time reported apart.

The default model, arithmetic prompts, temperature 1. Rollouts: 2 prompts x 8 and x 16 samples of up to
128 tokens (useful tokens: up to and including EOS). GRPO steps: the step benchmark's work (2 prompts x
8, up to 64 tokens, beta 0.04), the default run's rewards. Each dtype runs in a fresh process that holds
one vLLM engine and a fast engine, and alternates them ``--repeats`` times on the same work; medians,
and the ratio within the run. The first step of each training run is left out as warm-up.

    make vllm-env
    .venv-vllm/bin/python -m benchmarks.vllm_engines --repeats 3 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import machine
from benchmarks.step import COMMON

DTYPES = ("float32", "bfloat16")


def rollout_rates(engines: dict, prompts, repeats: int) -> dict:
    from covey.rollout import SamplingParams

    params = SamplingParams(max_new_tokens=128, temperature=1.0)
    rates: dict = {}
    for G in (8, 16):
        runs: dict[str, list[float]] = {name: [] for name in engines}
        for seed in range(repeats):
            for name, engine in engines.items():
                start = time.perf_counter()
                rollout = engine.generate(prompts, G, params, seed=seed)
                runs[name].append(float(rollout.lengths_B.sum()) / (time.perf_counter() - start))
        rates[G] = {name: statistics.median(r) for name, r in runs.items()}
    return rates


def step_times(vllm_engine, bf16: bool, steps: int, repeats: int) -> dict:
    from covey import GRPOConfig, GRPOTrainer

    runs: dict[str, list[dict]] = {"fast": [], "vllm": []}
    for _ in range(repeats):
        for name in runs:
            with tempfile.TemporaryDirectory() as folder:
                args = GRPOConfig.demo(**COMMON, max_steps=steps, eval_max_samples=0, output_dir=f"{folder}/run",
                                  log_completions=False, bf16=bf16, rollout_engine=name)
                trainer = GRPOTrainer(args=args, rollout_engine=vllm_engine if name == "vllm" else None, quiet=True)
                trainer.train()
                runs[name] += trainer.history[1:]
    return {name: {"step_s": statistics.median(m["step_time"] for m in history),
                   "generate_s": statistics.median(m["time/generate"] for m in history),
                   "engine_weight": statistics.median(m.get("engine_is/mean_weight", 1.0) for m in history)}
            for name, history in runs.items()}


def worker(dtype: str, steps: int, repeats: int) -> None:
    from benchmarks.common import load_default
    from covey.data.tasks import arithmetic
    from covey.data.text import encode_prompts
    from covey.rollout.engine import EngineSettings
    from covey.rollout.fast.engine import FastEngine
    from covey.rollout.vllm_engine import VLLMEngine
    from covey.rollout import SamplingParams

    model, tokenizer, eos = load_default()
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in arithmetic("train")[:2]], 512)
    start = time.perf_counter()
    settings = EngineSettings(dtype=dtype, seed=0, max_model_len=1024, gpu_memory_utilization=0.05)
    vllm = VLLMEngine(settings, tokenizer.pad_token_id, eos, policy=model)
    started = time.perf_counter() - start
    fast = FastEngine(model, tokenizer.pad_token_id, eos, tokenizer, bf16=dtype == "bfloat16")
    engines = {"fast": fast, "vllm": vllm}
    for engine in engines.values():  # warm-up (vLLM's first push included)
        engine.generate(prompts, 2, SamplingParams(max_new_tokens=8), seed=0)
    result = {"start_s": started, "rollouts": rollout_rates(engines, prompts, repeats),
              "steps": step_times(vllm, dtype == "bfloat16", steps, repeats)}
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--worker", choices=DTYPES)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.repeats)
        return
    print(f"machine: {machine()}")
    results = {}
    for dtype in args.dtypes:
        out = subprocess.run([sys.executable, "-m", "benchmarks.vllm_engines", "--worker", dtype, "--steps",
                              str(args.steps), "--repeats", str(args.repeats)], capture_output=True, text=True,
                             env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        line = next((text for text in out.stdout.splitlines() if text.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"the {dtype} run failed:\n{out.stderr[-4000:]}")
        results[dtype] = json.loads(line[len("RESULT "):])
    print("\n| dtype | vLLM start (s) |\n|---|---|")
    for dtype, r in results.items():
        print(f"| {dtype} | {r['start_s']:.0f} |")
    print("\n| dtype | rollout | fast tok/s | vLLM tok/s | vLLM / fast |\n|---|---|---|---|---|")
    for dtype, r in results.items():
        for G, rates in r["rollouts"].items():
            print(f"| {dtype} | 2 x {G} | {rates['fast']:.0f} | {rates['vllm']:.0f} | {rates['vllm'] / rates['fast']:.2f}x |")
    print("\n| dtype | engine | s / step | of which generate (s) | engine/trainer weight |\n|---|---|---|---|---|")
    for dtype, r in results.items():
        for name, s in r["steps"].items():
            print(f"| {dtype} | {name} | {s['step_s']:.2f} | {s['generate_s']:.2f} | {s['engine_weight']:.4f} |")
        print(f"| {dtype} | vLLM / fast | {r['steps']['vllm']['step_s'] / r['steps']['fast']['step_s']:.2f}x | | |")


if __name__ == "__main__":
    main()
