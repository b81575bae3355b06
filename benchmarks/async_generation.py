"""Step time and completion tokens/s, synchronous against asynchronous generation, on the same work.

The default model, full fine-tuning, 2 prompts x 4 generations per round of up to 48 completion tokens,
one optimizer step per round, sampling with the fast engine. Synchronous: the process samples, scores
and trains in turn on all cores. Asynchronous (``async_generation: true``, one round ahead): a worker
thread samples and scores the next round while the trainer trains, each on half the cores. Each run is a
fresh process; variants alternate. Per run: the median of its steps' wall time (the first two steps warm
up and are left out), completion tokens per second over those steps, and under async the median time
the trainer waited for a round and the worker for weights. ``--reward-latency S`` adds a reward that
waits S seconds per call, as a remote judge or a sandbox would (it reports 0, so it changes no reward).

``--server fast|vllm`` samples from a server in its own process instead (``covey server --backend``,
started once for every run; ``vllm`` needs vLLM installed), the generator pinned to one core and the
trainer to the other, as ``rollout_engine: vllm, vllm_mode: server`` runs; the asynchronous worker then
only sends requests and scores, and the trainer keeps its core's threads.

    python -m benchmarks.async_generation --repeats 3 --steps 8
    python -m benchmarks.async_generation --repeats 3 --steps 8 --reward-latency 1.5
    .venv-vllm/bin/python -m benchmarks.async_generation --repeats 3 --steps 8 --server vllm
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import machine, wait_for_server

VARIANTS = ("synchronous", "asynchronous")
WARMUP_STEPS = 2


def worker(variant: str, steps: int, out_dir: str, reward_latency: float, server_port: int) -> None:
    import time

    from covey import GRPOConfig, GRPOTrainer

    def remote_judge(completions, **kwargs):
        time.sleep(reward_latency)
        return [0.0] * len(completions)

    args = GRPOConfig.demo(num_generations=4, per_device_train_batch_size=8, max_completion_length=48, max_steps=steps,
                      eval_max_samples=0, save_steps=0, log_completions=False, output_dir=out_dir,
                      async_generation=variant == "asynchronous", logging_steps=1,
                      **(dict(rollout_engine="vllm", vllm_mode="server", vllm_server_port=server_port)
                         if server_port else {}))
    funcs = list(args.reward_funcs) + ([remote_judge] if reward_latency else [])
    trainer = GRPOTrainer(args=args, reward_funcs=funcs, quiet=True)
    trainer.train()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if r.get("step", 0) > WARMUP_STEPS and "step_time" in r]
    seconds = sum(r["step_time"] for r in measured)
    tokens = sum(r["completions/mean_length"] * args.generation_batch_size for r in measured)
    result = {"step_time": statistics.median(r["step_time"] for r in measured), "tokens_per_second": tokens / seconds,
              "wait_for_data": statistics.median(r.get("time/wait_for_data", 0.0) for r in measured),
              "wait_for_weights": statistics.median(r.get("time/wait_for_weights", 0.0) for r in measured),
              "generate": statistics.median(r["time/generate"] for r in measured),
              "score": statistics.median(r["time/score"] for r in measured),
              "train": statistics.median(r["time/train"] for r in measured)}
    print("RESULT " + json.dumps(result))


def pinned(core: int | None) -> list[str]:
    """A command prefix that runs it on one core (nothing where taskset is missing or no core is named)."""
    return ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []


def measure(variant: str, steps: int, reward_latency: float, server_port: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([*pinned(0 if server_port else None), sys.executable, "-m", "benchmarks.async_generation",
                              "--worker", variant, "--steps", str(steps), "--out-dir", os.path.join(tmp, "run"),
                              "--reward-latency", str(reward_latency), "--server-port", str(server_port)],
                             capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    line = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


@contextlib.contextmanager
def server(backend: str | None):
    """``covey server --backend backend`` on the default model, on core 1, until the runs are done; its port
    (0: no server)."""
    if backend is None:
        yield 0
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile()
    process = subprocess.Popen([*pinned(1), sys.executable, "-m", "covey", "server", "--backend", backend, "--port",
                                str(port), "--max-completion-length", "48"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_server(process, port, lambda: log.seek(0) or log.read().decode()[-3000:], poll_s=2)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--out-dir")
    parser.add_argument("--reward-latency", type=float, default=0.0)
    parser.add_argument("--server", choices=("fast", "vllm"))
    parser.add_argument("--server-port", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.out_dir, args.reward_latency, args.server_port)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with server(args.server) as port:
        for _ in range(args.repeats):
            for variant in VARIANTS:
                runs[variant].append(measure(variant, args.steps, args.reward_latency, port))
    where = f"a {args.server} server on core 1, the trainer on core 0" if args.server else "in the trainer's process"
    print(f"{machine()}; {args.repeats} runs each, {args.steps} steps (the first {WARMUP_STEPS} left out); "
          f"reward latency {args.reward_latency:g} s per call; sampling {where}")
    print("| variant | step time (s) | completion tokens/s | time/generate (s) | time/score (s) | time/train (s) "
          "| trainer waited (s) | worker waited (s) |")
    print("|---|---|---|---|---|---|---|---|")
    med = {v: {k: statistics.median(r[k] for r in runs[v]) for k in runs[v][0]} for v in VARIANTS}
    for v in VARIANTS:
        m = med[v]
        print(f"| {v} | {m['step_time']:.2f} | {m['tokens_per_second']:.1f} | {m['generate']:.2f} | {m['score']:.2f} "
              f"| {m['train']:.2f} "
              f"| {m['wait_for_data']:.2f} | {m['wait_for_weights']:.2f} |")
    ratio = med["synchronous"]["step_time"] / med["asynchronous"]["step_time"]
    print(f"asynchronous step time: {ratio:.2f}x faster than synchronous (medians)")


if __name__ == "__main__":
    main()
