"""Peak memory of one GRPO step as the completions grow, covey against TRL, at two vocabularies.

Random-weight models of real shapes with two decoder layers (so it runs on a CPU): SmolLM2-135M's
(Llama, hidden 576, vocabulary 49,152) and Qwen2.5-0.5B's (Qwen2, hidden 896, vocabulary 151,936), tied
embeddings, float32. One prompt, a group of ``--group`` completions of exactly the length limit, the
same token ids for both trainers: a ``rollout_func`` (TRL's, which covey takes as it is) hands them over,
so the step is the work this measures (the log-prob pass, its backward, the optimizer) and not
sampling, which would take far longer on a CPU than the step itself. beta 0 (no reference model),
one pass over each batch, AdamW, gradient checkpointing the same in both (on: TRL 1.16's default, which
recomputes the decoder's activations in the backward; ``--gradient-checkpointing off`` for neither);
float32, or bfloat16 autocast for a trainer named with ``-bf16`` (``covey-bf16``, ``trl-bf16``). Each
configuration runs in a fresh process; its peak is that process's
resident-set high-water mark (``ru_maxrss``): weights, gradients, optimizer state and the step. Time:
the median of the steps after the first (with ``--steps 1``, the one step).

    python -m benchmarks.logprob_memory --lengths 256 512 1024 --vocabularies 49152 151936 --group 2 \\
        --trainers covey trl [--covey-before SRC] [--covey-budgets 1200] [--parallel 4]
                                        # SRC: another covey's src folder; covey also at a budget of 1200 MiB
    python -m benchmarks.logprob_memory --pass-alone 3 --lengths 512 --group 2 --budgets 64 128   # head's time
    python -m benchmarks.logprob_memory --pass-memory --lengths 512 --group 2                     # head's memory
    python -m benchmarks.logprob_memory --worker covey --vocabularies 151936 --lengths 512 --group 2 --stages
                                                        # one run in this process, its peak per stage (or trl)

The last two take the output head's pass alone on random hidden states, against the whole [N, V] logits
computed at once (the pass before chunking, kept here as the baseline only).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

SHAPES = {  # vocabulary -> (architecture, hidden, intermediate, heads, key-value heads)
    49152: ("llama", 576, 1536, 9, 3),
    151936: ("qwen2", 896, 4864, 14, 2),
}
PROMPT = [{"role": "user", "content": "Write a long story."}]
PROMPT_IDS = list(range(200, 232))  # 32 prompt tokens


def random_model(vocabulary: int, tokenizer):
    """Two decoder layers of the shape, random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    architecture, hidden, intermediate, heads, kv_heads = SHAPES[vocabulary]
    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if architecture == "llama" else \
        (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(0)
    config = config_class(vocab_size=vocabulary, hidden_size=hidden, intermediate_size=intermediate,
                          num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=8192, tie_word_embeddings=True,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    return model_class(config)


def fixed_rollouts(length: int):
    """A rollout_func: for each prompt, ``length`` token ids drawn from ordinary tokens (none ends the
    completion), the same for every trainer; log-probs those of a uniform sampler."""
    import math

    import torch

    def rollout(prompts, trainer):
        g = torch.Generator().manual_seed(len(prompts) * 1000 + length)
        ids = torch.randint(100, 49000, (len(prompts), length), generator=g).tolist()
        return {"prompt_ids": [PROMPT_IDS] * len(prompts), "completion_ids": ids,
                "logprobs": [[-math.log(49152)] * length for _ in prompts]}

    return rollout


def completion_length(completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len(set(t)) / 100 for t in texts]


def run_covey(model, tokenizer, length: int, group: int, steps: int, out_dir: str,
              checkpointing: bool = True, budget_mib: int | None = None, bf16: bool = False) -> list[float]:
    from covey import GRPOConfig, GRPOTrainer

    budget = {} if budget_mib is None else {"logprob_budget_mib": budget_mib}  # None: the default (any version)

    args = GRPOConfig(output_dir=out_dir, max_steps=steps, num_generations=group, per_device_train_batch_size=group,
                      gradient_accumulation_steps=1, max_completion_length=length, beta=0.0, num_iterations=1,
                      learning_rate=1e-6, temperature=1.0, eval_max_samples=0, log_completions=False, seed=0,
                      vllm_importance_sampling_correction=False, gradient_checkpointing=checkpointing, bf16=bf16,
                      **budget)
    GRPOTrainer(model=model, reward_funcs=completion_length, train_dataset=[{"prompt": PROMPT}] * 64,
                processing_class=tokenizer, args=args, quiet=True, rollout_func=fixed_rollouts(length)).train()
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    tokens = [m["completions/mean_length"] for m in metrics]
    assert all(t == length for t in tokens), f"completions ended early: mean lengths {tokens}"
    return [m["step_time"] for m in metrics]


def run_trl(model, tokenizer, length: int, group: int, steps: int, out_dir: str,
            checkpointing: bool = True, bf16: bool = False) -> list[float]:
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Timer(TrainerCallback):
        def __init__(self):
            self.seconds, self.lengths, self.start = [], [], 0.0

        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    config = GRPOConfig(output_dir=out_dir, max_steps=steps, num_generations=group, per_device_train_batch_size=group,
                        gradient_accumulation_steps=1, max_completion_length=length, beta=0.0, num_iterations=1,
                        learning_rate=1e-6, temperature=1.0, logging_steps=1, report_to="none", use_cpu=True,
                        bf16=bf16, save_strategy="no", seed=0, vllm_importance_sampling_correction=False,
                        gradient_checkpointing=checkpointing)
    timer = Timer()
    GRPOTrainer(model=model, reward_funcs=completion_length, args=config, processing_class=tokenizer,
                train_dataset=datasets.Dataset.from_list([{"prompt": PROMPT}] * 64), callbacks=[timer],
                rollout_func=fixed_rollouts(length)).train()
    assert all(t == length for t in timer.lengths), f"completions ended early: mean lengths {timer.lengths}"
    return timer.seconds


def worker(trainer: str, vocabulary: int, length: int, group: int, steps: int, checkpointing: bool,
           stages: bool = False, budget_mib: int | None = None) -> None:
    from covey.sources import EMBEDDED_MODEL
    from covey.models import load_tokenizer

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    trainer, bf16 = trainer.removesuffix("-bf16"), trainer.endswith("-bf16")
    peaks = StagePeaks(trainer) if stages else None
    model = random_model(vocabulary, tokenizer)
    if peaks is not None:
        peaks.stage = "after the model is built"
    with tempfile.TemporaryDirectory() as out_dir:
        out = os.path.join(out_dir, "run")
        seconds = run_trl(model, tokenizer, length, group, steps, out, checkpointing, bf16) if trainer == "trl" else \
            run_covey(model, tokenizer, length, group, steps, out, checkpointing, budget_mib, bf16)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if peaks is not None:
        print("STAGES " + json.dumps(peaks.peaks_mib), flush=True)
    print("RESULT " + json.dumps({"seconds": seconds, "peak_mib": peak_mib}), flush=True)


class StagePeaks:
    """The resident set's highest value in each stage of a run, sampled every 5 ms by a thread (torch's
    operations let it run): the stage is the innermost of the calls below that is under way (the trainer's
    set-up, the step's parts, the log-prob passes, the backward, AdamW's step), else the last one ended."""

    def __init__(self, trainer: str):
        import functools
        import threading

        import torch

        self.stage, self.peaks_mib = "building the model", {}
        page = os.sysconf("SC_PAGE_SIZE")

        def sample():
            while True:
                with open("/proc/self/statm") as f:
                    mib = int(f.read().split()[1]) * page / 2**20
                self.peaks_mib[self.stage] = round(max(self.peaks_mib.get(self.stage, 0), mib))
                time.sleep(0.005)

        def wrap(owner, name: str, stage: str) -> None:
            function = getattr(owner, name)

            @functools.wraps(function)
            def staged(*args, **kwargs):
                outer, self.stage = self.stage, stage
                try:
                    return function(*args, **kwargs)
                finally:
                    self.stage = f"after {stage}" if outer.startswith("after") else outer

            setattr(owner, name, staged)

        wrap(torch.Tensor, "backward", "backward")
        wrap(torch.optim.AdamW, "step", "AdamW step")
        if trainer == "covey":
            import covey.train.forward
            import covey.train.step
            import covey.train.trainer

            wrap(covey.train.trainer.GRPOTrainer, "__init__", "trainer set-up")
            for name in ("generate_and_score", "fixed_logprobs"):
                wrap(covey.train.step, name, name)
            wrap(covey.train.forward.TrainingForward, "forward", "log-prob pass (forward)")
        else:
            import trl

            wrap(trl.GRPOTrainer, "__init__", "trainer set-up")
            wrap(trl.GRPOTrainer, "_generate_and_score_completions", "generate_and_score")
            wrap(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", "log-prob pass (forward)")
        threading.Thread(target=sample, daemon=True).start()


def measure(trainer: str, vocabulary: int, length: int, group: int, steps: int, source: str | None,
            checkpointing: bool, budget_mib: int | None = None) -> dict:
    """One configuration in a fresh process; ``source``: the covey src folder it imports (another version);
    ``budget_mib``: covey's logprob_budget_mib (None: its default)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if source:
        env["PYTHONPATH"] = os.pathsep.join([source, os.getcwd()])
    out = subprocess.run([sys.executable, "-m", "benchmarks.logprob_memory", "--worker", trainer,
                          "--vocabularies", str(vocabulary), "--lengths", str(length), "--group", str(group),
                          "--steps", str(steps), "--gradient-checkpointing", "on" if checkpointing else "off",
                          *(["--budget-mib", str(budget_mib)] if budget_mib else [])],
                         capture_output=True, text=True, env=env)
    line = next((text for text in out.stdout.splitlines() if text.startswith("RESULT ")), None)
    if line is None:
        killed = " (killed: out of memory?)" if out.returncode == -9 else ""
        return {"error": f"exit {out.returncode}{killed}: " + (out.stderr.strip().splitlines() or [""])[-1]}
    result = json.loads(line[len("RESULT "):])
    timed = result["seconds"][1:] or result["seconds"]  # the first step warms up, where there are more
    return {"peak_mib": result["peak_mib"], "seconds": statistics.median(timed)}


def pass_alone(vocabulary: int, tokens: int, repeats: int, budgets_mib: list[int], frozen_head: bool = False) -> None:
    """The log-prob pass's head alone, forward and backward on ``tokens`` hidden states, in one process,
    the ways alternating: the whole [N, V] logits at once (the pass before chunking, kept here only as
    the baseline: ``core.token_logprobs`` on ``lm_head``'s output), 128-token chunks with every chunk's
    logits computed again in the backward (as the first chunked pass did), and ``covey.train.head.head_logprobs``
    under each budget and under the budget left to covey (``logprob_budget_mib: null``: the whole logits where
    they take at most a quarter of the memory free here); the median time of each, and its ratio to the whole
    logits. ``frozen_head``: the head's weight takes no gradient (as under LoRA), only the hidden states."""
    import torch

    from covey.sources import EMBEDDED_MODEL
    from covey.core import logprob_budget, logprob_chunk_tokens, token_logprobs
    from covey.models import load_tokenizer
    from covey.plan.device import this_device
    from covey.train.head import head_logprobs

    model = random_model(vocabulary, load_tokenizer(EMBEDDED_MODEL))
    model.lm_head.weight.requires_grad_(not frozen_head)
    left_to_covey = logprob_budget(None, tokens, vocabulary, this_device(True).available)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, model.config.hidden_size, generator=g, requires_grad=True)
    ids = torch.randint(0, vocabulary, (tokens,), generator=g)
    ways = {"whole logits": lambda: token_logprobs(model.lm_head(hidden), ids, True),
            "128 tokens, none kept": lambda: head_logprobs(model, hidden, ids, with_entropy=True, chunk=128, budget=0)}
    for mib in budgets_mib:
        ways[f"{mib} MiB"] = lambda mib=mib: head_logprobs(model, hidden, ids, with_entropy=True, budget=mib * 2**20)
    ways["left to covey"] = lambda: head_logprobs(model, hidden, ids, with_entropy=True, budget=left_to_covey)
    times: dict[str, list[float]] = {name: [] for name in ways}
    cpu: dict[str, list[float]] = {name: [] for name in ways}  # the process's CPU time: less moved by other work
    for _ in range(repeats):
        for name, way in ways.items():
            model.zero_grad(set_to_none=True)
            hidden.grad = None
            start, start_cpu = time.perf_counter(), time.process_time()
            logp, _ = way()
            logp.sum().backward()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    medians = {name: statistics.median(t) for name, t in times.items()}
    cpu_medians = {name: statistics.median(t) for name, t in cpu.items()}
    whole = medians["whole logits"]
    whole_cpu = cpu_medians["whole logits"]
    cells = " | ".join(f"{seconds:.2f} ({seconds / whole:.2f}); CPU {cpu_medians[name]:.2f} "
                       f"({cpu_medians[name] / whole_cpu:.2f})" for name, seconds in medians.items())
    chunks = ", ".join(f"{mib} MiB: {logprob_chunk_tokens(vocabulary, mib * 2**20)}" for mib in budgets_mib)
    chunks += f"; left to covey: {left_to_covey / 2**20:.0f} MiB, {logprob_chunk_tokens(vocabulary, left_to_covey)}"
    print(f"| {vocabulary:,} | {tokens:,} | {cells} | {chunks} |", flush=True)


PASS_WAYS = ("whole logits", "128 tokens, none kept", "budget")
TRAINERS = ("covey", "covey-bf16", "trl", "trl-bf16")  # -bf16: under bfloat16 autocast (bf16: true)


def pass_memory_worker(vocabulary: int, tokens: int, way: str) -> None:
    """One way of the head's pass alone, forward and backward once, the weight training: the process's
    resident-set high-water mark above its resident set just before the pass (weights, hidden states and
    the model already there)."""
    import torch

    from covey.sources import EMBEDDED_MODEL
    from covey.core import token_logprobs
    from covey.models import load_tokenizer
    from covey.train.head import head_logprobs

    model = random_model(vocabulary, load_tokenizer(EMBEDDED_MODEL))
    model.lm_head.weight.requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, model.config.hidden_size, generator=g, requires_grad=True)
    ids = torch.randint(0, vocabulary, (tokens,), generator=g)
    ways = {"whole logits": lambda: token_logprobs(model.lm_head(hidden), ids, True),
            "128 tokens, none kept": lambda: head_logprobs(model, hidden, ids, with_entropy=True, chunk=128, budget=0),
            "budget": lambda: head_logprobs(model, hidden, ids, with_entropy=True)}
    with open("/proc/self/status") as f:
        before = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > before:  # loading peaked higher: reset the mark
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    logp, _ = ways[way]()
    logp.sum().backward()
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    model.zero_grad(set_to_none=True)
    hidden.grad = None
    with LiveTensors() as live:  # again, counting the tensors' own bytes
        logp, _ = ways[way]()
        logp.sum().backward()
    print("RESULT " + json.dumps({"pass_mib": (peak - before) / 1024, "tensors_mib": live.most / 2**20}), flush=True)


def LiveTensors():
    """A dispatch mode that follows the bytes of the tensors made under it while they live (each storage
    once; views and in-place results are their inputs' memory): ``most``, the highest sum."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.most = 0
            self.held: set[int] = set()

        def _freed(self, key: int, size: int) -> None:
            self.live -= size
            self.held.discard(key)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(r.alias_info is not None for r in func._schema.returns):
                return out
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                storage = getattr(tensor, "untyped_storage", lambda: None)()
                if storage is None or storage.data_ptr() in self.held:
                    continue
                key, size = storage.data_ptr(), storage.nbytes()
                self.held.add(key)
                self.live += size
                self.most = max(self.most, self.live)
                weakref.finalize(storage, self._freed, key, size)
            return out

    return Live()


def pass_memory(vocabulary: int, tokens: int) -> None:
    """Each way of ``pass_memory_worker`` in a fresh process, one after the other."""
    results = []
    for way in PASS_WAYS:
        out = subprocess.run([sys.executable, "-m", "benchmarks.logprob_memory", "--pass-memory-worker", way,
                              "--vocabularies", str(vocabulary), "--lengths", str(tokens), "--group", "1"],
                             capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        line = next((t for t in out.stdout.splitlines() if t.startswith("RESULT ")), None)
        result = json.loads(line[7:]) if line else None
        results.append(f"{result['pass_mib']:.0f}; tensors {result['tensors_mib']:.0f}" if line
                       else f"failed: {out.stderr[-200:]}")
    print(f"| {vocabulary:,} | {tokens:,} | {' | '.join(results)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--vocabularies", type=int, nargs="+", default=[49152, 151936], choices=list(SHAPES))
    parser.add_argument("--trainers", nargs="+", default=["covey", "trl"], choices=TRAINERS)
    parser.add_argument("--covey-before", help="another covey's src folder, measured as 'covey before' beside them")
    parser.add_argument("--covey-budgets", type=int, nargs="+", default=[], metavar="MIB",
                        help="covey also with these logprob_budget_mib, each measured as 'covey N MiB'")
    parser.add_argument("--budget-mib", type=int, help="with --worker covey: its logprob_budget_mib")
    parser.add_argument("--group", type=int, default=8, help="completions per step (one prompt's group)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", choices=["on", "off"], default="on",
                        help="for covey and TRL alike (on: TRL's default; covey's is off)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="configurations measured at once (each in its own process; peaks stay per process)")
    parser.add_argument("--pass-alone", type=int, metavar="REPEATS",
                        help="time the head's pass alone (whole logits against chunked), REPEATS times each")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128], metavar="MIB",
                        help="with --pass-alone: the head's budgets timed (LOGPROB_CHUNK_BYTES, in MiB)")
    parser.add_argument("--frozen-head", action="store_true",
                        help="with --pass-alone: the head's weight frozen (as under LoRA), the hidden states' gradient only")
    parser.add_argument("--pass-memory", action="store_true",
                        help="the head's pass alone: its peak memory above the process's before it, each way in a "
                             "fresh process (whole logits, 128-token chunks none kept, the budget)")
    parser.add_argument("--pass-memory-worker", choices=PASS_WAYS)
    parser.add_argument("--worker", choices=TRAINERS,
                        help="one configuration in this process (--stages: also the resident set's peak per stage)")
    parser.add_argument("--stages", action="store_true")
    args = parser.parse_args()
    checkpointing = args.gradient_checkpointing == "on"
    if args.pass_memory_worker:
        pass_memory_worker(args.vocabularies[0], args.lengths[0] * args.group, args.pass_memory_worker)
        return
    if args.pass_memory:
        print(f"| vocabulary | tokens | {' | '.join(f'{w}: RSS MiB; tensors MiB' for w in PASS_WAYS)} |")
        print("|---|---|---|---|---|")
        for vocabulary in args.vocabularies:
            for length in args.lengths:
                pass_memory(vocabulary, length * args.group)
        return
    if args.pass_alone:
        ways = ["whole logits", "128 tokens, none kept"] + [f"budget {mib} MiB" for mib in args.budgets] + ["left to covey"]
        print(f"| vocabulary | tokens | {' | '.join(f'{w} s (/ whole); CPU s (/ whole)' for w in ways)} | "
              "tokens per chunk |")
        print("|---|---|" + "---|" * (len(ways) + 1))
        for vocabulary in args.vocabularies:
            for length in args.lengths:
                pass_alone(vocabulary, length * args.group, args.pass_alone, args.budgets, args.frozen_head)
        return
    if args.worker:
        worker(args.worker, args.vocabularies[0], args.lengths[0], args.group, args.steps, checkpointing, args.stages,
               args.budget_mib)
        return
    runs = [(name, name, None, None) for name in args.trainers]  # (name, trainer, src folder, covey's budget)
    if args.covey_before:
        runs.insert(1, ("covey before", "covey", args.covey_before, None))
    runs[1:1] = [(f"covey {mib} MiB", "covey", None, mib) for mib in args.covey_budgets]
    jobs = [(vocabulary, length, run) for vocabulary in args.vocabularies for length in args.lengths for run in runs]
    # the largest first, so that the last to finish are short ones
    order = sorted(jobs, key=lambda job: -job[0] * job[1])
    def run(job):
        result = measure(job[2][1], job[0], job[1], args.group, args.steps, job[2][2], checkpointing, job[2][3])
        print(f"measured {job[2][0]}, vocabulary {job[0]}, {job[1]} x {args.group} tokens: {result}", flush=True)
        return result

    with ThreadPoolExecutor(args.parallel) as pool:
        futures = {job: pool.submit(run, job) for job in order}
    names = [name for name, *_ in runs]
    print(f"| vocabulary | completion tokens | {' | '.join(f'{n} peak MiB' for n in names)} | "
          f"{' | '.join(f'{n} s/step' for n in names)} |")
    print("|---|---|" + "---|" * 2 * len(runs))
    for vocabulary in args.vocabularies:
        for length in args.lengths:
            results = [futures[(vocabulary, length, run)].result() for run in runs]
            peaks = [f"{r['peak_mib']:.0f}" if "error" not in r else f"failed: {r['error'][:80]}" for r in results]
            times = [f"{r['seconds']:.1f}" if "error" not in r else "" for r in results]
            print(f"| {vocabulary:,} | {length:,} x {args.group} | {' | '.join(peaks)} | {' | '.join(times)} |",
                  flush=True)


if __name__ == "__main__":
    main()
