"""The vision-language case of ``benchmarks.device_check``: tiny random-weight Qwen2-VL and Idefics3 models
(built from configs, nothing downloaded) on the device: transformers' ``generate`` samples prompts with
pictures, its log-probs against covey's log-prob pass with the same pictures (float32 and bfloat16), and a
few bfloat16 LoRA training steps with the step times. Rollout speed is reported, not judged.

    python -m benchmarks.vision_check            # on the GPU when there is one
    python -m benchmarks.vision_check --quick    # fewer tokens and steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def rows(n: int) -> list[dict]:
    from tests.tiny_vision import image

    return [{"prompt": [{"role": "user", "content": f"What is in picture {i}?"}], "image": image(i)} for i in range(n)]


def check_family(family: str, tokens: int, steps: int) -> None:
    from covey import GRPOConfig, GRPOTrainer
    from covey.data import load_rows
    from covey.data.text import encode_prompts
    from covey.models import autocast, default_device
    from covey.rollout import HFEngine, SamplingParams, left_pad
    from covey.train.forward import SequenceBatch, completion_logprobs
    from covey.vision import batch_images, placeholder_token_ids, text_tokenizer
    from tests.tiny_vision import BUILDERS

    device = default_device()
    model, processor = BUILDERS[family]()
    model = model.to(device)
    tokenizer = text_tokenizer(processor)
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in load_rows(rows(4))], 512, processor=processor)
    params = SamplingParams(max_new_tokens=tokens, suppress=tuple(placeholder_token_ids(model.config)))
    for bf16 in (False, True):
        engine = HFEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], bf16=bf16)
        engine.generate(prompts, 2, SamplingParams(max_new_tokens=2, suppress=params.suppress), seed=0)  # warm-up
        rates = []
        for seed in range(3):
            start = time.perf_counter()
            rollout = engine.generate(prompts, 4, params, seed=seed)
            rates.append(float(rollout.lengths_B.sum()) / (time.perf_counter() - start))
        repeated = [p for p in prompts for _ in range(4)]
        prompt_BP, mask_BP = left_pad(repeated, tokenizer.pad_token_id)
        batch = SequenceBatch(prompt_BP, mask_BP, rollout.completion_ids_BT, rollout.completion_mask_BT,
                              batch_images(repeated))
        with torch.no_grad(), autocast(device, bf16):
            logp, _ = completion_logprobs(model, batch, params.distribution)
        mask = rollout.completion_mask_BT.bool()
        gap = float((logp.float().cpu() - rollout.sampling_logp_BT)[mask].abs().max())
        bound = 1e-4 if not bf16 else 0.5  # bf16 sampling differs from the float32-attention forward by design
        label = "bf16" if bf16 else "fp32"
        check(f"{family} {label} sampled log-probs with pictures vs the log-prob pass", gap < bound,
              f"max |diff| {gap:.2e} (bound {bound}); generate {statistics.median(rates):.0f} tok/s (median of 3)")
    model, processor = BUILDERS[family]()
    with tempfile.TemporaryDirectory() as folder:
        args = GRPOConfig(output_dir=f"{folder}/run", max_steps=steps, num_generations=4, per_device_train_batch_size=8,
                          max_completion_length=tokens, learning_rate=1e-3, use_peft=True, lora_r=8,
                          lora_target_modules=["all-linear"], bf16=device.type == "cuda", eval_max_samples=0,
                          logging_steps=1)
        trainer = GRPOTrainer(model=model.to(device), processing_class=processor, train_dataset=rows(8), args=args,
                              reward_funcs=lambda completions, **kw: [len(c[0]["content"]) / 8 for c in completions],
                              quiet=True)
        trainer.train()
        history = trainer.history
        finite = all(torch.isfinite(torch.tensor(float(h["loss"]))) for h in history)
        check(f"{family} LoRA training steps with pictures", trainer.summary["steps"] == steps and finite,
              "step times " + ", ".join(f"{h['step_time']:.2f}" for h in history) + " s")


def check_vision(quick: bool) -> None:
    """Both families, one after the other."""
    for family in ("qwen2_vl", "idefics3"):
        check_family(family, 16 if quick else 64, 2 if quick else 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 new tokens instead of 64, 2 training steps")
    args = parser.parse_args()
    check_vision(args.quick)
    print("all checks passed" if not FAILURES else f"failed: {', '.join(FAILURES)}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
