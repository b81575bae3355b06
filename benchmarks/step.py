"""One GRPO step, covey vs TRL's GRPOTrainer, on the same work and the same machine.

Same model (the default, SmolLM2-135M-Instruct), 2 prompts x 8 generations of the arithmetic
task, up to 64 completion tokens, beta 0.04, the same two rewards; full fine-tuning and LoRA;
TRL's defaults otherwise (covey is given the same learning rate, loss type and sampling). Each
measurement runs in a fresh process (so peak memory is that run's own); the variants alternate,
``--repeats`` times, and the first step of every run is left out as warm-up.

Variants: ``covey`` (float32), ``covey-rollout-bf16`` (float32 training, bfloat16 sampling),
``covey-bf16`` (bf16: true), ``covey-bf16-rollout-fp32`` (bf16 training, float32 sampling),
``covey-freed-memory-kept`` (float32, keep_freed_memory: true),
``trl`` (float32, bf16=False) and ``trl-bf16`` (TRL's own default, bf16 mixed precision). Each covey
variant is compared with each TRL variant of the same run, and with the first covey variant listed.
Where each step's time goes is printed after, per phase (``PHASES``): covey's from its own timings
(``time/generate``, ``time/score``, ``time/logprobs``, ``time/train`` in metrics.jsonl), TRL's by timing its trainer's methods
(``_generate``, ``_calculate_rewards``, the rest of ``_generate_and_score_completions``: the log-probs of
the sampling policy and the reference; and the rest of the step: the loss, backward and optimizer step).

    pip install -e .[bench]          # trl
    python -m benchmarks.step --repeats 2 --steps 4 --variants covey covey-rollout-bf16 trl
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

COMMON = dict(num_generations=8, per_device_train_batch_size=16, max_completion_length=64, beta=0.04,
              learning_rate=1e-6, seed=42)
# a step's phases: sampling, the rewards, the log-probs taken before the update (the old policy's and the
# reference's), the update (forward with the loss, backward, optimizer step)
PHASES = ("generate", "score", "logprobs", "update")


VARIANTS = {"covey": {}, "covey-rollout-bf16": {"rollout_bf16": True}, "covey-bf16": {"bf16": True},
            "covey-bf16-rollout-fp32": {"bf16": True, "rollout_bf16": False},
            "covey-freed-memory-kept": {"keep_freed_memory": True},
            "trl": {"bf16": False}, "trl-bf16": {"bf16": True}}


def run_covey(mode: str, steps: int, out_dir: str, settings: dict) -> list[dict]:
    from covey import GRPOConfig, GRPOTrainer

    args = GRPOConfig.demo(**COMMON, max_steps=steps, eval_max_samples=0, output_dir=out_dir, log_completions=False,
                      use_peft=mode == "lora", lora_target_modules=["all-linear"], **settings)  # TRL's below
    GRPOTrainer(args=args, quiet=True).train()
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    return [{"seconds": m["step_time"], "tokens": m["completions/mean_length"] * 16,
             "phases": {"generate": m["time/generate"], "score": m["time/score"], "logprobs": m["time/logprobs"],
                        "update": m["time/train"]}} for m in metrics]


def run_trl(mode: str, steps: int, out_dir: str, settings: dict) -> list[dict]:
    import datasets
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from covey.sources import EMBEDDED_MODEL
    from covey.models import embedded_model_folder
    from covey.rewards import answer_correct, answer_format
    from covey.data.tasks import arithmetic

    class Timer(TrainerCallback):
        def __init__(self):
            self.records, self.start, self.length = [], 0.0, None

        def on_step_begin(self, *a, **k):
            self.start, self.phases = time.perf_counter(), dict.fromkeys(PHASES, 0.0)

        def on_step_end(self, *a, **k):
            seconds = time.perf_counter() - self.start
            phases = {**self.phases, "logprobs": self.phases["logprobs"] - self.phases["generate"] - self.phases["score"]}
            self.records.append({"seconds": seconds, "phases": {**phases, "update": seconds - sum(phases.values())}})

        def timed(self, phase, method):
            def run(*a, **k):
                start = time.perf_counter()
                try:
                    return method(*a, **k)
                finally:
                    self.phases[phase] += time.perf_counter() - start
            return run

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs and self.records:
                self.records[-1]["tokens"] = logs["completions/mean_length"] * 16

    rows = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic("train")])
    config = GRPOConfig(**COMMON, max_steps=steps, output_dir=out_dir, logging_steps=1, report_to="none",
                        use_cpu=True, save_strategy="no", **settings)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM") if mode == "lora" else None
    timer = Timer()
    trainer = GRPOTrainer(model=str(embedded_model_folder(EMBEDDED_MODEL)), reward_funcs=[answer_format, answer_correct],
                          args=config, train_dataset=rows, peft_config=lora, callbacks=[timer])
    for phase, name in (("generate", "_generate"), ("score", "_calculate_rewards"),
                        ("logprobs", "_generate_and_score_completions")):  # logprobs: less the two inside it
        setattr(trainer, name, timer.timed(phase, getattr(trainer, name)))
    trainer.train()
    return timer.records


def worker(variant: str, mode: str, steps: int) -> None:
    run = run_covey if variant.startswith("covey") else run_trl
    with tempfile.TemporaryDirectory() as out_dir:
        records = run(mode, steps, os.path.join(out_dir, "run"), VARIANTS[variant])
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"records": records, "peak_mib": peak_mib}))


def measure(variant: str, mode: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.step", "--worker", variant, "--mode", mode,
                          "--steps", str(steps)],
                         capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    line = next((text for text in out.stdout.splitlines() if text.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{variant} {mode} failed:\n{out.stderr[-3000:]}")
    result = json.loads(line[len("RESULT "):])
    timed = result["records"][1:]  # the first step warms caches up
    result["seconds"] = statistics.median(r["seconds"] for r in timed)
    result["tokens_per_second"] = statistics.median(r["tokens"] / r["seconds"] for r in timed if "tokens" in r)
    result["phases"] = {p: statistics.median(r["phases"].get(p, 0.0) for r in timed) for p in PHASES}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["full", "lora"])
    parser.add_argument("--variants", nargs="+", default=["covey", "covey-rollout-bf16", "trl"], choices=list(VARIANTS))
    parser.add_argument("--worker", choices=list(VARIANTS))
    parser.add_argument("--mode", default="full")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.mode, args.steps)
        return
    print("| mode | variant | s / step | completion tok/s | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    for mode in args.modes:
        runs: dict[str, list[dict]] = {variant: [] for variant in args.variants}
        for _ in range(args.repeats):
            for variant in args.variants:
                runs[variant].append(measure(variant, mode, args.steps))
        for variant, results in runs.items():
            print(f"| {mode} | {variant} | {statistics.median(r['seconds'] for r in results):.1f} | "
                  f"{statistics.median(r['tokens_per_second'] for r in results):.1f} | "
                  f"{max(r['peak_mib'] for r in results):.0f} |", flush=True)
        coveys = [v for v in args.variants if v.startswith("covey")]
        for ours in coveys:
            for theirs in [v for v in args.variants if v.startswith("trl")] + coveys[:1] * (ours != coveys[0]):
                ratios = [c["tokens_per_second"] / t["tokens_per_second"] for c, t in zip(runs[ours], runs[theirs])]
                print(f"| {mode} | {ours} / {theirs} | | {statistics.median(ratios):.2f}x (per pair: "
                      f"{', '.join(f'{r:.2f}' for r in ratios)}) | |", flush=True)
        print(f"\n| {mode}: seconds per step | {' | '.join(PHASES)} | whole step |\n|---|" + "---|" * (len(PHASES) + 1))
        for variant, results in runs.items():  # the median over runs of each run's median step
            phases = [statistics.median(r["phases"][p] for r in results) for p in PHASES]
            print(f"| {variant} | {' | '.join(f'{t:.2f}' for t in phases)} | "
                  f"{statistics.median(r['seconds'] for r in results):.2f} |", flush=True)


if __name__ == "__main__":
    main()
