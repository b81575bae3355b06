"""FSDP2 (fsdp: full_shard) over two CPU processes (gloo), on a tiny random Llama: the same updates as
one process on the whole batch, checkpoints of shards that resume at another number of processes, and a
final model written whole."""

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.test_distributed import _metrics, train, train_in_two_processes


# under async_generation each process's worker samples from a whole copy of its own, one round behind
@pytest.mark.parametrize("overrides", [{}, {"async_generation": True}])
def test_fsdp_makes_the_update_one_process_makes_on_the_whole_batch(tmp_path, overrides):
    one = train(tmp_path / "one", 1, **overrides)["gradients"]
    two = [result["gradients"] for result in train_in_two_processes(tmp_path, fsdp="full_shard", **overrides)]
    assert len(one) == len(two[0]) == len(two[1]) == 2
    for step in range(2):
        for single, rank0, rank1 in zip(one[step], two[0][step], two[1][step]):
            assert torch.equal(rank0, rank1)
            assert torch.allclose(single, rank0, atol=1e-6, rtol=1e-4)
    one_metrics, two_metrics = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    for key in ("reward", "loss", "kl", "entropy", "grad_norm"):
        assert [m[key] for m in two_metrics] == pytest.approx([m[key] for m in one_metrics], rel=1e-4, abs=1e-7), key
    if overrides:
        assert [m["async/staleness"] for m in two_metrics] == [0, 1]
    one_final = load_file(tmp_path / "one" / "final_model" / "model.safetensors")
    two_final = load_file(tmp_path / "two" / "final_model" / "model.safetensors")
    assert one_final.keys() == two_final.keys(), one_final.keys() ^ two_final.keys()
    # the gradients above agree to float32 rounding (about 1e-9 here), not bit for bit: AdamW divides each by
    # its own size plus eps (1e-8), so a component near zero moves its weight by up to lr (1e-3) x its
    # rounding / eps; the weights agree to a hundredth of the learning rate
    for name in one_final:
        assert torch.allclose(one_final[name], two_final[name], atol=1e-5), name


def test_under_async_generation_the_workers_of_a_sharded_run_sample_with_the_whole_trained_weights(tmp_path):
    """Sampled by the fast engine over each worker's copy: round 3, sampled with the weights after step 1
    (gathered from the shards), is the round an unsharded run of two processes samples."""
    runs = {name: train_in_two_processes(tmp_path, run=name, sampled=True, async_generation=True, max_steps=3,
                                         **fields) for name, fields in (("ddp", {}), ("fsdp", {"fsdp": "full_shard"}))}
    texts = {name: [(c["step"], c["completion"]) for c in map(json.loads, (tmp_path / name / "completions.jsonl")
                                                              .read_text().splitlines())] for name in runs}
    assert 3 in {step for step, _ in texts["fsdp"]}  # logged at the first step and the last
    assert texts["fsdp"] == texts["ddp"]
    ddp, fsdp = _metrics(tmp_path / "ddp"), _metrics(tmp_path / "fsdp")
    assert [m["async/staleness"] for m in fsdp] == [0, 1, 1]
    assert [m["reward"] for m in fsdp] == pytest.approx([m["reward"] for m in ddp], rel=1e-6)


def _final_weights(run):
    return load_file(run / "final_model" / "model.safetensors")


@pytest.mark.parametrize("first, then, kind", [(2, 2, "FULL_STATE_DICT"), (2, 1, "SHARDED_STATE_DICT"),
                                               (1, 2, "SHARDED_STATE_DICT")])
def test_a_sharded_checkpoint_resumes_at_another_number_of_processes(tmp_path, first, then, kind):
    """Each process writes its own shards (torch.distributed.checkpoint); a run reads them and takes the
    steps the run never stopped would have (the same global batch of 2 prompts x 4): bit for bit at the
    same number of processes, to float32 rounding at another (the gradients are summed in another order)."""
    sharded = dict(fsdp="full_shard", max_steps=4, save_steps=2, fsdp_config={"state_dict_type": kind})
    straight = train_in_two_processes(tmp_path, run="straight", **sharded)
    run = tmp_path / "stopped"

    def part(processes, **overrides):
        settings = {**sharded, **overrides}
        if processes == 2:
            return train_in_two_processes(tmp_path, run="stopped", **settings)[0]
        return train(run, 1, **settings)

    part(first, max_steps=2)
    checkpoint = run / "checkpoints" / "checkpoint-2"
    assert (checkpoint / "sharded" / ".metadata").is_file()
    assert len(list((checkpoint / "sharded").glob("*.distcp"))) == first  # one file of shards per process
    # FULL_STATE_DICT: the model whole beside the shards, a folder that loads on its own
    assert (checkpoint / "model").exists() == (kind == "FULL_STATE_DICT")
    if kind == "FULL_STATE_DICT":
        assert load_file(checkpoint / "model" / "model.safetensors").keys() == _final_weights(tmp_path / "straight").keys()
    with pytest.warns(UserWarning, match="written by a run of") if then == 1 else contextlib.nullcontext():
        resumed = part(then, resume_from_checkpoint=str(checkpoint))
    assert len(resumed["gradients"]) == 2
    same = first == then
    for single, whole in zip(resumed["gradients"], straight[0]["gradients"][2:]):
        for a, b in zip(single, whole):
            assert torch.equal(a, b) if same else torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    final, expected = _final_weights(run), _final_weights(tmp_path / "straight")
    for name in expected:
        assert torch.equal(final[name], expected[name]) if same else \
            torch.allclose(final[name], expected[name], atol=1e-6), name


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


@pytest.mark.parametrize("settings, message", [
    ({"fsdp": "full_shard offload"}, "fsdp: 'offload' asks for offloading parameters to the CPU, which covey does not do"),
    ({"fsdp": "hybrid_shard"}, "hybrid sharding"),
    ({"fsdp": "fully_shard"}, "'fully_shard' is not an FSDP option"),
    ({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 1}}, "covey shards with FSDP2 only"),
    ({"fsdp": "full_shard", "fsdp_config": {"state_dict_type": "LOCAL_STATE_DICT"}}, "is not SHARDED_STATE_DICT or"),
    ({"fsdp": "full_shard", "fsdp_config": {"offload_params": True}}, "covey keeps the parameters on the device"),
    ({"fsdp": "full_shard", "fsdp_config": {"limit_all_gathers": True}}, "'limit_all_gathers' is not an FSDP option"),
    ({"fsdp": "full_shard", "fsdp_config": {"reshard_after_forward": "sometimes"}}, "is not true or false"),
    ({"fsdp_config": {"reshard_after_forward": True}}, "fsdp_config is given but fsdp is not set"),
    ({"fsdp": "full_shard", "shard_optimizer_state": True}, "fsdp shards it already"),
    ({"fsdp": "full_shard", "push_to_hub": True}, "hub_strategy: every_save pushes checkpoints"),
])
def test_what_covey_does_not_shard_is_refused_before_anything_loads(tmp_path, settings, message):
    from covey import GRPOConfig, GRPOTrainer
    from covey.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(model=str(tmp_path / "never-loaded"), reward_funcs=[lambda completions, **kw: [0.0]],
                    train_dataset=[{"prompt": "p"}], args=GRPOConfig(output_dir=str(tmp_path / "run"), **settings))


def test_trl_and_accelerate_name_the_sharding_covey_does():
    from covey import GRPOConfig
    from covey.errors import ConfigError
    from covey.train.sharding import Sharding

    assert GRPOConfig(fsdp=["full_shard", "auto_wrap"]).fsdp == "full_shard auto_wrap"  # TRL's list form
    assert Sharding.from_settings("", None, {}) is None
    assert Sharding.from_settings("full_shard auto_wrap", {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                                           "fsdp_version": 2}, {}) == \
        Sharding(True, ("LlamaDecoderLayer",))
    assert Sharding.from_settings("shard_grad_op", None, {}) == Sharding(False, None)
    # what `accelerate launch --config_file` passes from TRL's fsdp2.yaml (accelerate's defaults included)
    launched = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
                "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_OFFLOAD_PARAMS": "false",
                "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
                "FSDP_ACTIVATION_CHECKPOINTING": "false", "FSDP_MIN_NUM_PARAMS": "100000000",
                "FSDP_SYNC_MODULE_STATES": "true", "FSDP_USE_ORIG_PARAMS": "true", "FSDP_FORWARD_PREFETCH": "false"}
    with pytest.warns(UserWarning, match="covey loads the model in every process"):
        assert Sharding.from_settings("", None, launched) == Sharding(True, None, whole_model_in_checkpoints=True)
    quiet = {**launched, "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}
    assert Sharding.from_settings("", None, {**quiet, "FSDP_RESHARD_AFTER_FORWARD": "false"}) == Sharding(False, None)
    with pytest.raises(ConfigError, match="forward_prefetch='true' is not supported"):
        Sharding.from_settings("", None, {**quiet, "FSDP_FORWARD_PREFETCH": "true"})


def test_a_model_without_the_named_blocks_says_which_classes_it_has(tiny_model):
    from covey.errors import ConfigError
    from covey.train.forward import TrainingForward
    from covey.train.sharding import transformer_blocks

    assert len(transformer_blocks(TrainingForward(tiny_model), None)) == tiny_model.config.num_hidden_layers
    with pytest.raises(ConfigError, match="transformer_layer_cls_to_wrap to its decoder layer's class "
                                          r"\(LlamaDecoderLayer\)"):
        transformer_blocks(TrainingForward(tiny_model), ("GPT2Block",))


@pytest.mark.parametrize("overrides", [{"gradient_checkpointing": True}, {"bf16": True}])
def test_fsdp_with_checkpointed_layers_or_bfloat16_makes_one_process_update(tmp_path, overrides):
    """Checkpointed layers recompute their forward in the backward, gathering their parameters again: the
    same gradients. Under bf16 the gathered parameters are bfloat16 where one process computes under
    autocast from float32 weights: the same direction, to bfloat16's precision."""
    one = train(tmp_path / "one", 1, **overrides)["gradients"]
    two = train_in_two_processes(tmp_path, fsdp="full_shard", **overrides)[0]["gradients"]
    for step in range(2):
        for single, sharded in zip(one[step], two[step]):
            assert sharded.dtype == torch.float32  # reduced in float32
            if overrides.get("bf16"):
                cosine = torch.nn.functional.cosine_similarity(single.flatten(), sharded.flatten(), dim=0)
                assert cosine > 0.99 and torch.allclose(single.norm(), sharded.norm(), rtol=0.05)
            else:
                assert torch.allclose(single, sharded, atol=1e-6, rtol=1e-4)


def test_a_moving_reference_is_sharded_into_the_checkpoint_and_resumes_exactly(tmp_path):
    moving = dict(fsdp="full_shard", max_steps=4, save_steps=2, sync_ref_model=True, ref_model_sync_steps=1,
                  ref_model_mixup_alpha=0.5)
    straight = train_in_two_processes(tmp_path, run="straight", **moving)[0]
    train_in_two_processes(tmp_path, run="stopped", **{**moving, "max_steps": 2})
    checkpoint = tmp_path / "stopped" / "checkpoints" / "checkpoint-2"
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(checkpoint / "sharded")).read_metadata().state_dict_metadata
    assert any(key.startswith("reference.") for key in saved)
    resumed = train_in_two_processes(tmp_path, run="stopped", **{**moving, "resume_from_checkpoint": str(checkpoint)})[0]
    for mine, theirs in zip(resumed["gradients"], straight["gradients"][2:]):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))  # the KL term reads the moved reference
