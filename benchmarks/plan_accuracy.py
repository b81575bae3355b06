"""covey plan's estimate of a step's peak memory against the measured peak, configuration by configuration.

Each configuration trains two GRPO steps (the second has AdamW's state, as every later step does) of a
random-weight model of a real model's shapes (its vocabulary, hidden size, heads and MLP width; few
layers, so it runs on a CPU), in a fresh process (two under torchrun with gloo for FSDP2). Random
weights almost never sample EOS, so every completion runs to max_completion_length, as the estimate
assumes; prompts are cut to max_prompt_length (the plan measures the task's prompts through the
folder's character-level tokenizer: every one is longer, so it takes them at max_prompt_length too).
On a CPU the measured "device memory" is the process's RSS high-water mark (reset once the trainer is
built, after what loading freed went back to the system); it includes the runtime of python, torch,
transformers and covey, measured once in a fresh process (``baseline``) and subtracted: the table
compares the estimated step (``Breakdown.peak``) with the measured peak less that baseline.

    nice -n 10 python -m benchmarks.plan_accuracy            # every configuration, about an hour on 2 shared cores
    nice -n 10 python -m benchmarks.plan_accuracy --only smollm2-full-64
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # real models' shapes, few layers
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=4, tie_word_embeddings=True),
    "smollm2-360m": dict(model_type="llama", vocab_size=49152, hidden_size=960, intermediate_size=2560,
                         num_attention_heads=15, num_key_value_heads=5, num_hidden_layers=3, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_hidden_layers=2,
                       tie_word_embeddings=True),
}
# name: (shape, processes, config fields)
CONFIGS = {
    "smollm2-full-64": ("smollm2-135m", 1, dict(max_completion_length=64)),
    "smollm2-full-256": ("smollm2-135m", 1, dict(max_completion_length=256)),
    "smollm2-checkpointing-256": ("smollm2-135m", 1, dict(max_completion_length=256, gradient_checkpointing=True)),
    "smollm2-lora-128": ("smollm2-135m", 1, dict(max_completion_length=128, use_peft=True)),
    "smollm2-bf16-128": ("smollm2-135m", 1, dict(max_completion_length=128, bf16=True)),
    "smollm2-reference-64": ("smollm2-135m", 1, dict(max_completion_length=64, beta=0.04)),
    "smollm2-360m-micro16-128": ("smollm2-360m", 1, dict(max_completion_length=128, per_device_train_batch_size=16)),
    "qwen2.5-full-64": ("qwen2.5-0.5b", 1, dict(max_completion_length=64)),
    "qwen2.5-lora-128": ("qwen2.5-0.5b", 1, dict(max_completion_length=128, use_peft=True)),
    "qwen2.5-bf16-128": ("qwen2.5-0.5b", 1, dict(max_completion_length=128, bf16=True)),
    "qwen2.5-checkpointing-128": ("qwen2.5-0.5b", 1, dict(max_completion_length=128, gradient_checkpointing=True)),
    "qwen3-full-64": ("qwen3-0.6b", 1, dict(max_completion_length=64)),
    "qwen2.5-accumulate2-64": ("qwen2.5-0.5b", 1, dict(max_completion_length=64, per_device_train_batch_size=4,
                                                       gradient_accumulation_steps=2)),
    # a log-prob budget that holds the micro-batch's logits (8 x 256 tokens: 384 MiB at 49,152, 1,187 at 151,936)
    "smollm2-budget400-256": ("smollm2-135m", 1, dict(max_completion_length=256, logprob_budget_mib=400)),
    "qwen2.5-budget1200-256": ("qwen2.5-0.5b", 1, dict(max_completion_length=256, logprob_budget_mib=1200)),
    "smollm2-fsdp2x2-64": ("smollm2-135m", 2, dict(max_completion_length=64, fsdp="full_shard")),
    "qwen2.5-fsdp2x2-64": ("qwen2.5-0.5b", 2, dict(max_completion_length=64, fsdp="full_shard")),
}
# the runtime, measured the same way: a model too small to count, in one process and in two under FSDP2
BASELINES = {"baseline": (None, 1, dict(max_completion_length=64)),
             "baseline-fsdp2x2": (None, 2, dict(max_completion_length=64, fsdp="full_shard"))}
COMMON = dict(keep_freed_memory=False, num_generations=4, per_device_train_batch_size=8, max_prompt_length=64, max_steps=2,
              eval_max_samples=0, save_strategy="no", log_completions=False, memory_check=False)


def _hwm_bytes() -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _rss_bytes() -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def make_model_folder(shape: str, root: Path) -> Path:
    """A random-weight model of ``shape`` saved with a small character-level tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import make_tokenizer

    folder = root / shape
    if (folder / "config.json").is_file():
        return folder
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def worker(name: str, folder: str, out_dir: str) -> None:
    import torch
    from transformers import TrainerCallback

    from covey import GRPOConfig, GRPOTrainer
    from covey.plan import make_plan

    torch.set_num_threads(1)
    shape, processes, fields = CONFIGS[name] if not name.startswith("baseline") else BASELINES[name]
    args = GRPOConfig.demo(**{**COMMON, **fields}, model=folder, output_dir=out_dir)
    plan = make_plan(args, processes)
    peaks = []

    class AtStepEnd(TrainerCallback):  # the high-water mark of the steps (the final model's save comes after)
        def on_step_end(self, *a, **k):
            peaks.append(_hwm_bytes())

    trainer = GRPOTrainer(args=args, quiet=True, callbacks=[AtStepEnd()])
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # what loading freed goes back to the system (glibc)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on
    trainer.train()
    b = plan.breakdown
    print("RESULT " + json.dumps({"rank": trainer.world.rank, "estimate": b.peak, "measured": max(peaks),
                                  "phase": b.phase, **{k: v for k, v in b.parts()}}), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def baseline_worker(name: str, out_dir: str) -> None:
    """The runtime: the same two steps, measured the same way, of a model too small to count (hidden size
    32, a vocabulary of ~100): python, torch, transformers, covey and what they load as a run goes."""
    from tests.conftest import make_model, make_tokenizer

    folder = Path(out_dir) / "tiny"
    if int(os.environ.get("RANK", "0")) == 0:
        tokenizer = make_tokenizer()
        make_model(len(tokenizer)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    while not (folder / "config.json").is_file() or not list(folder.glob("*.safetensors")):
        time.sleep(0.2)
    time.sleep(0.5)
    worker(name, str(folder), str(Path(out_dir) / "run"))


def print_estimates(names: list[str]) -> None:
    """Each configuration's estimate, from a folder holding its model's config.json only (the plan reads
    nothing else)."""
    from transformers import AutoConfig

    from covey import GRPOConfig
    from covey.plan import make_plan
    from tests.conftest import make_tokenizer

    with tempfile.TemporaryDirectory(prefix="plan-estimates-") as tmp:
        for name in names:
            shape, processes, fields = CONFIGS[name]
            folder = Path(tmp) / shape
            if not folder.is_dir():
                spec = dict(SHAPES[shape])
                AutoConfig.for_model(spec.pop("model_type"), **spec).save_pretrained(folder)
                make_tokenizer().save_pretrained(folder)
            args = GRPOConfig.demo(**{**COMMON, **fields}, model=str(folder), output_dir=str(Path(tmp) / "run"))
            print(f"{name}: {make_plan(args, processes).breakdown.peak / 2**20:,.0f} MiB", flush=True)


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def run(argv: list[str], env: dict) -> list[dict]:
    out = subprocess.run(argv, capture_output=True, text=True, env=env)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines() if "RESULT " in line]
    if out.returncode != 0 or not results:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), help="these configurations only")
    parser.add_argument("--worker", choices=[*CONFIGS, *BASELINES])
    parser.add_argument("--estimates-only", action="store_true",
                        help="print each configuration's estimate (from its model's config alone) and stop")
    parser.add_argument("--folder")
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    if args.worker in BASELINES:
        return baseline_worker(args.worker, args.out_dir)
    if args.worker:
        return worker(args.worker, args.folder, args.out_dir)
    if args.estimates_only:
        return print_estimates(args.only or list(CONFIGS))
    # glibc hands back what a pass frees (as a GPU's allocator reuses it), so the RSS follows what is in use
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent / "src"),
                                          str(Path(__file__).resolve().parent.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    me = [sys.executable, "-m", "benchmarks.plan_accuracy"]

    def launch(worker: str, processes: int, *more: str) -> list[dict]:
        if processes == 1:
            return run(me + ["--worker", worker, *more], env)
        return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
                    "-m", "benchmarks.plan_accuracy", "--worker", worker, *more], env)

    runs = [name for name in args.only or list(CONFIGS)]
    baselines = {}  # processes -> the runtime of each process
    for name, (_, processes, _) in BASELINES.items():
        if any(CONFIGS[run_name][1] == processes for run_name in runs):
            with tempfile.TemporaryDirectory(prefix="plan-baseline-") as tmp:
                baselines[processes] = max(r["measured"] for r in launch(name, processes, "--out-dir", tmp))
    print(f"CPU: {cpu_name()}; runtime baseline (peak RSS of the same steps of a tiny model, per process): "
          + ", ".join(f"{b / 2**20:.0f} MiB ({p} process{'es' if p > 1 else ''})" for p, b in baselines.items()))
    print("| configuration | processes | estimate (MiB) | measured - baseline (MiB) | error | phase |")
    print("|---|---|---|---|---|---|")
    errors = []
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        for name in runs:
            shape, processes, _ = CONFIGS[name]
            folder = make_model_folder(shape, Path(tmp))
            out_dir = str(Path(tmp) / f"run-{name}")
            started = time.time()
            results = launch(name, processes, "--folder", str(folder), "--out-dir", out_dir)
            worst = max(results, key=lambda r: r["measured"])  # the process that held most
            measured = worst["measured"] - baselines[processes]
            error = worst["estimate"] / measured - 1
            errors.append(abs(error))
            print(f"| {name} | {processes} | {worst['estimate'] / 2**20:,.0f} | {measured / 2**20:,.0f} | "
                  f"{error:+.1%} | {worst['phase']} |", flush=True)
            print(f"<!-- {name}: {time.time() - started:.0f} s; parts (MiB): " + ", ".join(
                f"{k} {v / 2**20:.0f}" for k, v in worst.items()
                if k not in ("rank", "estimate", "measured", "phase")) + " -->", flush=True)
    print(f"\nlargest error: {max(errors):.1%} over {len(errors)} configurations")


if __name__ == "__main__":
    main()
