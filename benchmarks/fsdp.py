"""Memory and step time of each process: one process, and two under DDP against two under FSDP2.

CPU processes (torchrun, gloo, one thread each) train the default model, full fine-tuning, on 1 prompt x
4 generations each, up to 32 completion tokens, for a few steps, sampling with the fast engine: one
process; two under DistributedDataParallel (each holds the whole model, its gradients and AdamW's
state); two under ``fsdp: full_shard`` (each holds half of each, and the fast engine samples from a whole
copy of the weights, refreshed from the shards before each round). Variants alternate, each in fresh
processes. Each process reports what it holds (bytes of its parameters, of its gradients at the optimizer
step, of its optimizer state, of the engine's copy), its peak RSS while training (the kernel's high-water
mark, reset once the trainer is built and what it freed is handed back, so that loading and sharding
the model do not count) and the median of its
steps' time/train (forward, backward, gradient reduction and optimizer step; the first step warms up).
The processes run with glibc's mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_), so that the
memory a pass frees is handed back and the RSS follows what is in use.

    python -m benchmarks.fsdp --repeats 3
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
from pathlib import Path

import torch

from benchmarks.common import alternating_runs, results_of_two_processes

VARIANTS = {"one process": (1, ""), "two, DDP": (2, ""), "two, FSDP2": (2, "full_shard")}


def _local_bytes(tensors) -> int:
    """Bytes this process holds of ``tensors`` (a sharded one's local shard)."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _peak_rss_mib() -> float:
    """The process's RSS high-water mark since it was last reset (Linux: VmHWM)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def worker(variant: str, steps: int, out_dir: str) -> None:
    from covey import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    args = GRPOConfig.demo(num_generations=4, per_device_train_batch_size=4, max_completion_length=32, max_steps=steps,
                      eval_max_samples=0, save_steps=0, log_completions=False, output_dir=out_dir,
                      fsdp=VARIANTS[variant][1])
    trainer = GRPOTrainer(args=args, quiet=True)
    grads, step = [], trainer.optimizer.step

    def recording_step(*a, **k):
        grads.append(_local_bytes(p.grad for p in trainer.model.parameters() if p.grad is not None))
        return step(*a, **k)

    trainer.optimizer.step = recording_step
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # what loading and sharding freed goes back to the system (glibc)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on
    trainer.train()
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    copy = trainer.parts.sampler.policy_copy
    mib = 2 ** 20
    print("RESULT " + json.dumps({
        "rank": trainer.world.rank, "train_s": statistics.median(line["time/train"] for line in trainer.history[1:])
        if trainer.world.is_main else None,  # logged by the first process (they wait for each other in each step)
        "parameters_mib": _local_bytes(trainer.model.parameters()) / mib, "gradients_mib": max(grads) / mib,
        "optimizer_mib": _local_bytes(state) / mib,
        "engine_copy_mib": 0.0 if copy is None else _local_bytes(copy.model.parameters()) / mib,
        "peak_mib": _peak_rss_mib()}), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def measure(variant: str, steps: int) -> list[dict]:
    """One run; each process's result, by rank."""
    results = results_of_two_processes("benchmarks.fsdp", variant, steps, processes=VARIANTS[variant][0])
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    # every block over 128 KiB its own mapping, handed back when freed: without it glibc raises that threshold
    # as large blocks are freed, and keeps what FSDP2's per-block gathers free, so RSS would not follow use
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    runs = alternating_runs(__doc__.splitlines()[0], list(VARIANTS), 4, worker, measure)
    if runs is None:  # a worker
        return
    print("| run | process | parameters (MiB) | gradients (MiB) | AdamW state (MiB) | engine's copy (MiB) "
          "| peak RSS training (MiB), median | per run | time/train (s), median |")
    print("|---|---|---|---|---|---|---|---|---|")
    for variant, results in runs.items():
        for rank in range(VARIANTS[variant][0]):
            mine = [run[rank] for run in results]

            def median(key):
                return statistics.median(r[key] for r in mine)
            peaks = [r["peak_mib"] for r in mine]
            seconds = f"{median('train_s'):.2f}" if rank == 0 else "(as process 0)"
            print(f"| {variant} | {rank} | {median('parameters_mib'):.0f} | {median('gradients_mib'):.0f} | "
                  f"{median('optimizer_mib'):.0f} | {median('engine_copy_mib'):.0f} | {statistics.median(peaks):.0f} | "
                  f"{', '.join(f'{p:.0f}' for p in peaks)} | {seconds} |", flush=True)


if __name__ == "__main__":
    main()
