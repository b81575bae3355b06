import dataclasses
import warnings

import pytest
import torch

from covey.cli import main
from covey.config import GRPOConfig
from covey.errors import ConfigError


def test_defaults_are_valid_and_every_field_has_help():
    cfg = GRPOConfig()
    for f in dataclasses.fields(cfg):
        assert f.metadata.get("help"), f.name
    assert cfg.generation_batch_size % cfg.num_generations == 0


def test_unknown_key_names_the_closest_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rte: 1e-5\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'learning_rte'.*did you mean 'learning_rate'"):
        GRPOConfig.from_yaml(path)


def test_batch_must_divide_by_num_generations():
    with pytest.raises(ConfigError, match="not divisible by num_generations=8"):
        GRPOConfig(per_device_train_batch_size=12, gradient_accumulation_steps=1, num_generations=8)
    GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_generations=8)


def test_yaml_values_are_typed_and_command_line_overrides_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-5\nmax_steps: 7\nuse_peft: true\nreward_weights: [1, 2]\nepsilon_high: 0.28\n")
    cfg = GRPOConfig.from_yaml(path, {"learning_rate": "2e-5"})
    assert cfg.learning_rate == 2e-5 and isinstance(cfg.learning_rate, float)
    assert cfg.max_steps == 7 and cfg.use_peft is True and cfg.reward_weights == [1.0, 2.0]
    assert cfg.epsilon_high == 0.28


def test_invalid_yaml_reports_line_and_column(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-5\nmax_steps: [1, 2\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line \d+, column \d+"):
        GRPOConfig.from_yaml(path)


@pytest.mark.parametrize("values, message", [
    ({"max_steps": "ten"}, "max_steps='ten' is not a valid int"),
    ({"max_steps": 2.5}, "is not a valid int"),
    ({"learning_rate": -1}, "learning_rate=-1.0 must be positive"),
    ({"loss_type": "ppo"}, "loss_type='ppo' is not one of grpo, bnpo, dr_grpo, dapo"),
    ({"num_generations": 1, "per_device_train_batch_size": 1}, "at least 2"),
    ({"top_p": 1.5}, "top_p"),
    ({"use_peft": "maybe"}, "use_peft='maybe' is not a valid bool"),
    ({"loss_type": "cispo", "delta": 2.0}, "delta clips the PPO ratio, which loss_type: cispo does not use"),
    ({"loss_type": "cispo", "clip_ratio_c": 3.0}, "clip_ratio_c clips the PPO ratio"),
])
def test_bad_values_are_rejected_with_the_field_name(values, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**values)


def test_trl_style_scale_rewards_booleans_are_accepted():
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = GRPOConfig(learning_rate=3e-6, reward_weights=[0.5, 2.0], epsilon_high=0.28)
    cfg.save(tmp_path / "config.yaml")
    assert GRPOConfig.from_yaml(tmp_path / "config.yaml") == cfg


def test_help_lists_every_field_in_dash_case(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(GRPOConfig):
        assert "--" + f.name.replace("_", "-") in out


def test_cli_unknown_option_suggests_and_exits_before_loading(capsys):
    assert main(["train", "--learning-rat", "1e-5"]) == 2
    err = capsys.readouterr().err
    assert "unknown option --learning-rat" in err and "learning_rate" in err
    assert main(["train", "--lr", "1e-5"]) == 2
    assert "unknown option --lr (covey's name for it: learning_rate)" in capsys.readouterr().err


def test_cli_options_read_like_their_yaml():
    from covey.cli import _load_config, _parse_command

    def config(*argv):
        return _load_config(None, _parse_command("covey train", "", list(argv))[1])

    assert config("--stop-strings", "none").stop_strings is None  # an optional list can be unset
    assert config("--stop-strings", "</answer>", "none!").stop_strings == ["</answer>", "none!"]
    assert config("--report-to", "none").report_to == ["none"]  # a list that cannot be None keeps the word
    assert config("--rollout-bf16").rollout_bf16 is True  # an optional bool is a flag like the others
    assert config("--learning_rate", "3e-6", "--model_name_or_path", "m").learning_rate == 3e-6  # TRL's spellings
    assert config("--model-name-or-path", "some/model").model == "some/model"
    assert config("--rollout-bf16", "false").rollout_bf16 is False
    assert config("--scale-rewards", "false").scale_rewards == "none"  # TRL's booleans, as in YAML
    assert config("--scale-rewards", "true").scale_rewards == "group"
    # negative numbers in any notation are values, not options
    assert config("--reward-weights", "1", "-1e-3", "-.5").reward_weights == [1.0, -0.001, -0.5]


def test_a_bare_flag_before_the_config_file_leaves_the_file_as_the_config(tmp_path):
    from covey.cli import _parse_command

    (tmp_path / "run.yaml").write_text("max_steps: 3\n")
    namespace, overrides = _parse_command("covey train", "", ["--use-peft", str(tmp_path / "run.yaml")])
    assert namespace.config == str(tmp_path / "run.yaml") and overrides == {"use_peft": "true"}
    namespace, overrides = _parse_command("covey eval", "", ["--bf16", str(tmp_path)])  # a run folder
    assert namespace.config == str(tmp_path) and overrides == {"bf16": "true"}


def test_a_yaml_key_given_twice_is_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 1.0e-5\nmax_steps: 3\nlearning_rate: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line 3, column 1: 'learning_rate' is given twice "
                                          r"\(first at line 1\)"):
        GRPOConfig.from_yaml(path)
    path.write_text("base: &base {max_steps: 3}\n")  # an anchor's key is not a config key: an error as before
    with pytest.raises(ConfigError, match="base"):
        GRPOConfig.from_yaml(path)
    path.write_text("<<: {max_steps: 3, learning_rate: 1.0e-3}\nlearning_rate: 2.0e-3\n")  # a merge is no repeat
    assert (GRPOConfig.from_yaml(path).max_steps, GRPOConfig.from_yaml(path).learning_rate) == (3, 2e-3)
    path.write_text("? [1, 2]\n: x\n")  # an unhashable key: YAML's own error, with its place
    with pytest.raises(ConfigError, match="invalid YAML"):
        GRPOConfig.from_yaml(path)


def test_cli_bad_divisibility_is_one_line_error(capsys):
    assert main(["train", "--per-device-train-batch-size", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "num_generations" in err


@pytest.mark.parametrize("values", [
    {"steps_per_generation": -2}, {"lora_r": -1}, {"lora_alpha": 0}, {"lora_dropout": 3}, {"adam_beta1": 5},
    {"adam_epsilon": -1}, {"weight_decay": -1}, {"vllm_server_port": -5}, {"vllm_server_timeout": -1},
    {"overlong_max_length": -3}, {"overlong_cache_length": 0}, {"vllm_importance_sampling_clip_min": -2},
    {"save_steps": -1}, {"save_total_limit": 0}, {"reward_num_workers": -1}, {"report_to": ["tensorbored"]},
    {"logprob_budget_mib": 0},
])
def test_out_of_range_values_are_rejected_naming_the_field(values):
    (name, value), = values.items()
    with pytest.raises(ConfigError, match=name):
        GRPOConfig(**values)


def test_the_log_prob_budget_holds_a_micro_batch_s_logits_where_a_quarter_of_the_free_memory_does():
    from covey.core import LOGPROB_CHUNK_BYTES

    config = GRPOConfig(per_device_train_batch_size=2, num_generations=2, max_completion_length=511)  # head: 2 x 512
    whole = 2 * 512 * 151936 * 4  # 622 MB of float32 logits
    assert config.logprob_budget_bytes(151936, 4 * whole) == whole
    assert config.logprob_budget_bytes(151936, 4 * whole - 1) == LOGPROB_CHUNK_BYTES  # no room: the default's chunks
    assert config.logprob_budget_bytes(151936, None) == LOGPROB_CHUNK_BYTES  # the free memory not known
    assert config.logprob_budget_bytes(1000, 10**12) == LOGPROB_CHUNK_BYTES  # a micro-batch within one chunk
    asked = GRPOConfig(per_device_train_batch_size=2, num_generations=2, max_completion_length=511,
                       logprob_budget_mib=64)
    assert asked.logprob_budget_bytes(151936, 10**12) == 64 * 2**20  # the user's, whatever the room


def test_use_vllm_given_as_text_is_read_as_a_bool():
    assert GRPOConfig(use_vllm="false").rollout_engine == "fast"
    assert GRPOConfig(use_vllm="true").rollout_engine == "vllm"


def test_sampling_dtype_follows_rollout_bf16_then_bf16_then_the_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not GRPOConfig().sample_in_bf16(cpu) and GRPOConfig().sample_in_bf16(cuda)
    assert GRPOConfig(bf16=True).sample_in_bf16(cpu)
    assert GRPOConfig(rollout_bf16=True).sample_in_bf16(cpu)
    assert not GRPOConfig(rollout_bf16=False, bf16=True).sample_in_bf16(cuda)


def test_a_cispo_cap_below_one_is_warned_of():
    """CISPO caps the weight at epsilon_high itself, as TRL: a PPO-sized value there cuts every weight."""
    with pytest.warns(UserWarning, match=r"caps each token's weight at epsilon_high=0.28 itself \(as TRL does\)"):
        GRPOConfig(loss_type="cispo", epsilon_high=0.28)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(loss_type="cispo", epsilon_high=5.0)


def test_every_problem_of_a_config_is_said_at_once(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("lr: 1e-5\nnum_generation: 8\nbeta: warm\noptim: sgd\nloss_type: nope\n"
                      "max_steps: 10\n")
    with pytest.raises(ConfigError) as caught:
        GRPOConfig.from_yaml(config)
    message = str(caught.value)
    assert message.startswith(f"{config}: 5 problems:\n- ")
    for part in ("unknown config key 'lr' (covey's name for it: learning_rate)",
                 "unknown config key 'num_generation' (did you mean 'num_generations'?)",
                 "optim: 'sgd' is a TRL setting covey does not support (covey works as optim: 'adamw_torch_fused' or",
                 "beta='warm' is not a valid float", "loss_type='nope' is not one of"):
        assert part in message, part
    with pytest.raises(ConfigError) as caught:  # the range checks, all of them too
        GRPOConfig(num_generations=1, top_entropy_quantile=2.0)
    problems = caught.value.problems
    assert "num_generations=1: a group needs at least 2 completions" in problems
    assert "top_entropy_quantile=2.0 must be in (0, 1]" in problems


def test_trl_model_and_script_arguments_name_covey_fields(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text("model_name_or_path: some/model\ndataset_name: some/dataset\ndataset_train_split: train[:90%]\n"
                      "lora_task_type: CAUSAL_LM\nmodel_revision: main\nuse_peft: true\nlora_r: 8\n")
    args = GRPOConfig.from_yaml(config)
    assert (args.model, args.dataset, args.dataset_split, args.use_peft, args.lora_r) == (
        "some/model", "some/dataset", "train[:90%]", True, 8)
    with pytest.raises(ConfigError, match="model_name_or_path='a' and model='b' name the same setting"):
        GRPOConfig.from_dict({"model_name_or_path": "a", "model": "b"})
    with pytest.raises(ConfigError, match="lora_task_type: 'SEQ_CLS' is a TRL setting covey does not support"):
        GRPOConfig.from_dict({"lora_task_type": "SEQ_CLS"})


def test_trl_s_generation_batch_size_and_server_url_are_covey_s_settings(monkeypatch):
    config = GRPOConfig.from_dict({"generation_batch_size": 64, "per_device_train_batch_size": 16})
    assert config.steps_per_generation == 4 and config.generation_batch_size == 64
    monkeypatch.setenv("WORLD_SIZE", "2")  # TRL's generation batch counts every process's completions
    assert GRPOConfig.from_dict({"generation_batch_size": 64, "per_device_train_batch_size": 16}
                                ).steps_per_generation == 2
    monkeypatch.delenv("WORLD_SIZE")
    config = GRPOConfig.from_dict({"vllm_server_base_url": "http://10.0.0.2:8001", "vllm_mode": "server"})
    assert (config.vllm_server_host, config.vllm_server_port) == ("10.0.0.2", 8001)
    with pytest.raises(ConfigError) as e:
        GRPOConfig.from_dict({"generation_batch_size": 20, "per_device_train_batch_size": 16,
                              "vllm_server_base_url": "https://host/v1"})
    assert "generation_batch_size=20 must be a multiple of per_device_train_batch_size * processes = 16 * 1" in str(
        e.value)
    assert "covey reaches a server as http://HOST:PORT" in str(e.value)


def test_training_arguments_at_trl_s_defaults_are_accepted_and_others_refused():
    config = GRPOConfig.from_dict({"dataloader_num_workers": 0, "deepspeed": None, "vllm_tensor_parallel_size": 1})
    assert config == GRPOConfig()  # each says what covey does anyway
    with pytest.raises(ConfigError, match="dataloader_drop_last: True is a TRL setting covey does not support"):
        GRPOConfig.from_dict({"dataloader_drop_last": True})  # it would leave prompts untrained

@pytest.mark.parametrize("values, message", [
    ({"loss_type": "sapo", "delta": 2.0}, "delta clips the PPO ratio, which loss_type: sapo does not use"),
    ({"loss_type": "sapo", "epsilon_high": 0.28}, "epsilon_high clips the PPO ratio, which loss_type: sapo"),
    ({"loss_type": "vespo", "clip_ratio_c": 3.0}, "clip_ratio_c clips the PPO ratio, which loss_type: vespo"),
    ({"loss_type": "sapo", "sapo_temperature_neg": 0.0}, "sapo_temperature_neg=0.0 must be positive"),
    ({"loss_type": "vespo", "vespo_k_neg": -1.0}, "vespo_k_neg=-1.0.* must be >= 0"),
    ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "importance_sampling_level: sequence has no meaning"),
    ({"loss_type": "vespo", "use_vllm": True}, "set vllm_importance_sampling_mode: token_truncate or token_mask"),
    ({"sapo_temperature_pos": 2.0}, "sapo_temperature_pos=2.0 has an effect only with loss_type: sapo"),
    ({"loss_type": "sapo", "vespo_lambda_pos": 1.0}, "vespo_lambda_pos=1.0 has an effect only with loss_type: vespo"),
    ({"entropy_target": 3.0}, "entropy_target=3.0 has an effect only with use_adaptive_entropy: true"),
    ({"entropy_coef": -0.1}, "entropy_coef=-0.1 must be >= 0"),
    ({"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min=0.5 and"),
    ({"use_adaptive_entropy": True, "entropy_coef_delta": 0.0}, "entropy_coef_delta=0.0 must be positive"),
    ({"off_policy_mask_threshold": -0.5}, "off_policy_mask_threshold=-0.5 must be positive"),
])
def test_the_newer_losses_and_controls_refuse_what_they_cannot_honour(values, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**values)


def test_the_newer_losses_and_controls_take_trl_names_and_defaults(tmp_path):
    TRLConfig = pytest.importorskip("trl", reason="trl is a dev dependency").GRPOConfig
    names = ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
             "vespo_lambda_neg", "off_policy_mask_threshold", "entropy_coef", "use_adaptive_entropy", "entropy_target",
             "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")
    theirs = {f.name: f.default for f in dataclasses.fields(TRLConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert {n: ours[n] for n in names} == {n: theirs[n] for n in names}
    config = tmp_path / "c.yaml"
    config.write_text("loss_type: vespo\nvespo_k_pos: 1.5\noff_policy_mask_threshold: 0.5\nentropy_coef: 0.01\n"
                      "use_adaptive_entropy: true\nentropy_target: 2.0\n")
    args = GRPOConfig.from_yaml(config)
    assert (args.vespo_k_pos, args.off_policy_mask_threshold, args.entropy_target) == (1.5, 0.5, 2.0)
    assert GRPOConfig(loss_type="sapo", sapo_temperature_pos=0.5).sapo_temperature_pos == 0.5


def test_every_rollout_engine_the_config_can_ask_for_is_one_covey_builds_and_each_is_reachable():
    """The config's rollout_engine and vllm_mode choices against covey.rollout.ENGINES, the one table of engines."""
    import types

    from covey.rollout import ENGINES
    from covey.train.setup import engine_name

    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(GRPOConfig) if f.name in ("rollout_engine", "vllm_mode")}
    asked = {engine_name(types.SimpleNamespace(rollout_engine=engine, vllm_mode=mode))
             for engine in choices["rollout_engine"] for mode in choices["vllm_mode"]}
    assert asked == set(ENGINES)


def test_where_core_has_a_default_for_a_setting_of_the_config_it_is_the_configs():
    """One default per setting: core's loss settings have none (the config owns them); the few defaults core
    keeps for the entropy bonus, the engine correction and the advantages are the config's own."""
    import inspect

    from covey import core

    c = GRPOConfig()
    bonus = core.EntropyBonus()
    assert (bonus.coef, bonus.adaptive, bonus.target, bonus.delta, bonus.coef_min, bonus.coef_max) == (
        c.entropy_coef, c.use_adaptive_entropy, c.entropy_target, c.entropy_coef_delta, c.entropy_coef_min,
        c.entropy_coef_max)
    assert core.EngineCorrection() == core.EngineCorrection.from_mode(
        c.vllm_importance_sampling_mode, c.vllm_importance_sampling_clip_max, c.vllm_importance_sampling_clip_min)
    for function in (core.group_advantages, core.advantages_from_rewards):
        assert inspect.signature(function).parameters["scale"].default == c.scale_rewards
    assert inspect.signature(core.advantages_from_rewards).parameters["aggregation"].default == c.multi_objective_aggregation
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(core.LossSettings))


def test_the_settings_are_the_config_fields_and_follow_without_checks():
    """RunSettings is what the config is made of (every field, the same defaults) and what the rules read;
    the sizes derived from the fields need no checking to be computed."""
    from covey.config_fields import RunSettings

    assert [f.name for f in dataclasses.fields(RunSettings)] == [f.name for f in dataclasses.fields(GRPOConfig)]
    assert issubclass(GRPOConfig, RunSettings)
    raw = RunSettings(per_device_train_batch_size=6, num_generations=4)  # 6 / 4 prompts: refused by the rules
    assert raw.generation_batch_size == 6 and raw.optimizer_steps_per_generation == 1
    with pytest.raises(ConfigError, match="num_generations"):
        GRPOConfig(per_device_train_batch_size=6, num_generations=4)
