"""The cost of a call that can be stopped: a tool call in its worker process against one in a thread
of the trainer's process (as before), and a reward call in a child forked for it against a direct call,
in a process holding 512 MiB (as a trainer holds its model). Medians of many calls, in milliseconds.

    python -m benchmarks.stoppable_calls
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import machine
from covey.agents.tools import ToolWorkers, as_tool, calculate, call_tool
from covey.rewards.scoring import call_reward


def median_ms(call, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def constant(completions, **kwargs):
    return [1.0] * len(completions)


def main() -> None:
    held = torch.ones(128 * 2 ** 20)  # noqa: F841 - 512 MiB, as a model would be
    tool = as_tool(calculate)
    workers = ToolWorkers([tool])
    batch = dict(prompts=["p"] * 8, completions=["c"] * 8, completion_ids=[[1]] * 8)
    try:
        print(f"{machine()}; medians, ms per call")
        print("| call | ms |\n|---|---|")
        print(f"| tool in its worker process (stoppable) | {median_ms(lambda: call_tool(tool, {'expression': '6*7'}, 10.0, workers), 200):.3f} |")
        print(f"| tool in a thread (abandoned past its limit) | {median_ms(lambda: call_tool(tool, {'expression': '6*7'}, 10.0), 200):.3f} |")
        print(f"| reward of a batch of 8 in a forked child (stoppable) | {median_ms(lambda: call_reward(constant, batch, 10.0), 30):.1f} |")
        print(f"| reward of a batch of 8, direct (no reward_timeout) | {median_ms(lambda: call_reward(constant, batch, None), 30):.4f} |")
    finally:
        workers.close()


if __name__ == "__main__":
    main()
