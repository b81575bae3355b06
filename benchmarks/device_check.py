"""The checks that need a CUDA GPU, in one short run: the fast engine on CUDA (float32 and
bfloat16) against transformers ``generate`` and a full forward, rollout speed, and a few bf16
training steps of the default run.

    python -m benchmarks.device_check            # on the GPU (the default model is on CUDA when there is one)
    python -m benchmarks.device_check --quick    # fewer tokens: the same checks in about a minute

It prints one line per check and exits non-zero if a correctness check fails; speeds are reported,
not judged. On a CPU it runs the same checks there (slowly), which is how it is tested.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.common import load_default
from covey.rollout.fast.engine import FastEngine
from covey.train.forward import SequenceBatch, completion_logprobs
from covey.models import autocast
from covey.rollout import HFEngine, SamplingParams, left_pad
from covey.data.tasks import arithmetic
from covey.data.text import encode_prompts


def logprob_gap(model, prompts, rollout, pad, bf16: bool) -> float:
    """Largest |engine log-prob - full-forward log-prob| over the completion tokens."""
    G = rollout.completion_ids_BT.shape[0] // len(prompts)
    prompt_ids_BP, prompt_mask_BP = left_pad([p for p in prompts for _ in range(G)], pad)
    device = next(model.parameters()).device
    batch = SequenceBatch(prompt_ids_BP.to(device), prompt_mask_BP.to(device), rollout.completion_ids_BT.to(device),
                          rollout.completion_mask_BT.to(device))
    with torch.no_grad(), autocast(device, bf16):
        logp_BT, _ = completion_logprobs(model, batch)
    mask = rollout.completion_mask_BT.bool()
    return float((logp_BT.float().cpu() - rollout.sampling_logp_BT)[mask].abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 new tokens instead of 128, 2 training steps")
    args = parser.parse_args()
    tokens = 32 if args.quick else 128
    model, tokenizer, eos = load_default()
    device, pad = next(model.parameters()).device, tokenizer.pad_token_id
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else device}, torch {torch.__version__}")
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in arithmetic("train")[:2]], 512)
    failures = []

    def check(name: str, ok: bool, detail: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            failures.append(name)

    greedy = SamplingParams(max_new_tokens=tokens, greedy=True)
    for bf16 in (False, True):
        label = "bf16" if bf16 else "fp32"
        hf, fast = HFEngine(model, pad, eos, bf16=bf16), FastEngine(model, pad, eos, tokenizer, bf16=bf16)
        a, b = hf.generate(prompts, 1, greedy), fast.generate(prompts, 1, greedy)
        width = min(a.completion_ids_BT.shape[1], b.completion_ids_BT.shape[1])
        same = bool((a.completion_ids_BT[:, :width] == b.completion_ids_BT[:, :width]).all())
        if bf16:  # bfloat16 kernels differ between the two: agreement is reported, not required
            print(f"info {label} greedy fast vs generate: {'identical' if same else 'differ'} over {width} tokens")
        else:
            check(f"{label} greedy fast == generate", same, f"{width} tokens x {len(prompts)} prompts")
        sampled = fast.generate(prompts, 8, SamplingParams(max_new_tokens=tokens, temperature=1.0), seed=0)
        gap = logprob_gap(model, prompts, sampled, pad, bf16)
        bound = 1e-4 if not bf16 else 0.5  # bf16 sampling differs from the float32-attention forward by design
        check(f"{label} sampled log-probs vs a full forward", gap < bound, f"max |diff| {gap:.2e} (bound {bound})")

    for G in (8, 16):
        for bf16 in (False, True):
            rates = {}
            for name, engine in (("hf", HFEngine(model, pad, eos, bf16=bf16)),
                                 ("fast", FastEngine(model, pad, eos, tokenizer, bf16=bf16))):
                engine.generate(prompts, G, SamplingParams(max_new_tokens=4), seed=0)  # warm-up
                runs = []
                for seed in range(3):
                    start = time.perf_counter()
                    rollout = engine.generate(prompts, G, SamplingParams(max_new_tokens=tokens, temperature=1.0), seed=seed)
                    runs.append(float(rollout.lengths_B.sum()) / (time.perf_counter() - start))
                rates[name] = statistics.median(runs)
            print(f"info rollout 2 x {G} {'bf16' if bf16 else 'fp32'}: hf {rates['hf']:.0f} tok/s, fast {rates['fast']:.0f} "
                  f"tok/s, {rates['fast'] / rates['hf']:.2f}x", flush=True)

    from covey import GRPOConfig, GRPOTrainer

    with tempfile.TemporaryDirectory() as folder:
        steps = 2 if args.quick else 5
        trainer = GRPOTrainer(args=GRPOConfig(output_dir=f"{folder}/run", max_steps=steps, bf16=True, eval_max_samples=0,
                                              logging_steps=1), quiet=True)
        summary = trainer.train()
        history = trainer.history
        finite = all(torch.isfinite(torch.tensor(float(h["loss"]))) for h in history)
        check("bf16 training steps", summary["steps"] == steps and finite,
              "step times " + ", ".join(f"{h['step_time']:.2f}" for h in history) + " s")
    print("all checks passed" if not failures else f"failed: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
