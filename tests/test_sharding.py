"""FSDP2 (fsdp: full_shard) over two CPU processes (gloo), on a tiny random Llama: the same updates as
one process on the whole batch, checkpoints of shards that resume at another number of processes, and a
final model written whole."""

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.test_distributed import _metrics, train, train_in_two_processes


def test_fsdp_makes_the_update_one_process_makes_on_the_whole_batch(tmp_path):
    one = train(tmp_path / "one", 1)["gradients"]
    two = [result["gradients"] for result in train_in_two_processes(tmp_path, fsdp="full_shard")]
    assert len(one) == len(two[0]) == len(two[1]) == 2
    for step in range(2):
        for single, rank0, rank1 in zip(one[step], two[0][step], two[1][step]):
            assert torch.equal(rank0, rank1)
            assert torch.allclose(single, rank0, atol=1e-6, rtol=1e-4)
    one_metrics, two_metrics = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    for key in ("reward", "loss", "kl", "entropy", "grad_norm"):
        assert [m[key] for m in two_metrics] == pytest.approx([m[key] for m in one_metrics], rel=1e-4, abs=1e-7), key
    one_final = load_file(tmp_path / "one" / "final_model" / "model.safetensors")
    two_final = load_file(tmp_path / "two" / "final_model" / "model.safetensors")
    assert one_final.keys() == two_final.keys(), one_final.keys() ^ two_final.keys()
    for name in one_final:
        assert torch.allclose(one_final[name], two_final[name], atol=1e-6), name


def _final_weights(run):
    return load_file(run / "final_model" / "model.safetensors")


@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_a_sharded_checkpoint_resumes_at_another_number_of_processes(tmp_path, first, then):
    """Each process writes its own shards (torch.distributed.checkpoint); a run of another size reads them
    and takes the steps the run never stopped would have (the same global batch of 2 prompts x 4)."""
    sharded = dict(fsdp="full_shard", max_steps=4, save_steps=2)
    straight = train_in_two_processes(tmp_path, run="straight", **sharded)
    run = tmp_path / "stopped"

    def part(processes, **overrides):
        settings = {**sharded, **overrides}
        if processes == 2:
            return train_in_two_processes(tmp_path, run="stopped", **settings)[0]
        return train(run, 1, **settings)

    part(first, max_steps=2)
    checkpoint = run / "checkpoints" / "checkpoint-2"
    assert (checkpoint / "sharded" / ".metadata").is_file() and not (checkpoint / "model").exists()
    assert len(list((checkpoint / "sharded").glob("*.distcp"))) == first  # one file of shards per process
    with pytest.warns(UserWarning, match="written by a run of") if then == 1 else contextlib.nullcontext():
        resumed = part(then, resume_from_checkpoint=str(checkpoint))
    assert len(resumed["gradients"]) == 2
    for single, whole in zip(resumed["gradients"], straight[0]["gradients"][2:]):
        for a, b in zip(single, whole):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    final, expected = _final_weights(run), _final_weights(tmp_path / "straight")
    for name in expected:
        assert torch.allclose(final[name], expected[name], atol=1e-6), name


def test_fsdp_trains_a_lora_adapter_as_one_process_does(tmp_path):
    lora = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, learning_rate=1e-2)
    one = train(tmp_path / "one", 1, **lora)["gradients"]
    two = [result["gradients"] for result in train_in_two_processes(tmp_path, fsdp="full_shard", **lora)]
    assert len(one[0]) == len(two[0][0]) > 0 and all(g.dim() == 2 for g in one[0])  # the adapter's matrices only
    for step in range(2):
        for single, rank0, rank1 in zip(one[step], two[0][step], two[1][step]):
            assert torch.equal(rank0, rank1)
            assert torch.allclose(single, rank0, atol=1e-6, rtol=1e-4)
    one_adapter = load_file(tmp_path / "one" / "final_model" / "adapter_model.safetensors")
    two_adapter = load_file(tmp_path / "two" / "final_model" / "adapter_model.safetensors")
    assert one_adapter.keys() == two_adapter.keys()
    for name in one_adapter:
        assert torch.allclose(one_adapter[name], two_adapter[name], atol=1e-6), name


@pytest.mark.parametrize("overrides", [{}, {"use_peft": True, "lora_dropout": 0.0, "learning_rate": 1e-2}])
def test_the_fast_engine_samples_the_sharded_policy_as_data_parallel_processes_do(tmp_path, overrides):
    """Each process samples with the fast engine from a whole copy of the policy, refreshed from the shards
    before each round: the same completions as under DDP, where each process holds the policy whole."""
    settings = dict(sampled=True, max_steps=3, temperature=1.0, **overrides)
    train_in_two_processes(tmp_path, run="ddp", **settings)
    train_in_two_processes(tmp_path, run="fsdp", fsdp="full_shard", **settings)
    completions = {run: [(c["step"], c["completion"]) for c in map(json.loads, (tmp_path / run / "completions.jsonl")
                                                                  .read_text().splitlines())] for run in ("ddp", "fsdp")}
    assert len(completions["fsdp"]) == 16 and {step for step, _ in completions["fsdp"]} == {1, 3}  # first and last
    assert completions["fsdp"] == completions["ddp"]  # sampled after each update from the same weights
    ddp, fsdp = _metrics(tmp_path / "ddp"), _metrics(tmp_path / "fsdp")
    for key in ("reward", "loss", "grad_norm"):
        assert [m[key] for m in fsdp] == pytest.approx([m[key] for m in ddp], rel=1e-4, abs=1e-7), key
