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
  as the out-of-memory killer would.

A run counts as **resumed bitwise** when the resumed run's weights and metrics equal the uninterrupted
run's; as a **clear stop** when the fault ended it with an error saying what happened and how to go on
(its exit code, and the message's first line, are listed); anything already written that is lost (a
checkpoint folder present before the fault and gone or unloadable after) is counted as **lost**.

    nice python -m benchmarks.faults --runs 4
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from benchmarks.common import machine
from benchmarks.soak import children

FAULTS = ("kill", "kill_async", "kill_in_checkpoint", "disk_full", "reward_worker")
TIMING_KEYS = ("step_time", "time/", "tokens_per_second", "async/queue_depth")
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


def config(work: Path, fault: str) -> Path:
    values = {"model": str(work / "tiny"), "dataset": str(work / "data.jsonl"), "eval_max_samples": 0,
              "reward_funcs": [f"{work / 'rewards.py'}:count_a"], "max_steps": 12, "save_steps": 2,
              "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 8,
              "learning_rate": 0.01, "save_total_limit": None, "log_completions": False}
    if fault == "kill_async":
        values["async_generation"] = True
    if fault == "reward_worker":
        values["reward_num_workers"] = 2
    path = work / f"{fault}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def start(work: Path, fault: str, out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    entry = [str(work / "full_disk.py")] if fault == "disk_full" else ["-m", "covey.cli"]
    return subprocess.Popen([sys.executable, *entry, "train", str(config(work, fault)), "--output-dir", str(out), *extra],
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for shard in folder.glob("*.safetensors"):
        state.update(load_file(shard))
    return state


def learned_metrics(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(TIMING_KEYS)} for m in lines]


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
        if (out / "checkpoints" / "checkpoint-2").exists():
            return True
        time.sleep(0.005)
    return False


def inject(fault: str, process: subprocess.Popen, out: Path, rng: random.Random, span: float) -> str:
    """Wait for the fault's moment and cause it; what was done. ``span``: the seconds an uninterrupted
    run trains after its first checkpoint."""
    if not after_first_checkpoint(process, out):
        return "the run ended before its first checkpoint"
    if fault == "kill_in_checkpoint":
        folder = out / "checkpoints"
        while process.poll() is None:
            if any(p.name.startswith(".tmp-") for p in folder.iterdir()):
                process.kill()
                return "SIGKILL while a checkpoint was being written"
            time.sleep(0.001)
        return "the run ended before a checkpoint write was caught"
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
    process.kill()
    return f"SIGKILL {share:.0%} of a step after step {step}"


def one_run(work: Path, fault: str, n: int, reference: Path, rng: random.Random, span: float) -> dict:
    out = work / f"{fault}-{n}"
    env = {"FAULT_FSYNC_AT": str(rng.randint(1, 40))} if fault == "disk_full" else {}
    process = start(work, fault, out, env=env)
    before = {}
    if fault != "disk_full":
        what = inject(fault, process, out, rng, span)
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
        again = start(work, "kill" if fault == "disk_full" else fault, out, "--resume-from-checkpoint", "auto")
        _, err2 = again.communicate(timeout=600)
        resumed = again.returncode == 0
        if not resumed:
            stop_message += f" | resume failed: {err2.strip().splitlines()[-1][:300] if err2.strip() else ''}"
    after = checkpoints(out)
    lost = [name for name, files in before.items() if name not in after or not files <= after[name]]
    bitwise = (out / "final_model").exists() and same_run(reference, out)
    clear = code not in (0, -signal.SIGKILL) and "resume" in stop_message.split(" | resume failed")[0].lower()
    injected = not what.startswith(("the run ended", "no reward worker"))
    return {"fault": fault, "what": what, "injected": injected, "exit": code, "clear_stop": clear,
            "message": stop_message, "resumed": resumed, "bitwise": bitwise, "lost": lost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="runs per fault")
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = setup(Path(tmp))
        references, spans = {}, {}
        for fault in args.faults:
            kind = "kill" if fault in ("disk_full", "reward_worker", "kill_in_checkpoint") else fault
            if kind not in references:
                process = start(work, kind, work / f"reference-{kind}")
                after_first_checkpoint(process, work / f"reference-{kind}")
                began = time.monotonic()
                _, err = process.communicate(timeout=600)
                if process.returncode != 0:
                    raise RuntimeError(f"the uninterrupted {kind} run failed:\n{err[-3000:]}")
                references[kind], spans[kind] = work / f"reference-{kind}", time.monotonic() - began
        results = []
        for n in range(args.runs):
            for fault in args.faults:
                kind = "kill" if fault in ("disk_full", "reward_worker", "kill_in_checkpoint") else fault
                result = one_run(work, fault, n, references[kind], rng, spans[kind])
                results.append(result)
                print(json.dumps(result), flush=True)
    print(f"\n{machine()}; {args.runs} runs per fault, seed {args.seed}")
    print("| fault | runs | faults injected | of those, resumed bitwise | clear stops (then resumed) | lost |")
    print("|---|---|---|---|---|---|")
    by_fault = collections.defaultdict(list)
    for r in results:
        by_fault[r["fault"]].append(r)
    for fault, rs in by_fault.items():
        hit = [r for r in rs if r["injected"]]
        print(f"| {fault} | {len(rs)} | {len(hit)} | {sum(r['bitwise'] for r in hit)} | {sum(r['clear_stop'] for r in hit)} | "
              f"{sum(len(r['lost']) for r in rs)} |")
    hit = [r for r in results if r["injected"]]
    print(f"| all | {len(results)} | {len(hit)} | {sum(r['bitwise'] for r in hit)} | {sum(r['clear_stop'] for r in hit)} | "
          f"{sum(len(r['lost']) for r in results)} |")


if __name__ == "__main__":
    main()
