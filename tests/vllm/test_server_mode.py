"""vllm_mode: server against vLLM's own server (started by covey server --backend vllm): its samples,
weights pushed over covey's weight-transfer backend (covey_gloo, registered with vLLM's factory), two
training processes sharing it, and a push that fails or a server that dies.

The tests share one server, in file order: the last leaves it half-updated, then kills it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.errors import ConfigError, ModelError
from covey.models import load_policy
from covey.rollout import SamplingParams, ServerEngine
from tests.conftest import trained_lora
from tests.test_distributed import as_launched, free_port, run_in_two_processes
from tests.vllm.conftest import GREEDY, assert_greedy_of, completions, largest_logprob_gap
from tests.vllm.test_colocate import SAMPLED, perturbed



START_S = 600  # vLLM's start compiles the model: minutes on two cores


class Server:
    def __init__(self, process: subprocess.Popen, port: int, log: Path):
        self.process, self.port, self.log = process, port, log

    @classmethod
    def start(cls, model_folder: str, log: Path, *settings: str) -> "Server":
        """``covey server --backend vllm`` on ``model_folder`` with ``settings``, once it answers."""
        port = free_port()
        command = [sys.executable, "-m", "covey", "server", "--backend", "vllm", "--port", str(port), "--model",
                   model_folder, *settings]
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ},
                                       start_new_session=True)  # its own process group, vLLM's children included
        deadline = time.monotonic() + START_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"covey server --backend vllm exited ({process.returncode}):\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
                return cls(process, port, log)
            except OSError:
                if time.monotonic() > deadline:
                    os.killpg(process.pid, signal.SIGKILL)
                    pytest.fail(f"vLLM's server did not answer within {START_S} s:\n{log.read_text()[-3000:]}")
                time.sleep(2)

    def requests(self, endpoint: str) -> int:
        """How many requests to ``endpoint`` the server's access log shows so far."""
        return self.log.read_text(errors="replace").count(f'"POST {endpoint} HTTP')

    def engine(self, policy=None, eos=(2,), timeout: float = 60) -> ServerEngine:
        return ServerEngine("127.0.0.1", self.port, 2, list(eos), timeout=timeout, policy=policy)

    def kill(self) -> None:
        """The server and the engine and worker processes it started, all at once (as when its machine goes)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, model_folder):
    server = Server.start(model_folder, tmp_path_factory.mktemp("server") / "server.log",
                          "--vllm-gpu-memory-utilization", "0.03", "--max-prompt-length", "256",
                          "--max-completion-length", "256")
    yield server
    server.kill()


def test_the_server_samples_what_colocated_vllm_samples(vllm_server, colocated, policy, prompts, default_tokenizer):
    eos = [default_tokenizer.eos_token_id]
    engine = vllm_server.engine(eos=eos)  # no policy: the server keeps the weights it started with
    assert engine.info.weight_transfer == "covey_gloo" and not engine.exact_logprobs
    colocated.push_policy(policy)
    served, local = (e.generate(prompts, 4, SAMPLED, seed=5) for e in (engine, colocated))
    assert completions(served) == completions(local)  # one request per prompt, each with its own seed
    assert torch.allclose(served.sampling_logp_BT, local.sampling_logp_BT, atol=1e-4)
    gap = largest_logprob_gap(policy, prompts, served, num_generations=4)
    assert gap < 1e-3, f"the server's float32 log-probs differ from the trainer's by up to {gap:.3g}"
    assert_greedy_of(policy, prompts, engine.generate(prompts, 1, GREEDY), eos)


def test_weights_pushed_to_the_server_take_effect(vllm_server, policy, prompts, default_tokenizer):
    eos = [default_tokenizer.eos_token_id]
    before = completions(vllm_server.engine(eos=eos).generate(prompts, 1, GREEDY))
    groups = vllm_server.requests("/init_weight_transfer_engine")
    engine = vllm_server.engine(policy=perturbed(policy), eos=eos)
    after = engine.generate(prompts, 1, GREEDY)  # the policy is pushed first
    assert completions(after) != before, "the perturbation did not change any greedy completion"
    assert_greedy_of(policy, prompts, after, eos)
    held = engine.api.get("/weight_info")["weight_version"]
    assert held == engine.pushed_version and held.endswith("-1")
    lora = trained_lora(policy, ["q_proj", "v_proj"])  # a second push, through the same group
    engine.policy_changed(lora)
    assert_greedy_of(lora, prompts, engine.generate(prompts, 1, GREEDY), eos)
    assert engine.api.get("/weight_info")["weight_version"].endswith("-2")
    assert vllm_server.requests("/init_weight_transfer_engine") == groups + 1


def _train_against(rank: int, port: int, server_port: int, model_folder: str, output_dir: str, results: str) -> None:
    as_launched(rank, port)
    torch.set_num_threads(1)
    args = GRPOConfig.demo(model=model_folder, output_dir=output_dir, rollout_engine="vllm", vllm_mode="server",
                      vllm_server_port=server_port, vllm_server_timeout=60, max_steps=2, num_generations=4,
                      per_device_train_batch_size=4, max_completion_length=16, learning_rate=1e-4, beta=0.0,
                      eval_max_samples=2, seed=1, log_completions=False)
    trainer = GRPOTrainer(args=args, quiet=True)
    trainer.train()
    torch.save(trainer.engine.pushed_version, f"{results}-{rank}.pt")
    torch.distributed.destroy_process_group()


def test_two_training_processes_share_the_server_and_the_first_keeps_it_up_to_date(vllm_server, model_folder, tmp_path,
                                                                                    prompts, default_tokenizer):
    groups, updates = vllm_server.requests("/init_weight_transfer_engine"), vllm_server.requests("/start_weight_update")
    results = str(tmp_path / "pushed")
    run_in_two_processes(_train_against, (free_port(), vllm_server.port, model_folder, str(tmp_path / "run"), results),
                         seconds=900)
    first, second = (torch.load(f"{results}-{rank}.pt") for rank in (0, 1))
    assert first == second  # the second process was told of each push the first made
    assert vllm_server.requests("/init_weight_transfer_engine") == groups + 1  # one process opened a group
    # the start-up evaluation, the second step's round and the last evaluation: one push each
    assert vllm_server.requests("/start_weight_update") == updates + 3
    engine = vllm_server.engine(eos=[default_tokenizer.eos_token_id])
    assert engine.api.get("/weight_info")["weight_version"] == first
    trained = load_policy(str(tmp_path / "run" / "final_model")).eval()
    assert_greedy_of(trained, prompts, engine.generate(prompts, 1, GREEDY), [default_tokenizer.eos_token_id])


def test_an_async_run_pushes_each_round_s_weights_and_leaves_the_server_holding_the_trained_policy(
        vllm_server, model_folder, tmp_path, prompts, default_tokenizer):
    """async_generation against vLLM's server: the worker pushes, before each round, the weights its
    schedule names (one round behind: rounds 0 and 1 both from the start, so one push for the two); the
    evaluation after training samples with the trained policy."""
    updates = vllm_server.requests("/start_weight_update")
    args = GRPOConfig.demo(model=model_folder, output_dir=str(tmp_path / "run"), rollout_engine="vllm", vllm_mode="server",
                      vllm_server_port=vllm_server.port, vllm_server_timeout=60, max_steps=3, num_generations=4,
                      per_device_train_batch_size=4, max_completion_length=16, learning_rate=1e-4, beta=0.0,
                      eval_max_samples=2, seed=1, log_completions=False, async_generation=True)
    trainer = GRPOTrainer(args=args, quiet=True)
    trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["async/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    # the evaluation before training, rounds 0-1, round 2 (after one round trained), the evaluation after
    assert vllm_server.requests("/start_weight_update") == updates + 4
    engine = vllm_server.engine(eos=[default_tokenizer.eos_token_id])
    assert engine.api.get("/weight_info")["weight_version"] == trainer.engine.pushed_version
    trained = load_policy(str(tmp_path / "run" / "final_model")).eval()
    assert_greedy_of(trained, prompts, engine.generate(prompts, 1, GREEDY), [default_tokenizer.eos_token_id])


def test_a_push_that_fails_midway_is_never_sampled_from_and_a_server_that_dies_is_reported(
        vllm_server, policy, prompts, monkeypatch):
    import covey.rollout.weight_transfer as weight_transfer

    # the server's workers wait this long for the rest of a push (vLLM answers nothing else meanwhile)
    monkeypatch.setattr(weight_transfer, "GROUP_TIMEOUT_S", 15.0)
    engine = vllm_server.engine(policy=policy)
    engine.generate(prompts[:1], 1, GREEDY)  # pushed whole, over a group of its own
    send = weight_transfer.send

    def half_then_gone(group, weights):
        send(group, weights[: len(weights) // 2])
        raise OSError("the trainer's link went down")

    monkeypatch.setattr(weight_transfer, "send", half_then_gone)
    engine.policy_changed(perturbed(policy))
    with pytest.raises(ModelError, match="failed midway .*the trainer's link went down.*left paused, holding a partly "
                                         "updated model named covey-.*-2-incomplete"):
        engine.generate(prompts, 1, GREEDY)
    with pytest.raises(ModelError, match="holds a partly updated model .*Restart the server"):
        vllm_server.engine(eos=[2]).generate(prompts, 1, GREEDY)  # another trainer is told too
    vllm_server.kill()
    with pytest.raises(ModelError, match="lost the server at http://127.0.0.1:.* is it still running"):
        engine.generate(prompts, 1, SamplingParams(max_new_tokens=4))
    with pytest.raises(ConfigError, match="no server answered at .* within 2 s"):
        vllm_server.engine(timeout=2)
