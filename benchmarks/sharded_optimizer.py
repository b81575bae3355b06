"""Memory of each process in a run of two, with AdamW's state whole in each or sharded between them.

Two CPU processes (gloo, one thread each) train the default model, full fine-tuning, beta 0.04,
on 1 prompt x 4 generations each, up to 32 completion tokens, for a few steps with a checkpoint
after the second (which gathers a sharded state in the first process); once with
``shard_optimizer_state: false`` and once with ``true``, alternating, each in fresh processes. Each
process reports its own peak RSS, the optimizer state it holds and its time per step.

    python -m benchmarks.sharded_optimizer --repeats 3
"""

from __future__ import annotations

import json
import resource
import statistics
import time

import torch

from benchmarks.common import alternating_runs, results_of_two_processes

VARIANTS = {"whole": False, "sharded": True}


def worker(variant: str, steps: int, out_dir: str) -> None:
    from covey import GRPOConfig, GRPOTrainer
    from covey.train.distributed import sharded_part

    torch.set_num_threads(1)
    args = GRPOConfig.demo(num_generations=4, per_device_train_batch_size=4, max_completion_length=32, beta=0.04,
                      max_steps=steps, eval_max_samples=0, save_steps=2, log_completions=False, output_dir=out_dir,
                      shard_optimizer_state=VARIANTS[variant])
    trainer = GRPOTrainer(args=args, quiet=True)
    start = time.perf_counter()
    trainer.train()
    seconds = (time.perf_counter() - start) / steps
    held = (sharded_part(trainer.optimizer) or trainer.optimizer).state.values()
    state_bytes = sum(t.numel() * t.element_size() for s in held for t in s.values() if isinstance(t, torch.Tensor))
    print("RESULT " + json.dumps({"rank": trainer.world.rank, "seconds_per_step": seconds,
                                  "optimizer_state_mib": state_bytes / 2 ** 20,
                                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
    torch.distributed.destroy_process_group()


def measure(variant: str, steps: int) -> list[dict]:
    """One run of two processes; each one's result, by rank."""
    return sorted(results_of_two_processes("benchmarks.sharded_optimizer", variant, steps), key=lambda r: r["rank"])


def main() -> None:
    runs = alternating_runs(__doc__.splitlines()[0], list(VARIANTS), 3, worker, measure)
    if runs is None:  # a worker
        return
    print("| optimizer state | process | peak RSS (MiB), median | per run | optimizer state held (MiB) | s / step |")
    print("|---|---|---|---|---|---|")
    for variant, results in runs.items():
        for rank in (0, 1):
            mine = [run[rank] for run in results]
            peaks = [r["peak_mib"] for r in mine]
            print(f"| {variant} | {rank} | {statistics.median(peaks):.0f} | {', '.join(f'{p:.0f}' for p in peaks)} | "
                  f"{statistics.median(r['optimizer_state_mib'] for r in mine):.0f} | "
                  f"{statistics.median(r['seconds_per_step'] for r in mine):.1f} |", flush=True)
    for rank in (0, 1):
        saved = [w[rank]["peak_mib"] - s[rank]["peak_mib"] for w, s in zip(runs["whole"], runs["sharded"])]
        print(f"process {rank}: peak RSS lower by {statistics.median(saved):.0f} MiB sharded "
              f"(per pair: {', '.join(f'{x:.0f}' for x in saved)})")


if __name__ == "__main__":
    main()
