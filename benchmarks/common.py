"""Shared helpers of the benchmarks: the machine's measured limits and the default model."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def matmul_gflops(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 20) -> float:
    """Measured matrix-product rate (GFLOP/s) in ``dtype``, median of several timings."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / statistics.median(times) / 1e9


def copy_gbps(mib: int = 256, repeats: int = 10) -> float:
    """Measured memory bandwidth (GB/s) of a large tensor copy (read + write)."""
    src = torch.empty(mib * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def weights_per_step(model: torch.nn.Module) -> int:
    """Weights a decode step reads and multiplies: all but the embedding table, which is only
    indexed (a few rows); the head in full, even when it shares the embedding's tensor."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embedding) + (head.numel() if head is embedding else 0)


def decode_step_seconds(weights: int, rows: int, gflops: float, gbps: float, bytes_per_weight: int) -> float:
    """Least time of one decode step over ``rows`` rows: every weight is read once (memory) and does
    2 FLOPs per row (compute); the slower of the two bounds the step."""
    return max(rows * 2 * weights / (gflops * 1e9), weights * bytes_per_weight / (gbps * 1e9))


def matrix_products_seconds(model: torch.nn.Module, rows: int, dtype: torch.dtype, repeats: int = 5,
                            multiply: str = "fastest") -> float:
    """Time of one decode step's matrix products alone (the lean decoder's own weights for a step of
    ``rows`` rows, read from memory as in a real step): what the machine's matrix library allows,
    before any other work. ``multiply``: how they multiply (``covey.rollout.fast.decoder.WAYS_TO_MULTIPLY``)."""
    from covey.rollout.fast.decoder import LeanDecoder

    decoder = LeanDecoder(model, dtype, max_length=1, multiply=multiply)
    hidden = model.config.hidden_size
    sizes = dict(qkv=hidden, o=decoder.n_heads * decoder.head_dim, gate_up=hidden, down=model.config.intermediate_size)
    inputs = {name: torch.randn(rows, size).to(dtype) for name, size in sizes.items()}
    step = decoder.products_for(rows)

    def run():
        for layer in step.layers:
            for name, multiply in layer.items():
                multiply(inputs[name])
        step.head(inputs["qkv"])

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_default():
    from covey.sources import EMBEDDED_MODEL
    from covey.models import eos_token_ids, load_policy, load_tokenizer

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    model = load_policy(EMBEDDED_MODEL).eval()
    return model, tokenizer, eos_token_ids(model, tokenizer)


def alternating_runs(description: str, variants: list[str], steps: int, worker, measure) -> dict[str, list] | None:
    """The command line of a two-process benchmark: as ``--worker VARIANT`` (inside torchrun) call
    ``worker(variant, steps, out_dir)`` and return None; else ``--repeats`` rounds of ``measure(variant,
    steps)`` for each variant in turn, each in fresh processes: every variant's results, in order."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--worker", choices=variants)
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out_dir)
        return None
    runs: dict[str, list] = {variant: [] for variant in variants}
    for _ in range(args.repeats):
        for variant in variants:
            runs[variant].append(measure(variant, args.steps))
    return runs


def results_of_two_processes(module: str, variant: str, steps: int, processes: int = 2) -> list[dict]:
    """``python -m module --worker variant --steps steps --out-dir DIR`` in two processes (or ``processes``)
    of one torchrun (fresh, in a temporary folder); the JSON each printed on a line ``RESULT {...}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                              str(processes),
                              "-m", module, "--worker", variant, "--steps", str(steps),
                              "--out-dir", os.path.join(tmp, "run")],
                             capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    # flat JSON objects, found wherever they are: two processes' lines can run into each other
    results = [json.loads(found) for found in re.findall(r"RESULT (\{[^{}]*\})", out.stdout)]
    if out.returncode != 0 or not results:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-3000:]}")
    return results


def wait_for_server(process: subprocess.Popen, port: int, log_tail, timeout_s: float = 600, poll_s: float = 1) -> None:
    """Until the covey server ``process`` answers on ``port``'s /health; if it exits or ``timeout_s`` passes
    first, a RuntimeError with ``log_tail()``, the end of its log."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"covey server did not start:\n{log_tail()}") from None
            time.sleep(poll_s)
