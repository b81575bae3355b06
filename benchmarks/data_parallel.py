"""Two processes summing their gradients with DistributedDataParallel: while the backward runs (its
buckets of 25 MB, each all-reduced as soon as its gradients are ready) against after it (one bucket
that holds every gradient, all-reduced once the backward is done), on the same work.

Two CPU processes (torchrun, gloo, one thread each) train the default model, full fine-tuning, on 1
prompt x 8 generations each, up to 32 completion tokens, 2 micro-batches of 4 per optimizer step (the
first without gradient sync), for a few steps; the two variants alternate, each in fresh processes.
The first process reports the median of its steps' training time (``time/train``: the forward and backward
passes, the summing of gradients and the optimizer step, without sampling and scoring).

    python -m benchmarks.data_parallel --repeats 3
"""

from __future__ import annotations

import json
import statistics


from benchmarks.common import alternating_runs, results_of_two_processes

# DistributedDataParallel's bucket size in MB: its default, and one bucket for every gradient of the model
VARIANTS = {"while the backward runs": 25, "after the backward": 100_000}


def worker(variant: str, steps: int, out_dir: str) -> None:
    import torch.nn.parallel

    from covey import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    class Bucketed(torch.nn.parallel.DistributedDataParallel):  # what covey builds, with this bucket size
        def __init__(self, *args, **kwargs):
            super().__init__(*args, bucket_cap_mb=VARIANTS[variant], **kwargs)

    torch.nn.parallel.DistributedDataParallel = Bucketed
    args = GRPOConfig.demo(num_generations=8, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      max_completion_length=32, max_steps=steps, eval_max_samples=0, save_steps=0,
                      log_completions=False, output_dir=out_dir)
    trainer = GRPOTrainer(args=args, quiet=True)
    trainer.train()
    if trainer.world.is_main:  # which logs the steps (the processes wait for each other in every backward)
        train_times = [line["time/train"] for line in trainer.history[1:]]  # the first step warms up
        print("RESULT " + json.dumps({"train_s": statistics.median(train_times)}), flush=True)
    torch.distributed.destroy_process_group()


def measure(variant: str, steps: int) -> float:
    """One run of two processes: the first's median time/train."""
    return results_of_two_processes("benchmarks.data_parallel", variant, steps)[0]["train_s"]


def main() -> None:
    runs = alternating_runs(__doc__.splitlines()[0], list(VARIANTS), 4, worker, measure)
    if runs is None:  # a worker
        return
    print("| gradients summed | time/train (s), median | per run |")
    print("|---|---|---|")
    for variant, times in runs.items():
        print(f"| {variant} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |", flush=True)
    ratios = [after / during for during, after in zip(runs["while the backward runs"], runs["after the backward"])]
    print(f"after the backward / while it runs, per pair: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
