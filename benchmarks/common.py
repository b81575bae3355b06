"""Shared helpers of the benchmarks: the machine's measured limits and the default model."""

from __future__ import annotations

import platform
import statistics
import time

import torch


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def matmul_gflops(n: int = 1024, repeats: int = 20) -> float:
    """Measured float32 matmul rate (GFLOP/s), median of several timings."""
    a, b = torch.randn(n, n), torch.randn(n, n)
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


def decode_roofline(model: torch.nn.Module, batch: int, gflops: float, gbps: float) -> float:
    """Upper bound on generated tokens/s at this batch size: each decode step reads every weight
    once (memory) and does 2 FLOPs per weight per row (compute); the slower of the two wins."""
    params = sum(p.numel() for p in model.parameters())
    if getattr(model.config, "tie_word_embeddings", False):
        params += model.get_output_embeddings().weight.numel()  # the head is read and multiplied too
    flops_per_token = 2 * params
    step_seconds = max(batch * flops_per_token / (gflops * 1e9), params * 4 / (gbps * 1e9))
    return batch / step_seconds


def load_default():
    from covey.config import EMBEDDED_MODEL
    from covey.models import eos_token_ids, load_policy, load_tokenizer

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    model = load_policy(EMBEDDED_MODEL).eval()
    return model, tokenizer, eos_token_ids(model, tokenizer)
