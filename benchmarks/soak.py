"""Soak: a long run's resident memory, threads, open files and child processes, sampled at every step.

The run is a subprocess (``covey train`` on a config, or the tool task through the Python API); this
process watches ``metrics.jsonl`` (one line per step) and, at each new line, reads from ``/proc`` the
trainer's resident memory (VmRSS), its threads (the kernel's count, Python's and torch's alike), its
open file descriptors and its child processes (and, against a server, the server's memory). Growth
is measured after a warm-up (the first ``--warmup`` share of the steps): the least-squares slope of
resident memory in MiB per 100 steps, and the first and last counts of the rest.

Modes:

* ``sync``: one process samples with the fast engine, scores and trains in turn.
* ``async``: ``async_generation: true``, a worker thread sampling one round ahead.
* ``tools``: episodes with tools: an engine that writes a tool call in its first turn and answers with
  the tool's result (the one of ``tests/test_agents.py``), the tool hanging on every other call and
  stopped at ``tool_timeout`` (0.2 s), on a quarter of its calls flooding its standard output (1 MiB)
  and leaving a process of its own running, and a reward that hangs on the batches holding one of the
  prompts, stopped at ``reward_timeout`` (``reward_errors: skip``): a stop every step, to see that stops
  leak nothing. The tool's own processes are counted at every step and once the run has ended.
* ``server``: sampling from ``covey server --backend fast`` in its own process.

``--model tiny`` (default) is the tiny random Llama of the tests (2 layers of width 32, a character
tokenizer), so that hundreds of steps fit in minutes on a shared CPU; ``--model default`` runs the
default model (SmolLM2-135M-Instruct) on the demo task, as ``covey train`` with no arguments does: the
hour-long run of the goal is

    nice python -m benchmarks.soak --model default --steps 1000 --modes sync async server

and docs/reliability.md shows the tiny model's, e.g.

    python -m benchmarks.soak --steps 1000 --modes sync --samples-out sync.jsonl

Growth is reported for resident memory and for its anonymous part (``anon_mib``): on a machine short
of memory the kernel drops file-backed pages (libraries, the model file), so total RSS falls and
rises with other work while the anonymous part is what a leak grows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import machine, wait_for_server

MODES = ("sync", "async", "tools", "server")
TOOL_PROCESS = "soak-tool-process-of"  # in the command line of the processes the tool leaves running, with
# the soak's process id (the SOAK_PID the tool run is given): another soak's are not counted


# ---- what is sampled ------------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def tool_processes() -> int:
    """The processes this soak's tool task's tool started that are still running, wherever they are."""
    found, mark = 0, f"{TOOL_PROCESS}-{os.getpid()}".encode()
    for entry in Path("/proc").iterdir():
        try:
            found += entry.name.isdigit() and mark in (entry / "cmdline").read_bytes()
        except OSError:
            continue
    return found


def sample(pid: int) -> dict | None:
    """RSS (MiB), its anonymous part (what a leak grows: the file-backed pages of libraries and models come
    and go as the kernel reclaims them on a machine short of memory), threads, open fds and child processes
    of ``pid``; None once it is gone."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "anon_mib": int(status["RssAnon"].split()[0]) / 1024,
            "threads": int(status["Threads"]), "fds": fds, "children": len(children(pid)),
            "tool_processes": tool_processes()}


# ---- the runs ------------------------------------------------------------------------------------------


def tiny_model(folder: Path) -> Path:
    from tests.conftest import make_model, make_tokenizer

    tokenizer = make_tokenizer()
    make_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def config_for(mode: str, model: str, steps: int, work: Path, port: int) -> dict:
    if model == "tiny":
        from tests.test_trainer import ROWS

        (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
        (work / "rewards.py").write_text(
            "def count_a(completions, **kw):\n"
            "    texts = [c[0]['content'] if isinstance(c, list) else c for c in completions]\n"
            "    return [(len(set(t)) + t.count('a')) / 8 for t in texts]\n")
        config = {"model": str(tiny_model(work / "tiny")), "dataset": str(work / "data.jsonl"),
                  "reward_funcs": [f"{work / 'rewards.py'}:count_a"], "num_generations": 4,
                  "per_device_train_batch_size": 8, "max_completion_length": 16, "learning_rate": 0.01}
    else:
        config = {"dataset": "arithmetic", "reward_funcs": ["answer_format", "answer_correct"], "num_generations": 4,
                  "per_device_train_batch_size": 8, "max_completion_length": 48}
    config.update(max_steps=steps, eval_max_samples=0, save_steps=50, save_total_limit=2, logging_steps=1,
                  log_completions=False)
    if mode == "async":
        config["async_generation"] = True
    if mode == "server":
        config.update(rollout_engine="vllm", vllm_mode="server", vllm_server_port=port)
    return config


def tools_run(out: str, steps: int) -> None:
    """The tool mode's trainer (run in its own process by ``run``)."""
    import time as clock

    from covey import GRPOTrainer
    from tests.conftest import make_model, make_tokenizer
    from tests.test_agents import ROWS, ScriptedAgent, agent_args

    def multiply(a: int, b: int) -> str:
        """Multiply two numbers.

        Args:
            a: the first
            b: the second
        """
        if (a * b) % 2:  # 27 and 25 of the four prompts: every other call hangs, and is stopped
            clock.sleep(600)
        if a * b == 42:  # a quarter of the calls flood their output and leave a process running
            sys.stdout.write("x" * 2**20)
            sys.stdout.flush()
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                              f"{TOOL_PROCESS}-{os.environ['SOAK_PID']}"])
        return str(a * b)

    def hangs_on_some_batches(prompts, completions, **kwargs):
        if len(completions) > 2 and any("6 * 7" in p[-1]["content"] for p in prompts):  # the batches with that prompt
            clock.sleep(600)
        return [1.0] * len(completions)

    class Forgetful(ScriptedAgent):
        def generate(self, *args, **kwargs):
            self.turns = []  # the test engine's transcript, which would grow over a long run
            return super().generate(*args, **kwargs)

    tokenizer = make_tokenizer()
    engine = Forgetful(tokenizer, '<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>')
    args = agent_args(Path(out).parent, output_dir=out, max_steps=steps, tool_timeout=0.2, reward_timeout=0.5,
                      reward_errors="skip", logging_steps=1, save_steps=50, save_total_limit=2)
    trainer = GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[hangs_on_some_batches], args=args,
                          train_dataset=ROWS, processing_class=tokenizer, rollout_engine=engine, tools=[multiply],
                          quiet=True)
    trainer.train()


@contextlib.contextmanager
def fast_server(model: str, work: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(work / "server.log", "wb")
    command = [sys.executable, "-m", "covey", "server", "--backend", "fast", "--port", str(port),
               "--max-completion-length", "16" if model == "tiny" else "48"]
    if model == "tiny":
        command += ["--model", str(work / "tiny")]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_server(process, port, lambda: (work / "server.log").read_text()[-3000:])
        yield port, process.pid
    finally:
        process.terminate()
        process.wait(timeout=60)


def run(mode: str, model: str, steps: int, samples_out: str | None = None) -> list[dict]:
    """The samples of one run, one per step (each also appended to ``samples_out`` as it is taken, so that a
    run stopped midway keeps what it measured)."""
    with tempfile.TemporaryDirectory() as tmp:
        work, out = Path(tmp), Path(tmp) / "run"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "SOAK_PID": str(os.getpid())}
        with contextlib.ExitStack() as stack:
            port, server_pid = 0, None
            config = config_for(mode, model, steps, work, 0) if mode != "tools" else None
            if mode == "server":
                port, server_pid = stack.enter_context(fast_server(model, work))
                config = config_for(mode, model, steps, work, port)
            if mode == "tools":
                command = [sys.executable, "-m", "benchmarks.soak", "--tools-run", str(out), "--steps", str(steps)]
            else:
                (work / "config.yaml").write_text(yaml.safe_dump(config))
                command = [sys.executable, "-m", "covey", "train", str(work / "config.yaml"), "--output-dir", str(out)]
            err = open(work / "stderr.txt", "w+")
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
            samples, seen, size = [], 0, 0
            metrics = out / "metrics.jsonl"
            while process.poll() is None:
                grown = metrics.exists() and metrics.stat().st_size != size
                if grown:  # read the file only when it has grown: a thousand-step run's file is read cheaply
                    size = metrics.stat().st_size
                lines = metrics.read_text().count("\n") if grown else seen
                if lines > seen:
                    seen = lines
                    taken = sample(process.pid)
                    if taken is not None:
                        if server_pid is not None:
                            server = sample(server_pid) or {}
                            taken["server_rss_mib"] = server.get("rss_mib", float("nan"))
                            taken["server_anon_mib"] = server.get("anon_mib", float("nan"))
                        samples.append({"step": seen, **taken})
                        if samples_out:
                            with open(samples_out, "a") as f:
                                f.write(json.dumps({"mode": mode, **samples[-1]}) + "\n")
                time.sleep(0.01)
            if process.returncode != 0:
                err.seek(0)
                raise RuntimeError(f"{mode} run failed ({process.returncode}):\n{err.read()[-3000:]}")
            samples[-1]["tool_processes_after"] = tool_processes()
        return samples


def slope_per_100(samples: list[dict], key: str) -> float:
    xs, ys = [s["step"] for s in samples], [s[key] for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--model", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--warmup", type=float, default=0.25, help="share of the steps left out as warm-up")
    parser.add_argument("--samples-out", help="write every sample here (JSON lines)")
    parser.add_argument("--tools-run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tools_run:
        return tools_run(args.tools_run, args.steps)
    print(f"{machine()}; model {args.model}; {args.steps} steps per mode; warm-up: the first "
          f"{args.warmup:.0%} of the steps")
    print("| mode | steps | RSS after warm-up (MiB) | RSS at end (MiB) | RSS growth (MiB/100 steps) | anonymous RSS "
          "growth (MiB/100 steps) | threads (after warm-up → end) | open fds | child processes | server RSS / "
          "anonymous RSS growth (MiB/100 steps) | the tool's processes (most at a step; after the run) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        samples = run(mode, args.model, args.steps, args.samples_out)
        rest = [s for s in samples if s["step"] > args.warmup * args.steps]
        first, last = rest[0], rest[-1]
        server = (f"{slope_per_100(rest, 'server_rss_mib'):+.2f} / {slope_per_100(rest, 'server_anon_mib'):+.2f}"
                  if "server_rss_mib" in first else "—")
        print(f"| {mode} | {samples[-1]['step']} | {first['rss_mib']:.1f} | {last['rss_mib']:.1f} | "
              f"{slope_per_100(rest, 'rss_mib'):+.2f} | {slope_per_100(rest, 'anon_mib'):+.2f} | "
              f"{first['threads']} → {last['threads']} "
              f"(max {max(s['threads'] for s in rest)}) | {first['fds']} → {last['fds']} (max {max(s['fds'] for s in rest)}) "
              f"| {first['children']} → {last['children']} (max {max(s['children'] for s in rest)}) | {server} "
              f"| {max(s['tool_processes'] for s in samples)}; {last['tool_processes_after']} |",
              flush=True)


if __name__ == "__main__":
    main()
