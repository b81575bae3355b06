"""The checks that need a CUDA GPU, in one short run: the fast engine on CUDA (float32 and
bfloat16) against transformers ``generate`` and a full forward, rollout speed, a few bf16 training
steps of the default run, synchronous against asynchronous generation (step times side by side, the
trainer and the worker sharing the GPU), and, where vLLM is installed, vLLM itself: colocated (log-probs, pushed
weights taking effect, sleep mode, speed against the fast engine), as a server taking pushes (over
NCCL with two GPUs; over covey_gloo with one, since NCCL refuses two ranks on one GPU), and a short
GRPO run sampling with it; tiny vision-language models sampling and training with pictures
(``benchmarks.vision_check``); and covey plan's estimate of a step's peak against
torch.cuda.max_memory_allocated (skipped without CUDA). Each vLLM part runs in a process of its own (one vLLM per process).

    python -m benchmarks.device_check            # on the GPU (the default model is on CUDA when there is one)
    python -m benchmarks.device_check --quick    # fewer tokens: the same checks in a few minutes
    python -m benchmarks.device_check --plan-only  # covey plan's estimates against max_memory_allocated only

It prints one line per check and exits non-zero if a correctness check fails; speeds are reported,
not judged. On a CPU it runs the same checks there (slowly), which is how it is tested.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

from benchmarks import vision_check
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


FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def default_prompts(tokenizer) -> list[list[int]]:
    return encode_prompts(tokenizer, [r["prompt"] for r in arithmetic("train")[:2]], 512)


def perturb(model, seed: int = 0) -> None:
    """Move every weight a little, as training does: the model's outputs change."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator).to(param.device, param.dtype)
            param.add_(noise * 0.02 * param.abs().mean())


# vLLM's share of the GPU (on a CPU: of the machine's memory, for its KV cache)
VLLM_MEMORY = 0.25 if torch.cuda.is_available() else 0.05


def vllm_settings(dtype: str, **changes):
    from covey.rollout.engine import EngineSettings

    return EngineSettings(dtype=dtype, seed=0, max_model_len=1024, gpu_memory_utilization=VLLM_MEMORY, **changes)


def check_vllm_colocated(tokens: int) -> None:
    """Colocated vLLM: greedy and log-probs against the trainer model, a push taking effect, sleep
    mode where vLLM has one, and its speed against the fast engine."""
    from covey.rollout.vllm_engine import VLLMEngine

    model, tokenizer, eos = load_default()
    prompts, pad, cuda = default_prompts(tokenizer), tokenizer.pad_token_id, torch.cuda.is_available()
    dtype = "bfloat16" if cuda else "float32"
    start = time.perf_counter()
    engine = VLLMEngine(vllm_settings(dtype, sleep_mode=cuda), pad, eos, policy=model)
    print(f"info vLLM colocated ({dtype}{', sleep mode' if cuda else ''}) started in {time.perf_counter() - start:.0f} s")
    greedy, sampled = SamplingParams(max_new_tokens=tokens, greedy=True), SamplingParams(max_new_tokens=tokens)
    a, b = engine.generate(prompts, 1, greedy), HFEngine(model, pad, eos, bf16=dtype == "bfloat16").generate(prompts, 1, greedy)
    width = min(a.completion_ids_BT.shape[1], b.completion_ids_BT.shape[1])
    same = bool((a.completion_ids_BT[:, :width] == b.completion_ids_BT[:, :width]).all())
    if dtype == "float32":
        check("vLLM float32 greedy == generate", same, f"{width} tokens x {len(prompts)} prompts")
    else:
        print(f"info vLLM bf16 greedy vs generate bf16: {'identical' if same else 'differ'} over {width} tokens")
    bound = 1e-3 if dtype == "float32" else 0.5
    rollout = engine.generate(prompts, 8, sampled, seed=0)
    gap = logprob_gap(model, prompts, rollout, pad, bf16=False)
    check(f"vLLM {dtype} sampled log-probs vs the trainer's float32 forward", gap < bound,
          f"max |diff| {gap:.2e} (bound {bound})")
    if cuda:  # asleep after generating: its weights offloaded, its KV cache freed
        free, total = torch.cuda.mem_get_info()
        print(f"info vLLM asleep between generations: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    perturb(model)
    engine.policy_changed(model)  # as after an optimizer step: pushed before the next generation
    start = time.perf_counter()
    after = engine.generate(prompts, 8, sampled, seed=1)
    print(f"info push + rollout after an optimizer step: {time.perf_counter() - start:.2f} s")
    old, _, _ = load_default()
    new_gap, old_gap = (logprob_gap(m, prompts, after, pad, bf16=False) for m in (model, old))
    check("vLLM samples from the pushed weights", new_gap < old_gap and new_gap < bound,
          f"max |diff| {new_gap:.2e} against the pushed model, {old_gap:.2e} against the one before")
    from covey.rollout.fast.engine import FastEngine

    fast = FastEngine(model, pad, eos, tokenizer, bf16=dtype == "bfloat16")
    fast.generate(prompts, 2, SamplingParams(max_new_tokens=4), seed=0)
    rates = {}
    for name, e in (("fast", fast), ("vllm", engine)):
        runs = []
        for seed in range(3):
            start = time.perf_counter()
            r = e.generate(prompts, 16, sampled, seed=seed)
            runs.append(float(r.lengths_B.sum()) / (time.perf_counter() - start))
        rates[name] = statistics.median(runs)
    print(f"info rollout 2 x 16 {dtype}: fast {rates['fast']:.0f} tok/s, vLLM {rates['vllm']:.0f} tok/s"
          f"{' (waking from sleep included)' if cuda else ''}, {rates['vllm'] / rates['fast']:.2f}x")


def check_vllm_server(tokens: int) -> None:
    """vLLM's own server, started by covey server --backend vllm, taking pushes from this process."""
    from covey.rollout import ServerEngine
    from covey.rollout.server import vllm_serve_command
    from covey.models import embedded_model_folder
    from covey.rollout.weight_transfer import BACKEND, free_port

    model, tokenizer, eos = load_default()
    prompts, pad = default_prompts(tokenizer), tokenizer.pad_token_id
    cuda = torch.cuda.is_available()
    transfer = "nccl" if cuda and torch.cuda.device_count() >= 2 else BACKEND
    dtype = "bfloat16" if cuda else "float32"
    port = free_port()
    serve = vllm_serve_command(str(embedded_model_folder()), "127.0.0.1", port, dtype, 0, 1024, VLLM_MEMORY, False, None,
                               transfer)
    env = {**os.environ, **serve.env, **({"CUDA_VISIBLE_DEVICES": "1"} if transfer == "nccl" else {})}
    start = time.perf_counter()
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        server = subprocess.Popen(serve.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)  # its own process group: vLLM's children go with it
        try:
            while server.poll() is None:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
                    break
                except OSError:
                    time.sleep(2)
            if server.poll() is not None:
                log.seek(0)
                check("vLLM server starts", False, log.read()[-2000:])
                return
            print(f"info vLLM server ({dtype}, weight transfer {transfer}) started in {time.perf_counter() - start:.0f} s")
            old, _, _ = load_default()
            perturb(model)
            engine = ServerEngine("127.0.0.1", port, pad, eos, timeout=60, policy=model)
            start = time.perf_counter()
            rollout = engine.generate(prompts, 8, SamplingParams(max_new_tokens=tokens), seed=0)  # pushed first
            print(f"info first push (opening the group) + rollout: {time.perf_counter() - start:.2f} s")
            bound = 1e-3 if dtype == "float32" else 0.5
            new_gap, old_gap = (logprob_gap(m, prompts, rollout, pad, bf16=False) for m in (model, old))
            check(f"the vLLM server samples from weights pushed over {transfer}", new_gap < old_gap and new_gap < bound,
                  f"max |diff| {new_gap:.2e} against the pushed model, {old_gap:.2e} against the one before")
            perturb(model, seed=1)
            start = time.perf_counter()
            engine.push_policy(model)
            print(f"info a push of the whole model over {transfer}: {time.perf_counter() - start:.2f} s")
            held = engine.api.get("/weight_info").get("weight_version")
            check("the server names the last push", held == engine.pushed_version, f"weight_version {held}")
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def check_vllm_training(steps: int) -> None:
    """A short GRPO run of the default task sampling with colocated vLLM."""
    from covey import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as folder:
        trainer = GRPOTrainer(args=GRPOConfig.demo(output_dir=f"{folder}/run", max_steps=steps, bf16=cuda, eval_max_samples=0,
                                              logging_steps=1, rollout_engine="vllm",
                                              vllm_gpu_memory_utilization=VLLM_MEMORY),
                              quiet=True)
        trainer.train()
        summary = trainer.summary
    history = trainer.history
    finite = all(torch.isfinite(torch.tensor(float(h["loss"]))) for h in history)
    weights = ", ".join(f"{h.get('engine_is/mean_weight', float('nan')):.3f}" for h in history)
    check("GRPO steps sampling with vLLM", summary["steps"] == steps and finite,
          "step times " + ", ".join(f"{h['step_time']:.2f}" for h in history) + f" s; engine/trainer weights {weights}")


def check_async(steps: int) -> None:
    """The default run synchronous and then asynchronous (one round ahead, the fast engine): the async
    run's staleness and losses are checked; step times and peak GPU memory are reported side by side."""
    from covey import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    seen = {}
    for variant in ("synchronous", "asynchronous"):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with tempfile.TemporaryDirectory() as folder:
            trainer = GRPOTrainer(args=GRPOConfig.demo(output_dir=f"{folder}/run", max_steps=steps, bf16=cuda,
                                                  eval_max_samples=0, logging_steps=1,
                                                  async_generation=variant == "asynchronous"), quiet=True)
            trainer.train()
        history = trainer.history
        seen[variant] = (statistics.median(h["step_time"] for h in history[1:] or history),
                         torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"), history)
        del trainer
    history = seen["asynchronous"][2]
    staleness = [h.get("async/staleness") for h in history]
    finite = all(torch.isfinite(torch.tensor(float(h["loss"]))) for h in history)
    check("asynchronous GRPO steps, one round behind", staleness == [0.0] + [1.0] * (steps - 1) and finite,
          f"staleness {staleness}; engine/trainer weights "
          + ", ".join(f"{h.get('engine_is/mean_weight', float('nan')):.3f}" for h in history))
    (sync_s, sync_gb, _), (async_s, async_gb, _) = seen["synchronous"], seen["asynchronous"]
    print(f"info median step (after the first): synchronous {sync_s:.2f} s, asynchronous {async_s:.2f} s "
          f"({sync_s / async_s:.2f}x); peak GPU memory {sync_gb:.2f} / {async_gb:.2f} GiB", flush=True)


VLLM_PARTS = {"colocated": check_vllm_colocated, "server": check_vllm_server, "training": check_vllm_training}


def run_vllm_part(part: str, quick: bool) -> bool:
    """One vLLM part in a process of its own; its lines are printed as they come. False if it failed."""
    command = [sys.executable, "-m", "benchmarks.device_check", "--vllm-part", part] + (["--quick"] if quick else [])
    process = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = process.stdout.splitlines()
    for line in lines:
        if line.startswith(("ok  ", "FAIL", "info")):
            print(line, flush=True)
    if process.returncode != 0:
        print("\n".join(lines[-30:]))
    return process.returncode == 0


PLAN_CONFIGS = ("smollm2-full-256", "smollm2-bf16-128", "smollm2-checkpointing-256", "smollm2-lora-128",
                "qwen2.5-full-64", "qwen2.5-bf16-128", "qwen2.5-accumulate2-64")  # of benchmarks.plan_accuracy, one process each


def check_plan(quick: bool) -> None:
    """covey plan's estimate of a step's peak against torch.cuda.max_memory_allocated, for the first GPU:
    configurations of benchmarks.plan_accuracy (random-weight models of real shapes, two steps each), the
    peak counted from just before the trainer is built (so the weights count, as in the estimate)."""
    if not torch.cuda.is_available():
        print("info no CUDA GPU here: the plan's estimate against torch.cuda.max_memory_allocated was not checked")
        return
    import gc
    from pathlib import Path

    from benchmarks.plan_accuracy import COMMON, CONFIGS, make_model_folder
    from covey import GRPOConfig, GRPOTrainer
    from covey.plan import make_plan

    with tempfile.TemporaryDirectory() as folder:
        for name in PLAN_CONFIGS[:2] if quick else PLAN_CONFIGS:
            shape, _, fields = CONFIGS[name]
            model = make_model_folder(shape, Path(folder))
            settings = GRPOConfig.demo(**COMMON, **fields, model=str(model), output_dir=f"{folder}/run-{name}")
            plan = make_plan(settings, 1)
            gc.collect()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            trainer = GRPOTrainer(args=settings, quiet=True)
            trainer.train()
            measured = torch.cuda.max_memory_allocated() - before
            del trainer
            error = plan.breakdown.peak / measured - 1
            check(f"plan {name}", abs(error) <= 0.2, f"estimate {plan.breakdown.peak / 2**20:,.0f} MiB, measured "
                  f"{measured / 2**20:,.0f} MiB (max_memory_allocated), error {error:+.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 new tokens instead of 128, 2 training steps")
    parser.add_argument("--vllm-part", choices=list(VLLM_PARTS), help="run one vLLM part (in this process)")
    parser.add_argument("--plan-only", action="store_true", help="only covey plan's estimates against the GPU's peaks")
    args = parser.parse_args()
    if args.plan_only:
        check_plan(args.quick)
        return 1 if FAILURES else 0
    tokens = 32 if args.quick else 128
    if args.vllm_part:
        VLLM_PARTS[args.vllm_part](tokens if args.vllm_part != "training" else (2 if args.quick else 5))
        return 1 if FAILURES else 0
    model, tokenizer, eos = load_default()
    device, pad = next(model.parameters()).device, tokenizer.pad_token_id
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else device}, torch {torch.__version__}")
    prompts = default_prompts(tokenizer)
    failures = FAILURES

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
        trainer = GRPOTrainer(args=GRPOConfig.demo(output_dir=f"{folder}/run", max_steps=steps, bf16=True, eval_max_samples=0,
                                              logging_steps=1), quiet=True)
        trainer.train()
        summary = trainer.summary
        history = trainer.history
        finite = all(torch.isfinite(torch.tensor(float(h["loss"]))) for h in history)
        check("bf16 training steps", summary["steps"] == steps and finite,
              "step times " + ", ".join(f"{h['step_time']:.2f}" for h in history) + " s")
    check_async(3 if args.quick else 6)
    check_plan(args.quick)
    vision_failures = len(vision_check.FAILURES)
    vision_check.check_vision(args.quick)  # tiny vision-language models: pictures in sampling and training
    failures.extend(vision_check.FAILURES[vision_failures:])
    if importlib.util.find_spec("vllm") is None:
        print("info vLLM is not installed here: its checks were not run")
    else:
        for part in VLLM_PARTS:
            if not run_vllm_part(part, args.quick):
                failures.append(f"vLLM {part}")
    print("all checks passed" if not failures else f"failed: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
