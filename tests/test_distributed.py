"""Data-parallel training over two CPU processes (gloo), on a tiny random Llama.

Two processes, each with its own share of a round's prompts, must make the very update one process
makes on the whole batch; one of them alone writes the run folder, from metrics over both.
"""

import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from covey import GRPOConfig, GRPOTrainer
from covey.cli import main
from covey.core import completion_mask
from covey.data import PromptSampler
from covey.train import setup
from covey.train.distributed import World, sharded_part
from covey.train.sharding import whole
from covey.errors import CheckpointError, ConfigError, ModelError, TrainingInterrupted
from covey.rollout import Rollout, SamplesWithPolicy
from tests.conftest import SMALL_RUN, make_model, make_tokenizer

ROWS = [{"prompt": [{"role": "user", "content": f"say {c}"}], "answer": str(i)} for i, c in enumerate("abcdefgh")]
HELD_OUT = [{"prompt": [{"role": "user", "content": f"tell {c}"}], "answer": str(i)} for i, c in enumerate("vwxyz")]
CONSTANT = "say h"  # the prompt whose completions are all alike: its group carries no signal
CONSTANT_ROW = next(row for row in ROWS if row["prompt"][0]["content"] == CONSTANT)


def count_a(completions, **kwargs):
    return [(len(set(c[0]["content"])) + c[0]["content"].count("a")) / 8 for c in completions]


class ScriptedEngine(SamplesWithPolicy):
    """Completions that depend on the prompt and the sample's place in its group only, so that they
    are the same whichever process draws the prompt and however the batch is split."""

    exact_logprobs = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompt_ids, num_generations, params, seed=None) -> Rollout:
        rows = []
        for ids in prompt_ids:
            constant = CONSTANT in self.tokenizer.decode(ids)
            for j in range(num_generations):
                key = 0 if constant else sum(ids) + 7 * j
                text = "".join("abcdefghij"[(key * (k + 3)) % (3 + j % 7)] for k in range(1 + key % params.max_new_tokens))
                rows.append(self.tokenizer.encode(text, add_special_tokens=False)[:params.max_new_tokens - 1]
                            + [self.tokenizer.eos_token_id])
        T = max(len(r) for r in rows)
        ids_BT = torch.tensor([r + [self.tokenizer.pad_token_id] * (T - len(r)) for r in rows])
        lengths_B = torch.tensor([len(r) for r in rows])
        return Rollout(ids_BT, completion_mask(ids_BT, [self.tokenizer.eos_token_id], lengths_B),
                       torch.zeros(ids_BT.shape, dtype=torch.float32), ["eos"] * len(rows))


def settings(output_dir, processes: int, **overrides) -> GRPOConfig:
    """2 prompts x 4 completions per optimizer step in all, in 2 micro-batches of 4: one process
    accumulates both, or each of two processes runs one."""
    values = dict(output_dir=str(output_dir), max_steps=2, num_generations=4, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2 // processes, max_completion_length=8, learning_rate=1e-3, beta=0.04,
                  eval_max_samples=5, log_completions=True, logging_steps=1, seed=3)
    values = {**SMALL_RUN, **values}  # what the run relies on beyond its sizes
    values.update(overrides)
    return GRPOConfig(**values)


def train(output_dir, processes: int, signalled: bool = False, dropout: float = 0.0, sampled: bool = False,
          **overrides) -> dict:
    """Train; the summed gradient of every optimizer step (as the optimizer saw it), where the run
    stands in the data, and the signal that stopped it. ``signalled``: sent SIGINT in the first step;
    ``dropout``: on the attention weights, drawn from the torch random stream of each process;
    ``sampled``: the completions sampled by the configured engine instead of scripted."""
    tokenizer = make_tokenizer()
    rows = ROWS
    if overrides.pop("stream", False):  # a streamed dataset: each process reads it and takes its share of a round
        import datasets

        rows = datasets.IterableDataset.from_generator(lambda: iter(ROWS))
    if not sampled and overrides.get("async_generation"):  # the worker builds its own engine: scripted too
        with mock.patch.object(setup, "build_engine", lambda args, policy, tok, eos_ids: ScriptedEngine(tokenizer)):
            return train(output_dir, processes, signalled, dropout, sampled=True, stream=rows is not ROWS, **overrides)
    model = make_model(len(tokenizer), seed=1)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = dropout
    trainer = GRPOTrainer(model=model, reward_funcs=[count_a], args=settings(output_dir, processes, **overrides),
                          train_dataset=rows, eval_dataset=HELD_OUT, processing_class=tokenizer,
                          rollout_engine=None if sampled else ScriptedEngine(tokenizer), quiet=True)
    gradients, step = [], trainer.optimizer.step

    def recording_step(*args, **kwargs):  # a sharded gradient is gathered whole (every process at once)
        if signalled and not gradients:  # SIGINT in the first step
            os.kill(os.getpid(), signal.SIGINT)
        gradients.append([whole(p.grad).clone() for p in model.parameters() if p.grad is not None])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    stopped_by = None
    try:
        trainer.train()
    except TrainingInterrupted as e:
        stopped_by = e.signal_number
    held = (sharded_part(trainer.optimizer) or trainer.optimizer).state.values()  # this process's part, if sharded
    return {"gradients": gradients, "data": (trainer.prompt_sampler.state_dict(), trainer.progress.rounds_sampled),
            "stopped_by": stopped_by, "log_history": trainer.state.log_history, "optimizer_state": sum(t.numel() for state in held for t in state.values()
                                                             if isinstance(t, torch.Tensor) and t.dim() > 0)}


def _process(rank: int, port: int, output_dir: str, results: str, signalled_rank: int | None, dropout: float,
             overrides: dict) -> None:
    as_launched(rank, port)
    torch.set_num_threads(1)
    torch.save(train(output_dir, 2, rank == signalled_rank, dropout, **overrides), f"{results}-{rank}.pt")
    leave_group()


def as_launched(rank: int, port: int) -> None:
    """This spawned process's environment as a launcher sets it, for process ``rank`` of two."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def leave_group() -> None:
    """Leave the process group once both processes are done: a process that closed its connections while
    the other still waited on its last message would abort the other (gloo)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_in_two_processes(function, args: tuple, seconds: float = 300, natural_exit: bool = False) -> None:
    """``function(rank, *args)`` in two processes; fails rather than hangs where they wait for each other.

    Each process dumps its Python stacks if it crashes (faulthandler), and, once ``function`` returned,
    leaves the process group and ends at once, without the interpreter's teardown. A rare SIGABRT in the
    first process ("terminate called without an active exception", a C++ thread destroyed while running)
    has failed these tests once both had begun training, at a place not yet seen: the teardown, with gloo's
    threads, is where such aborts come from. ``natural_exit`` keeps the teardown, for a test of it."""
    processes = mp.start_processes(_in_process, nprocs=2, start_method="spawn", join=False,
                                   args=(function, natural_exit, *args))
    deadline = time.monotonic() + seconds
    while not processes.join(timeout=2):
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            pytest.fail(f"the two processes did not finish within {seconds} s (waiting for each other?)")


def _in_process(rank: int, function, natural_exit: bool, *args) -> None:
    faulthandler.enable()
    function(rank, *args)
    if natural_exit:
        return
    if torch.distributed.is_initialized():
        leave_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train_in_two_processes(tmp_path, run="two", signalled_rank=None, dropout=0.0, **overrides):
    results = str(tmp_path / f"results-{run}")
    run_in_two_processes(_process, (free_port(), str(tmp_path / run), results, signalled_rank, dropout, overrides))
    return [torch.load(f"{results}-{rank}.pt", weights_only=False) for rank in (0, 1)]  # written by _process


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("overrides", [
    {}, {"scale_rewards": "batch", "loss_type": "grpo"},
    # the adaptive entropy coefficient moves on the entropy of every process's tokens
    {"loss_type": "sapo", "use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 50.0,
     "off_policy_mask_threshold": 0.5},
    # each process's worker samples its share of the next round while the trainers train, one round behind
    {"async_generation": True},
    {"stream": True},  # the training rows read from a stream
])
def test_two_processes_make_the_update_one_process_makes_on_the_whole_batch(tmp_path, overrides):
    one = train(tmp_path / "one", 1, **overrides)["gradients"]
    results = train_in_two_processes(tmp_path, **overrides)
    two = [result["gradients"] for result in results]
    assert len(one) == len(two[0]) == len(two[1]) == 2
    # every process's log_history holds the first's metrics (made from its history there when read)
    assert results[0]["log_history"] == results[1]["log_history"] and len(results[0]["log_history"]) == 3
    for step in range(2):
        for single, rank0, rank1 in zip(one[step], two[0][step], two[1][step]):
            assert torch.equal(rank0, rank1)  # every process takes the same update
            assert torch.allclose(single, rank0, atol=1e-6, rtol=1e-4)
    # the first process alone records the run, with metrics over the whole batch
    one_metrics, two_metrics = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    for key in ("reward", "reward_std", "loss", "kl", "entropy", "completions/mean_length", "grad_norm") + (
            ("entropy_coef",) if "entropy_coef" in overrides else ()):
        assert [m[key] for m in two_metrics] == pytest.approx([m[key] for m in one_metrics], rel=1e-4, abs=1e-7), key
    if "async_generation" in overrides:  # the second round was sampled by the starting policy, and corrected
        assert [m["async/staleness"] for m in two_metrics] == [m["async/staleness"] for m in one_metrics] == [0, 1]
        assert two_metrics[1]["engine_is/mean_weight"] == pytest.approx(one_metrics[1]["engine_is/mean_weight"])
    completions = [json.loads(line) for line in (tmp_path / "two" / "completions.jsonl").read_text().splitlines()]
    first_step = [c for c in completions if c["step"] == 1]
    assert len(first_step) == 8 and len({str(c["prompt"]) for c in first_step}) == 2  # each process a prompt
    one_summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    two_summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    for when in ("before", "after"):  # the held-out rows split between the processes, then merged
        assert two_summary[when]["n"] == one_summary[when]["n"] == 5
        assert two_summary[when]["mean_reward"] == pytest.approx(one_summary[when]["mean_reward"])
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())


def test_dynamic_sampling_keeps_the_processes_in_step(tmp_path):
    """One process draws the prompt with constant rewards and must sample again; the other has its
    group already, passes its prompt of the extra round over, and both take the same steps."""
    # a seed whose first round draws the constant prompt (which then goes to one of the two processes)
    seed = next(seed for seed in range(100) if ROWS.index(CONSTANT_ROW) in next(PromptSampler(len(ROWS), 2, seed)))
    two = train_in_two_processes(tmp_path, dynamic_sampling=True, seed=seed, max_steps=2)
    assert len(two[0]["gradients"]) == len(two[1]["gradients"]) == 2
    assert two[0]["data"] == two[1]["data"]  # the same draws, so no prompt is trained twice in a round
    metrics = _metrics(tmp_path / "two")[0]
    assert metrics["dynamic_sampling/dropped_groups"] == 1
    assert metrics["dynamic_sampling/kept_groups"] == 2
    assert metrics["dynamic_sampling/extra_rounds"] == 1
    assert metrics["frac_reward_zero_std"] == 0


def test_a_signal_to_one_process_stops_both_with_a_checkpoint_and_the_run_resumes_exactly(tmp_path):
    """With dropout, so that each process must resume its own random stream (the checkpoint holds both)."""
    straight = train_in_two_processes(tmp_path, run="straight", dropout=0.3)
    stopped = train_in_two_processes(tmp_path, run="stopped", signalled_rank=1, dropout=0.3)
    assert [result["stopped_by"] for result in stopped] == [signal.SIGINT, signal.SIGINT]
    assert [len(result["gradients"]) for result in stopped] == [1, 1]
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["checkpoint-1"]
    resumed = train_in_two_processes(tmp_path, run="stopped", dropout=0.3, resume_from_checkpoint="auto")
    for rank in (0, 1):
        assert len(resumed[rank]["gradients"]) == 1  # step 2, as the run that was not stopped took it
        for after_resume, straight_on in zip(resumed[rank]["gradients"][0], straight[rank]["gradients"][1]):
            assert torch.allclose(after_resume, straight_on, atol=1e-7, rtol=1e-6)
    assert len(_metrics(tmp_path / "stopped")) == 2
    # resumed in one process: it goes on, but says that the steps now take fewer prompts
    with pytest.warns(UserWarning, match="written by a run of 2 process"):
        train(tmp_path / "one", 1, resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoints" / "checkpoint-1"))



def test_under_async_generation_a_checkpoint_holds_each_process_s_rounds_in_flight_and_the_run_resumes_exactly(
        tmp_path):
    """Stopped after step 1, each process's worker had sampled round 2 already (one round behind): the
    checkpoint holds both shares, and the resumed run trains them as the run that went on did."""
    straight = train_in_two_processes(tmp_path, run="straight", async_generation=True)
    stopped = train_in_two_processes(tmp_path, run="stopped", signalled_rank=1, async_generation=True)
    assert [len(result["gradients"]) for result in stopped] == [1, 1]
    checkpoint = tmp_path / "stopped" / "checkpoints" / "checkpoint-1"
    in_flight = torch.load(checkpoint / "in_flight.pt", weights_only=False)
    assert [len(process["rounds"]) for process in in_flight] == [1, 1]
    resumed = train_in_two_processes(tmp_path, run="stopped", resume_from_checkpoint="auto", async_generation=True)
    for rank in (0, 1):
        assert len(resumed[rank]["gradients"]) == 1
        for after_resume, straight_on in zip(resumed[rank]["gradients"][0], straight[rank]["gradients"][1]):
            assert torch.equal(after_resume, straight_on)
    assert [m["async/staleness"] for m in _metrics(tmp_path / "stopped")] == [0, 1]
    with pytest.raises(CheckpointError, match="holds the rounds 2 process\\(es\\) sampled ahead"):
        train(tmp_path / "one", 1, resume_from_checkpoint=str(checkpoint), async_generation=True)


def test_a_sharded_optimizer_state_makes_the_same_updates_from_half_the_memory_and_resumes_exactly(tmp_path):
    plain = train_in_two_processes(tmp_path, run="plain", max_steps=4)
    sharded = train_in_two_processes(tmp_path, run="sharded", max_steps=4, save_steps=2, shard_optimizer_state=True)
    for rank in (0, 1):
        for step in range(4):  # the same gradients after each update: the same updates
            for a, b in zip(plain[rank]["gradients"][step], sharded[rank]["gradients"][step]):
                assert torch.equal(a, b)
    # AdamW's two moments of every parameter, held once over the two processes
    assert sharded[0]["optimizer_state"] + sharded[1]["optimizer_state"] == plain[0]["optimizer_state"]
    assert 0 < sharded[0]["optimizer_state"] < plain[0]["optimizer_state"]
    # the checkpoint holds the whole state: resumed sharded or not, steps 3 and 4 (the first update from
    # the restored moments) are those of the run never stopped
    checkpoint = str(tmp_path / "sharded" / "checkpoints" / "checkpoint-2")
    for run, shard in (("resumed-sharded", True), ("resumed-plain", False)):
        resumed = train_in_two_processes(tmp_path, run=run, max_steps=4, resume_from_checkpoint=checkpoint,
                                         shard_optimizer_state=shard)
        for rank in (0, 1):
            assert len(resumed[rank]["gradients"]) == 2
            for step in (0, 1):
                for a, b in zip(resumed[rank]["gradients"][step], plain[rank]["gradients"][2 + step]):
                    assert torch.equal(a, b), (run, step)


def _sharded_step_saved(rank: int, port: int, folder: str) -> tuple[torch.nn.Module, Path]:
    """In process ``rank`` of two: one AdamW step with the state sharded, saved as a checkpoint in ``folder``."""
    from covey.train.checkpoint import save_checkpoint

    as_launched(rank, port)
    world = World.from_environment()
    model = make_model(len(make_tokenizer()), seed=1)
    optimizer = _sharded_adamw(model)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    whole = world.gather_optimizer_state(optimizer)
    return model, world.on_main(lambda: save_checkpoint(Path(folder), 1, model, whole, {}))


def _sharded_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=torch.optim.AdamW, lr=1e-3)


def _resume_sharded_in_bfloat16(rank: int, port: int, folder: str, results: str) -> None:
    from covey.train.checkpoint import load_checkpoint

    model, path = _sharded_step_saved(rank, port, folder)
    half = model.to(torch.bfloat16)  # the same run resumed in another dtype
    optimizer = _sharded_adamw(half)
    load_checkpoint(path, half, optimizer, process=rank)
    half(torch.tensor([[1, 2, 3]])).logits.float().sum().backward()
    optimizer.step()  # moments left in float32 would fail here
    torch.save({str(v.dtype) for s in optimizer.optim.state.values() for k, v in s.items() if k != "step"},
               f"{results}-{rank}.pt")
    leave_group()


def _read_own_part_on_resume(rank: int, port: int, folder: str, results: str) -> None:
    import covey.train.checkpoint as checkpoint

    model, path = _sharded_step_saved(rank, port, folder)
    read, original = [], checkpoint._read_tensors

    def recording(file, wanted):
        tensors = original(file, wanted)
        read.extend(tensors)
        return tensors

    checkpoint._read_tensors = recording
    optimizer = _sharded_adamw(model)
    checkpoint.load_checkpoint(path, model, optimizer, process=rank)
    loaded = {f"{i}.{key}": optimizer.optim.state[p][key] for i, p in enumerate(model.parameters())
              if p in optimizer.optim.state for key in ("exp_avg", "exp_avg_sq")}
    torch.save({"read": sorted(read), "loaded": loaded}, f"{results}-{rank}.pt")
    leave_group()


def test_each_process_reads_only_its_part_of_a_sharded_optimizer_state_on_resume(tmp_path):
    results = str(tmp_path / "parts")
    run_in_two_processes(_read_own_part_on_resume, (free_port(), str(tmp_path), results), seconds=120)
    from safetensors.torch import load_file

    parts = [torch.load(f"{results}-{rank}.pt") for rank in (0, 1)]
    read = [{int(key.split(".")[0]) for key in part["read"]} for part in parts]
    held = [{int(key.split(".")[0]) for key in part["loaded"]} for part in parts]
    assert read == held and read[0] and read[1] and not read[0] & read[1]  # its own parameters' state only
    saved = load_file(tmp_path / "checkpoints" / "checkpoint-1" / "optimizer.safetensors")
    assert sorted(parts[0]["read"] + parts[1]["read"]) == sorted(saved)  # each tensor read once in all
    for part in parts:  # and what each holds is what was saved
        assert all(torch.equal(value, saved[key]) for key, value in part["loaded"].items())


def test_a_sharded_optimizer_state_resumes_into_a_model_of_another_dtype(tmp_path):
    results = str(tmp_path / "dtypes")
    run_in_two_processes(_resume_sharded_in_bfloat16, (free_port(), str(tmp_path), results), seconds=120)
    assert [torch.load(f"{results}-{rank}.pt") for rank in (0, 1)] == [{"torch.bfloat16"}, {"torch.bfloat16"}]

class Unpicklable(Exception):
    def __init__(self):
        super().__init__("holds a lock")
        self.lock = threading.Lock()


class TwoArguments(Exception):  # pickles, but its constructor cannot be called again with its message alone
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def _fail_on_main(rank: int, port: int, results: str) -> None:
    as_launched(rank, port)
    world, raised = World.from_environment(), []
    for error in (ConfigError("no room"), Unpicklable(), TwoArguments("disk full", 28)):
        def fail(error=error):
            raise error
        try:
            world.on_main(fail)
        except Exception as e:
            raised.append(f"{type(e).__name__}: {e}")
    assert world.on_main(lambda: 42) == 42
    torch.save(raised, f"{results}-{rank}.pt")
    leave_group()


def test_an_error_in_the_first_process_reaches_every_process(tmp_path):
    results = str(tmp_path / "raised")
    run_in_two_processes(_fail_on_main, (free_port(), results), seconds=60)
    first, second = (torch.load(f"{results}-{rank}.pt") for rank in (0, 1))
    assert first == ["ConfigError: no room", "Unpicklable: holds a lock", "TwoArguments: disk full"]  # its own
    assert second == ["ConfigError: no room", "CoveyError: the first process failed: Unpicklable: holds a lock",
                      "CoveyError: the first process failed: TwoArguments: disk full"]


def test_a_process_a_checkpoint_has_no_random_state_for_draws_streams_of_its_own(tmp_path):
    """A checkpoint of one process resumed in several: the others do not all copy the first one's streams."""
    import random

    from covey.train.checkpoint import load_checkpoint, save_checkpoint

    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer), seed=1)
    optimizer = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path, 1, model, optimizer.state_dict(), {})
    streams = []
    for process in (0, 1, 2, 1):
        load_checkpoint(path, model, optimizer, process=process)
        streams.append((torch.rand(3).tolist(), random.random()))
    assert streams[0] != streams[1] != streams[2] != streams[0]
    assert streams[1] == streams[3]  # drawn from the checkpoint, so a second resume draws the same



def _final_model_on_a_full_disk(rank: int, port: int, output_dir: str, results: str) -> None:
    from transformers import PreTrainedModel

    real = PreTrainedModel.save_pretrained

    def disk_full_for_the_final_model(self, folder, *args, **kwargs):
        if Path(folder).name.startswith(".tmp-final_model"):
            raise OSError(28, "No space left on device")
        return real(self, folder, *args, **kwargs)

    PreTrainedModel.save_pretrained = disk_full_for_the_final_model
    as_launched(rank, port)
    torch.set_num_threads(1)
    try:
        train(output_dir, 2, save_steps=0, eval_max_samples=0)
        raised = None
    except CheckpointError as e:
        raised = str(e)
    torch.save(raised, f"{results}-{rank}.pt")
    leave_group()


def test_the_checkpoint_written_when_the_final_model_cannot_be_holds_every_process_random_state(tmp_path):
    results = str(tmp_path / "raised")
    run_in_two_processes(_final_model_on_a_full_disk, (free_port(), str(tmp_path / "run"), results))
    for rank in (0, 1):
        assert "the trained weights are in" in torch.load(f"{results}-{rank}.pt")
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint-2"
    assert (checkpoint / "rng-1.safetensors").is_file() and (checkpoint / "rng-1.json").is_file()

def test_colocated_vllm_in_several_processes_is_refused_before_joining_them(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="vllm_mode: colocate runs in a single process"):
        GRPOTrainer(reward_funcs=[count_a], args=settings(tmp_path / "run", 2, rollout_engine="vllm"), train_dataset=ROWS)


def _train_with_server(rank: int, port: int, server_port: int, output_dir: str, results: str,
                       overrides: dict) -> None:
    as_launched(rank, port)
    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    args = settings(output_dir, 2, rollout_engine="vllm", vllm_mode="server", vllm_server_port=server_port,
                    vllm_server_timeout=60, beta=0.0, **overrides)
    trainer = GRPOTrainer(model=make_model(len(tokenizer), seed=1), reward_funcs=[count_a], args=args,
                          train_dataset=ROWS, eval_dataset=HELD_OUT, processing_class=tokenizer, quiet=True)
    outcome = "finished"
    try:
        trainer.evaluate()  # before train(): it samples from the trainer's policy too
        trainer.train()
    except ModelError as e:
        outcome = str(e)
    torch.save(outcome, f"{results}-{rank}.pt")
    leave_group()


def serve(backend, failing_push: int | None = None):
    """A covey server in this process that counts the pushes it finishes; ``failing_push``: that
    push (1 for the first) fails, as when the server goes away."""
    from covey.rollout.server import RolloutServer

    server = RolloutServer(backend, "127.0.0.1", 0).start()
    server.pushes, update, finish = [], server.update_weights, server.finish_update

    def update_weights(update_info):
        if len(server.pushes) + 1 == failing_push:
            raise OSError("the server is going away")
        return update(update_info)

    def finish_update(version):
        if version is not None and not str(version).endswith("-incomplete"):
            server.pushes.append(version)
        return finish(version)

    server.update_weights, server.finish_update = update_weights, finish_update
    return server


def test_a_process_that_does_not_push_stops_the_run_when_the_server_restarted():
    """Only the first process pushes the policy: another that finds the server holding weights other
    than those the first pushed (a restart) cannot put the policy back, and says how to go on."""
    from covey.errors import ModelError
    from covey.rollout import SamplingParams
    from covey.rollout import ServerEngine
    from covey.rollout.server import FastBackend, RolloutServer

    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer), seed=5).eval()
    server = RolloutServer(FastBackend(model, tokenizer, [tokenizer.eos_token_id]), "127.0.0.1", 0).start()
    try:
        engine = ServerEngine("127.0.0.1", server.server_address[1], tokenizer.pad_token_id, [tokenizer.eos_token_id],
                              policy=model)
        engine.follow_pushes("covey-before-a-restart-1")  # as in a process that is not the first
        with pytest.raises(ModelError, match="holds weight_version None, not 'covey-before-a-restart-1' that the "
                                             "first training process pushed: it restarted.*resume it from its last "
                                             "checkpoint"):
            engine.generate([tokenizer.encode("say a")], 2, SamplingParams(max_new_tokens=4))
    finally:
        server.close()


@pytest.mark.parametrize("overrides", [{}, {"fsdp": "full_shard"}])
def test_processes_share_one_rollout_server_that_the_first_keeps_up_to_date(tmp_path, overrides):
    """vllm_mode: server with two training processes (the server runs covey's fast engine): the
    first process pushes the policy before anyone samples from a changed one, never the others,
    and the last evaluation samples from the trained weights (under fsdp, gathered from the shards
    with the other process's help)."""
    from safetensors.torch import load_file

    from covey.rollout.server import FastBackend

    tokenizer = make_tokenizer()
    backend = FastBackend(make_model(len(tokenizer), seed=5).eval(), tokenizer, [tokenizer.eos_token_id])
    server = serve(backend)
    results = str(tmp_path / "outcome")
    try:
        run_in_two_processes(_train_with_server, (free_port(), server.server_address[1], str(tmp_path / "run"), results,
                                                  overrides))
    finally:
        server.close()
    assert [torch.load(f"{results}-{rank}.pt") for rank in (0, 1)] == ["finished", "finished"]
    # an evaluation before train() (and the one train() starts with), the second round, the last evaluation
    assert len(server.pushes) == 3
    assert len(_metrics(tmp_path / "run")) == 2
    trained = load_file(tmp_path / "run" / "final_model" / "model.safetensors")
    served = backend.model.state_dict()
    assert all(torch.equal(tensor, served[name]) for name, tensor in trained.items())


def test_a_push_that_fails_comes_after_the_checkpoint_of_the_round_before(tmp_path):
    from covey.rollout.server import FastBackend

    tokenizer = make_tokenizer()
    server = serve(FastBackend(make_model(len(tokenizer), seed=5).eval(), tokenizer, [tokenizer.eos_token_id]),
                   failing_push=2)
    results = str(tmp_path / "outcome")
    try:
        run_in_two_processes(_train_with_server, (free_port(), server.server_address[1], str(tmp_path / "run"),
                                                  results, {"save_steps": 1}))
    finally:
        server.close()
    outcomes = [torch.load(f"{results}-{rank}.pt") for rank in (0, 1)]
    assert all("the server is going away" in outcome for outcome in outcomes), outcomes
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["checkpoint-1"]


@pytest.mark.parametrize("command", ["verify", "generate", "eval", "server"])
def test_commands_other_than_train_are_refused_under_a_launcher(command, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([command]) == 2
    assert f"covey[0]: error: covey {command} runs in a single process" in capsys.readouterr().err


@pytest.mark.parametrize("agents", [1, 2])
def test_torchrun_trains_with_covey_train(tmp_path, tiny_model_dir, agents):
    """The command line under torchrun: one run folder, written once, the batch of both processes; with
    two agents (two "nodes" of one process each) meeting at a c10d rendezvous, as several machines do."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a} + 1"}], "answer": str(a + 1)})
                            + "\n" for a in range(6)))
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""
        model: {tiny_model_dir}
        dataset: {data}
        reward_funcs: [answer_format]
        num_generations: 4
        per_device_train_batch_size: 4
        max_completion_length: 6
        max_steps: 2
        save_steps: 1
        log_completions: true
        logging_steps: 1
        output_dir: {tmp_path / "run"}
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = ["-m", "covey", "train", str(config)]
    if agents == 1:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), *command],
                              capture_output=True, text=True, env=env, timeout=300)
    else:  # what each machine runs, here twice on one machine
        launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                  "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", "covey-test"]
        nodes = [subprocess.Popen([*launch, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for _ in range(2)]
        outputs = [node.communicate(timeout=300) for node in nodes]
        assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outputs]
        done = subprocess.CompletedProcess([], 0, "".join(o for o, _ in outputs), "".join(e for _, e in outputs))
    run = tmp_path / "run"
    assert len(_metrics(run)) == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert (run / "final_model" / "model.safetensors").is_file()
    first_step = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()
                  if json.loads(line)["step"] == 1]
    assert len(first_step) == 8 and len({str(c["prompt"]) for c in first_step}) == 2
    assert done.stderr.count("checkpoint saved: ") == 2  # told once, not by each process


def test_covey_closes_only_the_process_group_it_started(tmp_path):
    """Colocated vLLM starts a process group of its own in the trainer's process and closes it at exit:
    the end of covey train leaves it alone."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        World.leave()
        assert torch.distributed.is_initialized()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("environ, message", [
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "the accelerate config asks for DeepSpeed, which covey does not run"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "covey shards with FSDP2 only: set fsdp_version: 2"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"},
     "offload_params='true' is not supported"),
    ({"ACCELERATE_USE_MEGATRON_LM": "true"}, "asks for Megatron-LM, which covey does not run"),
    ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, "compiles with dynamo_backend INDUCTOR"),
    ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "mixed_precision: fp16, and covey takes its precision from its own"),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, "set bf16: true there"),
])
def test_an_accelerate_config_asking_for_what_covey_does_not_do_is_refused_before_loading(tmp_path, monkeypatch,
                                                                                          environ, message):
    from covey.train.distributed import check_launcher_settings

    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(model=str(tmp_path / "never-loaded"), reward_funcs=[count_a], train_dataset=ROWS,
                    args=GRPOConfig(output_dir=str(tmp_path / "run")))
    check_launcher_settings(True, {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DYNAMO_BACKEND": "NO",
                                   "ACCELERATE_USE_CPU": "true"})  # a plain data-parallel config, bf16 both places


def _train_and_leave_with_the_trainer_alive(rank: int, port: int, output_dir: str) -> None:
    as_launched(rank, port)
    torch.set_num_threads(1)
    trainer = GRPOTrainer(model=make_model(len(make_tokenizer()), seed=1), reward_funcs=[count_a],
                          args=settings(output_dir, 2, max_steps=1), train_dataset=ROWS,
                          processing_class=make_tokenizer(), quiet=True)
    trainer.train()
    torch.distributed.destroy_process_group()  # as a script may: the trainer is freed only at exit, after it


def test_a_process_exits_when_its_trainer_outlives_the_process_group(tmp_path):
    """A script that closes the process group and then ends, its trainer still alive: it exits (gloo's
    teardown under a data-parallel wrapper freed after the group deadlocked)."""
    run_in_two_processes(_train_and_leave_with_the_trainer_alive, (free_port(), str(tmp_path / "run")), seconds=120,
                         natural_exit=True)
