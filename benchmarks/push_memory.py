"""Weight pushes over covey_gloo alone: the anonymous resident memory of both ends, round after round.

Two processes join a weight-transfer group as a trainer and ``covey server`` do
(``covey.rollout.weight_transfer.open_group``); in each round rank 0 broadcasts every weight of the
soak's tiny model (``send``, from a new thread, as the trainer's push does) and rank 1 receives them
(``receive``). Every ``--block`` rounds each process prints its anonymous resident memory (``RssAnon``)
and the C library's bytes in use (``mallinfo2``). It separates the pushes from the rest of a run
against the fast server (HTTP, sampling, training), to see whether the memory a push takes keeps
growing or levels off.

    python -m benchmarks.push_memory --rounds 300
"""

from __future__ import annotations

import argparse
import ctypes
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import torch


def memory() -> dict[str, float]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return {"anon_mib": round(int(status["RssAnon"].split()[0]) / 1024, 2),
            "malloc_in_use_mib": round(libc.mallinfo2().uordblks / 2**20, 2)}


def end(rank: int, port: int, rounds: int, block: int) -> None:
    """One end of the group: rank 0 sends, rank 1 receives."""
    from covey.rollout.weight_transfer import GlooUpdateInfo, open_group, receive, send
    from tests.conftest import make_model, make_tokenizer

    weights = list(make_model(len(make_tokenizer())).state_dict().items())
    update = GlooUpdateInfo.of(weights)
    group = open_group("127.0.0.1", port, rank, 2, 60.0)
    for done in range(1, rounds + 1):
        if rank == 0:
            pushing = threading.Thread(target=send, args=(group, weights))  # a thread per push, as _at_once
            pushing.start()
            pushing.join()
        else:
            for _ in receive(group, update):
                pass
        if done % block == 0:
            print(json.dumps({"rank": rank, "round": done, **memory()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--end", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.end is not None:
        return end(args.end, args.port, args.rounds, args.block)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "benchmarks.push_memory", "--rounds", str(args.rounds), "--block",
               str(args.block), "--port", str(port), "--end"]
    ends = [subprocess.Popen(command + [str(rank)], stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [json.loads(line) for process in ends for line in process.communicate()[0].splitlines()]
    if any(process.returncode for process in ends):
        raise SystemExit(f"an end failed: exit codes {[process.returncode for process in ends]}")
    print(f"torch {torch.__version__}; {args.rounds} pushes of the tiny model's weights; anonymous RSS (MiB), "
          "malloc in use (MiB)")
    print("| round | sender anon | sender in use | receiver anon | receiver in use |")
    print("|---|---|---|---|---|")
    by_round = {}
    for row in outputs:
        by_round.setdefault(row["round"], {})[row["rank"]] = row
    for done, ranks in sorted(by_round.items()):
        print(f"| {done} | {ranks[0]['anon_mib']:.2f} | {ranks[0]['malloc_in_use_mib']:.2f} | "
              f"{ranks[1]['anon_mib']:.2f} | {ranks[1]['malloc_in_use_mib']:.2f} |")


if __name__ == "__main__":
    main()
