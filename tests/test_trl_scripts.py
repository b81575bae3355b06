"""TRL's own scripts and defaults through covey: TRL's argument parser reads covey's GRPOConfig (and a
subclass of it), TRL's trainer arguments and TRL's own config objects are taken, GRPOConfig() has TRL's
defaults, inert TRL settings are accepted and the others still refused, streamed datasets train and
resume, covey's warnings reach TRL's logger once, and the README's hub id loads offline."""

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from covey import GRPOConfig, GRPOTrainer, trl_fields
from covey.config import DEMO
from covey.errors import ConfigError, DataError
from tests.test_trainer import ROWS, count_a

trl = pytest.importorskip("trl")

SIZES = dict(max_steps=2, num_generations=2, per_device_train_batch_size=4, max_completion_length=8,
             logging_steps=1, learning_rate=1e-3, lr_scheduler_type="constant", report_to="none")


def _run_script(script: Path, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd())})


def test_trl_s_own_grpo_script_runs_through_covey_with_only_its_imports_changed(tmp_path, tiny_model_dir):
    """trl/scripts/grpo.py as TRL ships it (what `trl grpo` runs): TrlParser over its script arguments,
    GRPOConfig, ModelConfig and DatasetMixtureConfig, a recipe file beside the command line,
    quantization_config=, peft_config=, trainer.accelerator.print and trainer.end() after training."""
    source = (Path(trl.__file__).parent / "scripts" / "grpo.py").read_text()
    changed = source.replace("from trl import GRPOTrainer, get_dataset",
                             "from covey import GRPOTrainer\n    from trl import get_dataset")
    changed = changed.replace("from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser",
                              "from trl import DatasetMixtureConfig, ModelConfig, TrlParser\n    from covey import GRPOConfig")
    assert changed.count("from covey import") == 2  # the two imports, and nothing else changed
    (tmp_path / "grpo.py").write_text(changed)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"say {i}"}]}) + "\n"
                                              for i in range(8)))
    recipe = {"model_name_or_path": str(tiny_model_dir), "dataset_name": str(data), "use_peft": True, "lora_r": 4,
              "lora_target_modules": ["q_proj", "v_proj"], "max_completion_length": 8, "num_generations": 2,
              "per_device_train_batch_size": 4, "report_to": "none", "use_cpu": True, "logging_steps": 1}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    done = _run_script(tmp_path / "grpo.py", ["--config", str(tmp_path / "recipe.yaml"), "--reward_funcs",
                                              "think_format_reward", "--max_steps", "2", "--output_dir",
                                              str(tmp_path / "run")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Training completed." in done.stdout  # trainer.accelerator.print, in the first process
    run = tmp_path / "run"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    adapter = json.loads((run / "final_model" / "adapter_config.json").read_text())
    assert (adapter["r"], sorted(adapter["target_modules"])) == (4, ["q_proj", "v_proj"])  # ModelConfig's LoRA


def trl_example(path: str) -> str:
    """A script of TRL's repository that TRL's package does not ship (its examples/), read from the TRL checkout
    named by COVEY_TRL_SOURCE (a work tree, or its git directory); the test skips without one."""
    source = os.environ.get("COVEY_TRL_SOURCE")
    if not source:
        pytest.skip(f"TRL's {path} is not in TRL's package: set COVEY_TRL_SOURCE to a TRL checkout to run it")
    if (Path(source) / path).is_file():
        return (Path(source) / path).read_text()
    shown = subprocess.run(["git", "--git-dir", source, "show", f"HEAD:{path}"], capture_output=True, text=True)
    assert shown.returncode == 0, f"COVEY_TRL_SOURCE={source} holds no {path}: {shown.stderr}"
    return shown.stdout


def test_trl_s_vision_example_runs_with_only_its_import_model_data_and_scale_changed(tmp_path):
    """examples/scripts/grpo_vlm.py: TrlParser, model_init_kwargs from ModelConfig, the model given by name (its
    processor loaded with it), a dataset mapped and filtered on its pictures, TRL's think_format_reward and
    accuracy_reward, peft_config=, trainer.save_model. On a tiny Idefics3 (SmolVLM's family: the script's SmolVLM2
    and Qwen2.5-VL need torchvision for their processors' video part), with a local dataset of pictures."""
    from datasets import Dataset, Image

    from tests.tiny_vision import image, saved

    source = trl_example("examples/scripts/grpo_vlm.py")
    changed = source.replace("from trl import (\n    GRPOConfig,\n    GRPOTrainer,\n",
                             "from covey import GRPOConfig, GRPOTrainer\nfrom trl import (\n")
    data = tmp_path / "pictures.parquet"
    changed = changed.replace('load_dataset("lmms-lab/multimodal-open-r1-8k-verified", split="train")',
                              f'load_dataset("parquet", data_files={str(data)!r}, split="train")')
    assert changed.count("from covey import") == 1 and changed.count(str(data)) == 1  # the import and the data only
    (tmp_path / "grpo_vlm.py").write_text(changed)
    # the script sets 100 rows apart for evaluation: 4 to train on
    rows = [{"problem": f"What is {i % 7} + 1?", "solution": f"${i % 7 + 1}$", "image": image(i)} for i in range(104)]
    Dataset.from_list(rows).cast_column("image", Image()).to_parquet(str(data))
    model = saved("idefics3", tmp_path / "tiny-smolvlm")
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, str(tmp_path / "grpo_vlm.py"), "--model_name_or_path", model, "--output_dir",
                           str(run), "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
                           "--max_completion_length", "8", "--learning_rate", "1e-5", "--logging_steps", "1",
                           "--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--log_completions",
                           "--report_to", "none"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
                              [str(Path(__file__).parent.parent / "src"), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert {"rewards/think_format_reward/mean", "rewards/accuracy_reward/mean"} <= metrics[0].keys()
    shown = [part["image"] for line in (run / "completions.jsonl").read_text().splitlines()
             for part in json.loads(line)["prompt"][1]["content"] if part["type"] == "image"]
    assert shown and all(label.startswith("image:") for label in shown)  # each prompt showed its picture
    assert json.loads((run / "final_model" / "adapter_config.json").read_text())["r"] > 0


def test_trl_s_parser_reads_covey_s_config_and_a_subclass_of_it():
    from trl import ModelConfig, ScriptArguments, TrlParser

    @dataclasses.dataclass
    class MyConfig(GRPOConfig):  # as projects built on TRL add their own fields
        judge_temperature: float = dataclasses.field(default=0.5, metadata={"help": "the judge's temperature"})

    parser = TrlParser((ScriptArguments, MyConfig, ModelConfig))
    script, training, model = parser.parse_args_and_config(
        ["--model_name_or_path", "m", "--dataset_name", "d", "--use_peft", "--lora_r", "4", "--learning_rate", "2e-5",
         "--max_steps", "3", "--judge_temperature", "0.9", "--report_to", "none", "--generation_kwargs",
         '{"presence_penalty": 0.5}'])
    assert isinstance(training, MyConfig) and training.judge_temperature == 0.9
    assert (training.learning_rate, training.max_steps, training.report_to) == (2e-5, 3, ["none"])
    assert training.generation_kwargs == {"presence_penalty": 0.5} and training.rollout_engine == "hf"
    assert (script.dataset_name, model.model_name_or_path, model.use_peft, model.lora_r) == ("d", "m", True, 4)
    assert training.fields_given >= {"learning_rate", "max_steps"} and "dataset" not in training.fields_given
    assert training.replace(beta=0.1).judge_temperature == 0.9  # a copy keeps the subclass's field
    with pytest.raises(ConfigError, match="num_generations=1: a group needs at least 2"):
        parser.parse_args_and_config(["--num_generations", "1"])  # covey's rules, through the parser too


def test_grpo_config_has_trl_s_defaults_but_the_listed_ones():
    from trl import GRPOConfig as TRLConfig

    ours = GRPOConfig()
    same_meaning = {"fsdp": ("", None), "report_to": (["none"], "none")}  # TRL's value, written covey's way
    differ = {}
    for f in dataclasses.fields(TRLConfig):
        if not hasattr(ours, f.name) or f.name in trl_fields.DEFAULTS_DIFFER or f.name in trl_fields.READ_AS:
            continue
        theirs = f.default_factory() if f.default is dataclasses.MISSING else f.default
        value = getattr(ours, f.name)
        if value != theirs and same_meaning.get(f.name) != (value, theirs):
            differ[f.name] = (value, theirs)
    assert not differ, f"GRPOConfig()'s defaults that differ from TRL's and are not listed: {differ}"
    docs = (Path(__file__).parent.parent / "docs" / "trl.md").read_text()
    section = docs.split("## Defaults that differ from TRL's", 1)[1].split("\n## ", 1)[0]
    assert {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")} == set(
        trl_fields.DEFAULTS_DIFFER)
    assert (ours.max_steps, ours.max_completion_length, ours.learning_rate) == (-1, 512, 1e-6)
    demo = GRPOConfig(**DEMO)  # the command line's preset keeps the demo's sizes
    assert (demo.max_steps, demo.max_completion_length, demo.logging_steps) == (30, 32, 1)


def test_the_command_line_without_a_config_file_runs_the_demo_preset_and_says_so(capsys):
    from covey.cli import _load_config

    args = _load_config(None, {"max_steps": 3})
    assert (args.max_steps, args.max_completion_length, args.dataset) == (3, 32, "arithmetic")
    err = capsys.readouterr().err
    assert "no config file: the demo preset" in err and "max_completion_length=32" in err
    assert "max_steps=30" not in err  # what the command line gave is not the preset's


def test_the_trainer_takes_trl_s_parameters_in_trl_s_order():
    from trl import GRPOTrainer as TRLTrainer

    theirs = list(inspect.signature(TRLTrainer.__init__).parameters)
    ours = list(inspect.signature(GRPOTrainer.__init__).parameters)
    assert ours[:len(theirs)] == theirs
    assert all(inspect.signature(GRPOTrainer.__init__).parameters[name].kind == inspect.Parameter.KEYWORD_ONLY
               for name in ours[len(theirs):])


def test_a_trl_config_object_is_read_field_by_field(tmp_path, tokenizer, tiny_model):
    from trl import GRPOConfig as TRLConfig

    @dataclasses.dataclass
    class Recipe(TRLConfig):
        judge: str = "strict"

    args = Recipe(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, **SIZES)
    args.chat_template_kwargs = {"enable_thinking": False}  # set after it was made, as TRL's scripts do
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=count_a, args=args, train_dataset=ROWS,
                          processing_class=tokenizer, quiet=True)
    assert isinstance(trainer.args, GRPOConfig) and trainer.args.judge == "strict"
    assert trainer.args.chat_template_kwargs == {"enable_thinking": False}
    assert (trainer.args.max_steps, trainer.args.gradient_checkpointing) == (2, True)  # TRL's default
    trainer.train()
    assert trainer.global_step == 2
    with pytest.raises(ConfigError) as caught:
        GRPOTrainer(model=tiny_model, reward_funcs=count_a, train_dataset=ROWS, processing_class=tokenizer,
                    args=TRLConfig(output_dir=str(tmp_path / "b"), use_cpu=True, optim="adafactor",
                                   dataloader_drop_last=True, **SIZES))
    assert len(caught.value.problems) == 2 and "optim: 'adafactor'" in str(caught.value), "\n".join(caught.value.problems)
    assert "dataloader_drop_last: True" in str(caught.value)


def test_settings_with_no_effect_are_accepted_and_those_with_one_still_refused():
    config = GRPOConfig(dataloader_num_workers=4, pad_to_multiple_of=8, dataloader_persistent_workers=True,
                        trackio_space_id="me/space", accelerator_config=dict(trl_fields.ACCELERATOR_DEFAULTS))
    assert (config.dataloader_num_workers, config.pad_to_multiple_of, config.trackio_space_id) == (4, 8, "me/space")
    with pytest.raises(ConfigError, match="trackio_space_id: 'me/space' is a TRL setting covey does not support "
                                          "while report_to includes trackio"):
        GRPOConfig(report_to="trackio", trackio_space_id="me/space")
    with pytest.raises(ConfigError, match="accelerator_config"):
        GRPOConfig(accelerator_config={**trl_fields.ACCELERATOR_DEFAULTS, "split_batches": True})
    with pytest.raises(ConfigError, match="dataloader_drop_last"):
        GRPOConfig(dataloader_drop_last=True)


def test_the_trainer_s_accelerator_answers_from_covey_s_process_group(tmp_path, tokenizer, tiny_model, capsys):
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=count_a, args=GRPOConfig(output_dir=str(tmp_path / "r"),
                          **SIZES), train_dataset=ROWS, processing_class=tokenizer, quiet=True)
    accelerator = trainer.accelerator
    assert (accelerator.process_index, accelerator.num_processes, accelerator.is_main_process) == (0, 1, True)
    assert accelerator.device == next(trainer.model.parameters()).device
    accelerator.print("from the first process")
    assert "from the first process" in capsys.readouterr().out
    accelerator.wait_for_everyone()  # one process: nothing to wait for
    assert torch.equal(accelerator.gather(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 2.0]))
    assert accelerator.gather(3.0).tolist() == [3.0]
    assert accelerator.unwrap_model(trainer.model) is trainer.model


def test_an_optimizer_of_the_user_s_own_trains_the_policy(tmp_path, tokenizer, tiny_model):
    sgd = torch.optim.SGD([p for p in tiny_model.parameters() if p.requires_grad], lr=0.5)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=count_a, args=GRPOConfig(output_dir=str(tmp_path / "r"),
                          **SIZES), train_dataset=ROWS, processing_class=tokenizer, optimizers=(sgd, None), quiet=True)
    assert trainer.optimizer is sgd
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    trainer.train()
    moved = [n for n, p in tiny_model.named_parameters() if not torch.equal(p, before[n])]
    assert moved and trainer.scheduler.optimizer is sgd  # covey's schedule over the user's optimizer
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="optimizers\\[0\\] holds parameters the policy does not train"):
        GRPOTrainer(model=tiny_model, reward_funcs=count_a, args=GRPOConfig(output_dir=str(tmp_path / "s"), **SIZES),
                    train_dataset=ROWS, processing_class=tokenizer, optimizers=(other, None), quiet=True)
    with pytest.raises(ConfigError, match="optimizers with fsdp|with fsdp"):
        GRPOTrainer(model=tiny_model, reward_funcs=count_a, train_dataset=ROWS, processing_class=tokenizer,
                    args=GRPOConfig(output_dir=str(tmp_path / "t"), fsdp="full_shard", **SIZES), optimizers=(sgd, None))


def test_a_bitsandbytes_config_is_read_as_covey_s_loading_fields():
    from transformers import BitsAndBytesConfig

    from covey.train.trainer import run_config

    args = run_config(GRPOConfig(use_peft=True), BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4",
                                                                    bnb_4bit_use_double_quant=True))
    assert (args.load_in_4bit, args.bnb_4bit_quant_type, args.use_bnb_nested_quant) == (True, "fp4", True)
    assert run_config(GRPOConfig(use_peft=True), None).load_in_4bit is False
    with pytest.raises(ConfigError, match="llm_int8_threshold=4.0"):
        run_config(GRPOConfig(use_peft=True), BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=4.0))


def _stream_run(tmp_path, name, tokenizer, dataset, steps, resume=None):
    from tests.conftest import make_model

    args = GRPOConfig(output_dir=str(tmp_path / name), save_steps=2, resume_from_checkpoint=resume,
                      **{**SIZES, "max_steps": steps})
    trainer = GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=count_a, args=args, train_dataset=dataset,
                          processing_class=tokenizer, quiet=True)
    trainer.train()
    return trainer, [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_a_streamed_dataset_trains_and_resumes_at_the_same_row(tmp_path, tokenizer):
    import datasets

    rows = [{"prompt": [{"role": "user", "content": f"say {i}"}], "answer": str(i)} for i in range(10)]
    stream = datasets.IterableDataset.from_generator(lambda: iter(rows))
    _, whole = _stream_run(tmp_path, "whole", tokenizer, stream, 6)  # 6 rounds of 2 prompts: a second pass
    _stream_run(tmp_path, "cut", tokenizer, stream, 2)
    trainer, resumed = _stream_run(tmp_path, "cut", tokenizer, stream, 6, resume="auto")
    keys = ("reward", "loss", "grad_norm", "completions/mean_length")
    assert [[m[k] for k in keys] for m in resumed] == [[m[k] for k in keys] for m in whole]
    assert trainer.prompt_sampler.position == 12 and trainer.parts.prompts.rows.stream.passes == 1
    with pytest.raises(ConfigError, match="set max_steps"):
        GRPOTrainer(model="unused", reward_funcs=count_a, train_dataset=stream, args=GRPOConfig(**{**SIZES,
                    "max_steps": -1}))


def test_a_stream_is_read_as_the_rounds_ask_never_whole(tmp_path, tokenizer):
    pulled = []

    def endless():
        i = 0
        while True:  # no end: a run must never try to read it whole
            pulled.append(i)
            yield {"prompt": [{"role": "user", "content": f"say {i % 7}"}]}
            i += 1

    trainer, metrics = _stream_run(tmp_path, "endless", tokenizer, endless(), 3)
    assert len(metrics) == 3 and len(pulled) < 3 * 64  # the rows of 3 rounds, a chunk at a time
    assert max(trainer.parts.prompts.rows.stream.held) < len(pulled)

    def short():
        yield from ({"prompt": f"say {i}"} for i in range(3))
    with pytest.raises(DataError, match="ended after 3 rows, and an iterator cannot be read again"):
        _stream_run(tmp_path, "short", tokenizer, short(), 3)


def test_covey_s_warnings_reach_trl_s_logger_once(tmp_path, tokenizer, tiny_model, caplog):
    args = GRPOConfig(output_dir=str(tmp_path / "r"), importance_sampling_level="sequence", loss_type="dapo", **SIZES)
    with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"):  # TRL's test: the warning at construction
        GRPOTrainer(model=tiny_model, reward_funcs=count_a, args=args, train_dataset=ROWS, processing_class=tokenizer,
                    quiet=True)
    assert "weights each sequence by its completion length" in caplog.text
    script = ("import logging, warnings; logging.basicConfig(); from covey.errors import warn; warn('said once')\n"
              "warnings.simplefilter('always')\n")
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert shown.stderr.count("said once") == 1, shown.stderr
    plain = subprocess.run([sys.executable, "-c", "from covey.errors import warn; warn('said once')"],
                           capture_output=True, text=True, timeout=120)
    assert plain.stderr.count("said once") == 1, plain.stderr


def test_the_readme_s_hub_id_is_the_embedded_model_where_the_hub_cannot_give_it(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from covey.models import embedded

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(embedded, "_hub_can_give", embedded._hub_can_give.__wrapped__)  # not a cached answer
    monkeypatch.setattr(embedded, "_say_embedded_copy", embedded._say_embedded_copy.__wrapped__)
    with pytest.warns(UserWarning, match="covey loads the copy it embeds"):
        folder = embedded.resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert folder == str(embedded.embedded_model_folder())
    assert embedded.resolve_model_path("HuggingFaceTB/SmolLM2-360M-Instruct") == "HuggingFaceTB/SmolLM2-360M-Instruct"
