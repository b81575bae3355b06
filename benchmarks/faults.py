"""Injected faults, counted: each run of ``covey train`` (the tiny random Llama of the tests, 12 steps, a
checkpoint every 2) meets one fault, then is resumed with ``--resume-from-checkpoint auto``; its final
weights and every logged metric but the timings are compared with those of a run never interrupted.

Faults:

* ``kill``: SIGKILL at a random moment of a synchronous run (sampling, a step or a checkpoint write,
  wherever the moment falls).
* ``kill_async``: the same under ``async_generation`` (a round in flight while the trainer trains).
* ``kill_in_checkpoint``: SIGKILL as soon as a checkpoint's hidden temporary folder appears (a
  checkpoint being written).
* ``disk_full``: ``os.fsync`` raises ``OSError(ENOSPC)`` at a random call while a checkpoint (or the
  final model) is written, as on a full disk.
* ``reward_worker``: SIGKILL of a reward worker process (``reward_num_workers: 2``) at a random moment,
  as the out-of-memory killer would. The pool notices it, runs the call again in a new worker and
  counts the loss (``rewards/workers_lost``): the run goes on, and is compared as it finishes.
* ``kill_sharded_checkpoint``: two processes under torchrun (FSDP2, ``fsdp: full_shard``, gloo on the
  CPU, ``SHARDED_STATE_DICT``), SIGKILL of torchrun and both processes (as a machine lost) as soon as a
  checkpoint's hidden temporary folder appears; resumed under torchrun, and compared with an
  uninterrupted torchrun run.
* ``server_restart``: sampling from ``covey server --backend fast`` under ``async_generation``; the
  server is SIGKILLed at a random moment and started again on its port after a random pause of up to
  3 s; the run goes on if it can, else it is resumed against the server started again.
* ``vllm_server_restart``: the same against vLLM's server (``covey server --backend vllm``, run by
  ``--vllm-python``, the environment ``make vllm-env`` builds) on the default model (vLLM's CPU kernels
  take no head as small as the tiny model's), a checkpoint every 4 steps; vLLM's start-up takes minutes
  on a CPU, which the run waits out (``vllm_server_timeout: 900``).

The metrics that count the fault itself (``*/workers_lost``) are left out of the comparison, and a run
whose fault was noticed and recovered from without a resume is listed as such. A run counts as **resumed bitwise** when the resumed run's weights and metrics equal the uninterrupted
run's; as a **clear stop** when the fault ended it with an error saying what happened and how to go on
(its exit code, and the message's first line, are listed); anything already written that is lost (a
checkpoint folder present before the fault and gone or unloadable after) is counted as **lost**.

    nice python -m benchmarks.faults --runs 4
    nice python -m benchmarks.faults --runs 2 --faults kill_sharded_checkpoint server_restart
    nice python -m benchmarks.faults --runs 1 --faults vllm_server_restart
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from benchmarks.common import machine, wait_for_server
from benchmarks.soak import children

FAULTS = ("kill", "kill_async", "kill_in_checkpoint", "disk_full", "reward_worker", "kill_sharded_checkpoint",
          "server_restart", "vllm_server_restart")
SERVER_FAULTS = {"server_restart": "fast", "vllm_server_restart": "vllm"}  # the fault's server backend
VLLM_PYTHON = [".venv-vllm/bin/python"]  # --vllm-python
TIMING_KEYS = ("step_time", "time/", "tokens_per_second", "async/queue_depth")
STEPS = 12
FAULT_COUNTS = ("rewards/workers_lost", "tools/workers_lost")  # the record of the fault, not of the learning
OWN_REFERENCE = ("kill_async", "kill_sharded_checkpoint", *SERVER_FAULTS)  # faults whose runs differ from "kill"
FULL_FSYNC = """
import errno, os, sys
calls, fail_at, real = [0], int(os.environ["FAULT_FSYNC_AT"]), os.fsync
def fsync(fd):
    calls[0] += 1
    if calls[0] == fail_at:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(fd)
os.fsync = fsync
from covey.cli import main
sys.exit(main(sys.argv[1:]))
"""


def setup(work: Path) -> Path:
    from tests.conftest import make_model, make_tokenizer
    from tests.test_trainer import ROWS

    tokenizer = make_tokenizer()
    make_model(len(tokenizer)).save_pretrained(work / "tiny")
    tokenizer.save_pretrained(work / "tiny")
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (work / "rewards.py").write_text(
        "def count_a(completions, **kw):\n"
        "    texts = [c[0]['content'] if isinstance(c, list) else c for c in completions]\n"
        "    return [(len(set(t)) + t.count('a')) / 8 for t in texts]\n")
    (work / "full_disk.py").write_text(FULL_FSYNC)
    return work


def config(work: Path, fault: str, port: int = 0) -> Path:
    values = {"model": str(work / "tiny"), "dataset": str(work / "data.jsonl"), "eval_max_samples": 0,
              "reward_funcs": [f"{work / 'rewards.py'}:count_a"], "max_steps": STEPS, "save_steps": 2,
              "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 8,
              "learning_rate": 0.01, "save_total_limit": None, "log_completions": False}
    if fault in ("kill_async", *SERVER_FAULTS):
        values["async_generation"] = True
    if fault == "reward_worker":
        values["reward_num_workers"] = 2
    if fault == "kill_sharded_checkpoint":  # two processes of 4 rows: the batch of the others
        values.update(fsdp="full_shard", fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"},
                      per_device_train_batch_size=4)
    if fault in SERVER_FAULTS:
        values.update(rollout_engine="vllm", vllm_mode="server", vllm_server_port=port, vllm_server_timeout=60)
    if fault == "vllm_server_restart":
        values.update(model=str(default_model()), vllm_server_timeout=900, save_steps=4, learning_rate=1e-5)
    path = work / f"{fault}-{port}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(work: Path, fault: str, out: Path, *extra: str, env: dict | None = None, port: int = 0) -> subprocess.Popen:
    entry = [str(work / "full_disk.py")] if fault == "disk_full" else ["-m", "covey.cli"]
    if fault == "kill_sharded_checkpoint":
        entry = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "covey"]
    return subprocess.Popen([sys.executable, *entry, "train", str(config(work, fault, port)), "--output-dir", str(out),
                             *extra],
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=fault == "kill_sharded_checkpoint")  # its group: torchrun and its processes


def default_model() -> Path:
    from covey.models.embedded import embedded_model_folder

    return embedded_model_folder()


class Server:
    """``covey server`` (``backend`` fast on the tiny model, or vllm on the default model), on a port of
    its own, that can be killed (with the processes it started) and started again."""

    def __init__(self, work: Path, port: int, backend: str = "fast"):
        self.work, self.port, self.backend, self.process, self.starts = work, port, backend, None, 0

    def start(self) -> "Server":
        self.starts += 1
        log = self.work / f"server-{self.port}-{self.starts}.log"
        if self.backend == "vllm":
            command = [*VLLM_PYTHON, "-m", "covey", "server", "--backend", "vllm", "--model", str(default_model()),
                       "--vllm-gpu-memory-utilization", "0.03", "--max-prompt-length", "64"]
        else:
            command = [sys.executable, "-m", "covey", "server", "--backend", "fast", "--model", str(self.work / "tiny")]
        self.process = subprocess.Popen([*command, "--port", str(self.port), "--max-completion-length", "8"],
                                        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
                                        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_for_server(self.process, self.port, lambda: log.read_text()[-3000:], timeout_s=900, poll_s=0.2)
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # vLLM's engine processes with it
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


def weights(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for shard in folder.glob("*.safetensors"):
        state.update(load_file(shard))
    return state


def learned_metrics(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(TIMING_KEYS) and k not in FAULT_COUNTS} for m in lines]


def workers_lost(run: Path) -> float:
    """The reward and tool workers the run counted as lost."""
    metrics = run / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return sum(m.get(k, 0.0) for m in lines for k in FAULT_COUNTS)


def same_run(a: Path, b: Path) -> bool:
    wa, wb = weights(a / "final_model"), weights(b / "final_model")
    return (bool(wa) and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
            and learned_metrics(a) == learned_metrics(b))


def checkpoints(out: Path) -> dict[str, set[str]]:
    """Each whole checkpoint folder and its files."""
    folder = out / "checkpoints"
    return {c.name: {f.name for f in c.iterdir()} for c in sorted(folder.glob("checkpoint-*"))} if folder.exists() else {}


def after_first_checkpoint(process: subprocess.Popen, out: Path) -> bool:
    """Wait until the run has written its first checkpoint (a fault before it has nothing to resume
    from: the run starts again); False if it ended first."""
    while process.poll() is None:
        if any((out / "checkpoints").glob("checkpoint-*")):  # whole: written under a hidden name, then renamed
            return True
        time.sleep(0.005)
    return False


def inject(fault: str, process: subprocess.Popen, out: Path, rng: random.Random, span: float,
           server: Server | None = None) -> str:
    """Wait for the fault's moment and cause it; what was done. ``span``: the seconds an uninterrupted
    run trains after its first checkpoint."""
    if not after_first_checkpoint(process, out):
        return "the run ended before its first checkpoint"
    if fault in ("kill_in_checkpoint", "kill_sharded_checkpoint"):
        return kill_in_a_checkpoint(fault, process, out, rng)
    # the moment: a random step after the first checkpoint (the run's own clock, whatever the machine's
    # load), then a random part of a step
    metrics, step = out / "metrics.jsonl", rng.randint(2, 11)
    while process.poll() is None and (not metrics.exists() or metrics.read_text().count("\n") < step):
        time.sleep(0.002)
    share = rng.uniform(0.0, 1.0)
    deadline = time.monotonic() + share * span / 10
    while time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.002)
    if process.poll() is not None:
        return "the run ended before the moment came"
    if fault == "reward_worker":
        workers = children(process.pid)
        if not workers:
            return "no reward worker was running"
        os.kill(rng.choice(workers), signal.SIGKILL)
        return f"SIGKILL of a reward worker {share:.0%} of a step after step {step}"
    if fault in SERVER_FAULTS:
        pause = rng.uniform(0.0, 3.0)
        server.kill()
        time.sleep(pause)
        server.start()
        return f"SIGKILL of the server {share:.0%} of a step after step {step}, started again {pause:.1f} s later"
    process.kill()
    return f"SIGKILL {share:.0%} of a step after step {step}"


def kill_in_a_checkpoint(fault: str, process: subprocess.Popen, out: Path, rng: random.Random) -> str:
    """SIGKILL as soon as a checkpoint's hidden temporary folder appears: the first one after the first
    checkpoint, or (two processes) a random one of the four after it; torchrun and its processes at once."""
    folder, skip, seen = out / "checkpoints", rng.randint(0, 3) if fault == "kill_sharded_checkpoint" else 0, set()
    while process.poll() is None:
        writing = {p.name for p in folder.iterdir() if p.name.startswith(".tmp-")}
        if writing - seen and len(seen | writing) > skip:
            if fault == "kill_sharded_checkpoint":
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
            return f"SIGKILL while a checkpoint was being written ({sorted(writing)[0]})"
        seen |= writing
        time.sleep(0.001)
    return "the run ended before a checkpoint write was caught"


def one_run(work: Path, fault: str, n: int, reference: Path, rng: random.Random, span: float) -> dict:
    out = work / f"{fault}-{n}"
    env = {"FAULT_FSYNC_AT": str(rng.randint(1, 40))} if fault == "disk_full" else {}
    server = Server(work, free_port(), SERVER_FAULTS[fault]).start() if fault in SERVER_FAULTS else None
    port = server.port if server else 0
    try:
        process = start(work, fault, out, env=env, port=port)
        before = {}
        if fault != "disk_full":
            what = inject(fault, process, out, rng, span, server)
            before = checkpoints(out)  # written before the fault (a kill stops all writing)
        else:
            what = f"fsync call {env['FAULT_FSYNC_AT']} fails with ENOSPC"
        _, err = process.communicate(timeout=600)
        code = process.returncode
        if fault == "disk_full":
            before = checkpoints(out)
        stop_message = ""
        if code not in (0, -signal.SIGKILL):
            lines = [line for line in err.splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
            stop_message = lines[-1] if lines else "(no message)"
        resumed = None
        if code != 0:
            again = start(work, "kill" if fault == "disk_full" else fault, out, "--resume-from-checkpoint", "auto",
                          port=port)
            _, err2 = again.communicate(timeout=600)
            resumed = again.returncode == 0
            if not resumed:
                stop_message += f" | resume failed: {err2.strip().splitlines()[-1][:300] if err2.strip() else ''}"
    finally:
        if server:
            server.stop()
    after = checkpoints(out)
    lost = [name for name, files in before.items() if name not in after or not files <= after[name]]
    bitwise = (out / "final_model").exists() and same_run(reference, out)
    clear = code not in (0, -signal.SIGKILL) and "resume" in stop_message.split(" | resume failed")[0].lower()
    injected = not what.startswith(("the run ended", "no reward worker"))
    return {"fault": fault, "what": what, "injected": injected, "exit": code, "clear_stop": clear,
            "message": stop_message, "resumed": resumed, "bitwise": bitwise, "lost": lost,
            "recovered_in_run": injected and code == 0, "workers_lost": workers_lost(out),
            "warned": any(w in err for w in ("without being told to", "lost the server"))}


def reference_run(work: Path, kind: str) -> float:
    """The uninterrupted run of ``kind`` into ``reference-<kind>``; the seconds it trained after its first checkpoint."""
    out = work / f"reference-{kind}"
    server = Server(work, free_port(), SERVER_FAULTS[kind]).start() if kind in SERVER_FAULTS else None
    try:
        process = start(work, kind, out, port=server.port if server else 0)
        after_first_checkpoint(process, out)
        began = time.monotonic()
        metrics = out / "metrics.jsonl"  # the last step logged: training is over (saving and exiting are not steps)
        while process.poll() is None and metrics.read_text().count("\n") < STEPS:
            time.sleep(0.002)
        span = time.monotonic() - began
        _, err = process.communicate(timeout=600)
    finally:
        if server:
            server.stop()
    if process.returncode != 0:
        raise RuntimeError(f"the uninterrupted {kind} run failed:\n{err[-3000:]}")
    return span


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="runs per fault")
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=VLLM_PYTHON[0], help="the Python of vLLM's environment")
    args = parser.parse_args()
    VLLM_PYTHON[0] = os.path.abspath(args.vllm_python)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = setup(Path(tmp))
        spans = {}
        for fault in args.faults:
            kind = fault if fault in OWN_REFERENCE else "kill"
            if kind not in spans:
                spans[kind] = reference_run(work, kind)
        results = []
        for n in range(args.runs):
            for fault in args.faults:
                kind = fault if fault in OWN_REFERENCE else "kill"
                result = one_run(work, fault, n, work / f"reference-{kind}", rng, spans[kind])
                results.append(result)
                print(json.dumps(result), flush=True)
    print(f"\n{machine()}; {args.runs} runs per fault, seed {args.seed}")
    print("| fault | runs | faults injected | of those, bitwise the uninterrupted run | recovered within the run "
          "(no resume) | clear stops (then resumed) | lost |")
    print("|---|---|---|---|---|---|---|")
    by_fault = collections.defaultdict(list)
    for r in results:
        by_fault[r["fault"]].append(r)
    for fault, rs in [*by_fault.items(), ("all", results)]:
        hit = [r for r in rs if r["injected"]]
        print(f"| {fault} | {len(rs)} | {len(hit)} | {sum(r['bitwise'] for r in hit)} | "
              f"{sum(r['recovered_in_run'] for r in hit)} | {sum(r['clear_stop'] for r in hit)} | "
              f"{sum(len(r['lost']) for r in rs)} |")


if __name__ == "__main__":
    main()
