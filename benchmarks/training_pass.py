"""The trainer's log-prob passes: every row in full vs the shared prompt (padded) vs shared and packed.

Realistic batches of the default task: the default model samples 2 prompts x 8 completions (up to
64 tokens, temperature 1, as in `benchmarks/step.py`), a new batch each repeat; one micro-batch of
all 16 rows is then timed each way, the ways alternating, as the training forward + backward and
as a no-grad (reference) forward, in float32 and under bfloat16 autocast. All three ways give the
same log-probs and gradients (tested in tests/test_rollout_and_logprobs.py); the table says what
each saves. Ratios are medians of the per-batch ratios. A last table times the packed bf16
passes on the same batches with their attention in float32 (the default on CPU) and in bfloat16,
side by side.

    python -m benchmarks.training_pass --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import load_default, machine
from covey.rollout.fast.engine import FastEngine
from covey.train.forward import SequenceBatch, completion_logprobs
from covey.models import autocast
from covey.rollout import SamplingParams, left_pad
from covey.data.tasks import arithmetic
from covey.data.text import encode_prompts

WAYS = {"every row in full": dict(share_prompt=False), "shared prompt, padded": dict(pack=False),
        "shared prompt, packed": dict(pack=True)}


def timed_pass(model, batch: SequenceBatch, way: dict, bf16: bool, train: bool) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.set_grad_enabled(train), autocast(torch.device("cpu"), bf16):
        logp, _ = completion_logprobs(model, batch, with_entropy=train, **way)
    if train:
        (logp * batch.completion_mask_BT).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer, eos = load_default()
    engine = FastEngine(model, tokenizer.pad_token_id, eos, tokenizer)
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in arithmetic("train")[:2]], 512)
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(8)], tokenizer.pad_token_id)
    batches = []  # one sampled batch per repeat, timed every way
    for rep in range(args.repeats):
        with torch.no_grad():
            rollout = engine.generate(prompts, 8, SamplingParams(max_new_tokens=64), seed=rep)
        batches.append(SequenceBatch(prompt_ids, prompt_mask, rollout.completion_ids_BT, rollout.completion_mask_BT))
    print(f"machine: {machine()}\n")
    print("| pass | precision | " + " | ".join(WAYS)
          + " | every row / packed | padded / packed | completion tokens (max) |")
    print("|---|---|---|---|---|---|---|---|")
    for train in (True, False):
        for bf16 in (False, True):
            seconds = {name: [] for name in WAYS}
            tokens = []
            model.train(train)
            for batch in batches:
                lengths_B = batch.completion_mask_BT.sum(1)
                tokens.append((int(lengths_B.sum()), int(lengths_B.max())))
                for name, way in WAYS.items():
                    seconds[name].append(timed_pass(model, batch, way, bf16, train))
            median = {name: statistics.median(s) for name, s in seconds.items()}
            ratios = [statistics.median(a / p for a, p in zip(seconds[name], seconds["shared prompt, packed"]))
                      for name in ("every row in full", "shared prompt, padded")]
            n, longest = statistics.median(t[0] for t in tokens), statistics.median(t[1] for t in tokens)
            cells = [f"{median[name]:.2f} s" for name in WAYS] + [f"{r:.2f}x" for r in ratios]
            kind = f"{'forward + backward' if train else 'no-grad forward'} | {'bf16 autocast' if bf16 else 'float32'}"
            print(f"| {kind} | " + " | ".join(cells) + f" | {n:.0f} ({longest:.0f}) |", flush=True)
    print("\n| bf16 autocast, packed | attention in float32 (default) | attention in bfloat16 | bfloat16 / float32 |")
    print("|---|---|---|---|")
    for train in (True, False):
        model.train(train)
        seconds = {True: [], False: []}
        for batch in batches:
            for float32 in (True, False):
                way = dict(WAYS["shared prompt, packed"], float32_attention=float32)
                seconds[float32].append(timed_pass(model, batch, way, True, train))
        ratio = statistics.median(b / f for f, b in zip(seconds[True], seconds[False]))
        print(f"| {'forward + backward' if train else 'no-grad forward'} | {statistics.median(seconds[True]):.2f} s | "
              f"{statistics.median(seconds[False]):.2f} s | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
