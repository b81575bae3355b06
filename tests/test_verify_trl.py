"""covey verify --trl: the stage checks on a TRL GRPOTrainer, a clean pipeline and defects planted one at
a time in TRL's own functions and in user code, each caught at its own stage."""

import copy
import inspect
import os
import textwrap

import pytest
import torch

from tests.conftest import make_model, make_tokenizer

trl = pytest.importorskip("trl")
import trl.trainer.grpo_trainer as trl_grpo  # noqa: E402

from trl.chat_template_utils import parse_response as trl_parse_response  # noqa: E402

from covey import core  # noqa: E402
from covey.verify.trl import verify_trl  # noqa: E402


def text(completion):  # a conversational completion is [{"role": "assistant", "content": ...}]
    return completion[-1]["content"] if isinstance(completion, list) else completion


def accuracy(completions, answer, **kwargs):
    return [float(a in text(c)) for c, a in zip(completions, answer)]


def brevity(completions, **kwargs):
    return [-len(text(c)) / 100 for c in completions]


def reasoning_template():
    """A response template (transformers' format, as TRL's for Qwen3) that parses a completion into the
    reasoning in <think> and the answer after it, for the chat template of the test tokenizer."""
    return {"defaults": {"role": "assistant"}, "start_anchor": "<s>assistant\n",
            "fields": {"reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
                       "content": {"close_pattern": r"</s>\s*", "content": "text"}}}


def parses_with_template() -> bool:
    """Whether the installed TRL parses chat completions with the tokenizer's response template (1.16 does;
    releases before 1.7.1 read only the legacy response_schema, which transformers 5.24 no longer has)."""
    return "response_template" in inspect.getsource(trl_grpo)


def trl_trainer(tmp_path, reward_funcs=(accuracy, brevity), beta=0.04, loss_type="dapo", reasoning=False):
    """A TRL pipeline on a tiny model; with ``reasoning``, a chat dataset whose completions TRL parses with a
    response template into the answer and the reasoning apart."""
    from datasets import Dataset

    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer), seed=1).train()
    questions = ["what is 2+2?", "what is 3+3?"]
    if reasoning:
        tokenizer.response_template = reasoning_template()
        questions = [[{"role": "user", "content": q}] for q in questions]
    rows = Dataset.from_dict({"prompt": questions, "answer": ["4", "6"]})
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=16, report_to=[], use_cpu=True, beta=0.0, loss_type=loss_type,
                          logging_steps=1, bf16=False, reward_weights=[1.0, 0.5][:len(reward_funcs)])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=list(reward_funcs), args=args, train_dataset=rows,
                              processing_class=tokenizer)
    if beta:  # a reference model of our own (TRL would load one from the hub by the model's name)
        trainer.beta, trainer.ref_model = beta, copy.deepcopy(model).eval()
    return trainer


def failing(report):
    return sorted({c.stage for c in report.checks if c.status == "FAIL"})


def plant(monkeypatch, name, old, new):
    """A defect in the installed TRL: GRPOTrainer.<name> rebuilt from its source with ``old`` -> ``new``."""
    source = textwrap.dedent(inspect.getsource(getattr(trl_grpo.GRPOTrainer, name)))
    if old not in source and os.environ.get("COVEY_TRL_SWEEP"):  # tests/trl_versions.sh: other releases
        pytest.skip(f"{old!r} is not in GRPOTrainer.{name} of TRL {trl.__version__}: this defect is not planted")
    assert old in source, f"{old!r} is not in GRPOTrainer.{name} of this TRL"
    namespace = {}
    exec(compile(source.replace(old, new), trl_grpo.__file__, "exec"), trl_grpo.__dict__, namespace)
    monkeypatch.setattr(trl_grpo.GRPOTrainer, name, namespace[name])


@pytest.mark.parametrize("reasoning", [False, True], ids=["plain decode", "reasoning parsed apart"])
def test_a_clean_trl_pipeline_passes_every_stage(tmp_path, reasoning):
    report = verify_trl(trl_trainer(tmp_path, reasoning=reasoning))
    assert failing(report) == [], [(c.stage, c.name, c.value) for c in report.checks if c.status != "PASS"]
    assert {c.stage for c in report.checks} >= {"data", "decode", "rewards", "advantages", "logprobs", "loss",
                                                 "direction"}
    decode = [c.name for c in report.checks if c.stage == "decode"]
    parsed = reasoning and (parses_with_template() or not os.environ.get("COVEY_TRL_SWEEP"))
    assert len(decode) == 3 and all(("response template" in name) == parsed for name in decode), decode
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written


def shifted(completions, answer, **kwargs):  # user code: the values of the row before
    values = [float(a in c) for c, a in zip(completions, answer)]
    return values[-1:] + values[:-1]


def always_one(completions, **kwargs):
    return [1.0] * len(completions)


BLANKING = ("completions = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)",
            "completions = [c if '<think>' in c else '' for c in "
            "self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)]")


def keeping_the_reasoning(tokenizer, ids, *args, **kwargs):  # the whole text as the answer
    return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


def blanking_plain_answers(tokenizer, ids, *args, **kwargs):  # no reasoning tags: no answer
    parsed = trl_parse_response(tokenizer, ids, *args, **kwargs)
    return parsed if "reasoning_content" in parsed else {**parsed, "content": ""}


@pytest.mark.parametrize("decoder", [keeping_the_reasoning, blanking_plain_answers])
def test_a_reasoning_aware_decoder_that_hands_over_the_wrong_text_is_caught_at_decode(tmp_path, monkeypatch,
                                                                                      decoder):
    if not parses_with_template() and os.environ.get("COVEY_TRL_SWEEP"):  # tests/trl_versions.sh
        pytest.skip(f"TRL {trl.__version__} does not parse completions with a response template")
    monkeypatch.setattr(trl_grpo, "parse_response", decoder)
    report = verify_trl(trl_trainer(tmp_path, reasoning=True))
    assert report.first_failure == "decode", [(c.stage, c.name, c.value) for c in report.checks if c.status == "FAIL"]


@pytest.mark.parametrize("defect, stage", [
    ("reversed log-softmax", "logprobs"),
    ("advantage epsilon 1e4", "advantages"),
    ("decoder blanks plain answers", "decode"),
    ("flipped advantage sign", "advantages"),
    ("KL sign flipped", "loss"),
    ("padding in the loss mask", "logprobs"),
    ("rewards shifted by one", "rewards"),
    ("a reward of 1.0 for everything", "rewards"),
])
def test_each_planted_defect_is_caught_at_its_own_stage(tmp_path, monkeypatch, defect, stage):
    funcs = (accuracy, brevity)
    if defect == "reversed log-softmax":  # log p = logsumexp - logit instead of logit - logsumexp
        original = trl_grpo.GRPOTrainer._get_per_token_logps_and_entropies

        def reversed_operands(self, *args, **kwargs):
            logps, *rest = original(self, *args, **kwargs)
            return (-logps, *rest)
        monkeypatch.setattr(trl_grpo.GRPOTrainer, "_get_per_token_logps_and_entropies", reversed_operands)
    elif defect == "advantage epsilon 1e4":
        plant(monkeypatch, "_generate_and_score_completions", "std_rewards + 1e-4", "std_rewards + 1e4")
    elif defect == "decoder blanks plain answers":
        plant(monkeypatch, "_generate", *BLANKING)
    elif defect == "flipped advantage sign":
        plant(monkeypatch, "_generate_and_score_completions", "advantages = rewards - mean_grouped_rewards",
              "advantages = mean_grouped_rewards - rewards")
    elif defect == "KL sign flipped":
        plant(monkeypatch, "_compute_loss", "per_token_loss + self.beta * per_token_kl",
              "per_token_loss - self.beta * per_token_kl")
    elif defect == "padding in the loss mask":
        plant(monkeypatch, "_generate_and_score_completions", "completion_mask, padding_value=0,",
              "completion_mask, padding_value=1,")
    elif defect == "rewards shifted by one":
        funcs = (shifted, brevity)
    else:
        funcs = (always_one, brevity)
    report = verify_trl(trl_trainer(tmp_path, reward_funcs=funcs))
    assert report.first_failure == stage, [(c.stage, c.name, c.value) for c in report.checks if c.status == "FAIL"]


def test_several_defects_at_once_are_each_reported(tmp_path, monkeypatch):
    plant(monkeypatch, "_generate_and_score_completions", "std_rewards + 1e-4", "std_rewards + 1e4")
    plant(monkeypatch, "_compute_loss", "per_token_loss + self.beta * per_token_kl",
          "per_token_loss - self.beta * per_token_kl")
    report = verify_trl(trl_trainer(tmp_path, reward_funcs=(shifted, brevity)))
    assert {"rewards", "advantages", "loss"} <= set(failing(report))
    assert report.first_failure == "rewards"


SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import trl
from tests.test_verify_trl import accuracy, brevity
from tests.conftest import make_model, make_tokenizer
from datasets import Dataset

tokenizer = make_tokenizer()
rows = Dataset.from_dict({{"prompt": ["what is 2+2?", "what is 3+3?"], "answer": ["4", "6"]}})
args = trl.GRPOConfig(output_dir=sys.argv[1], per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=16, report_to=[], use_cpu=True, reward_weights=[1.0, 0.5])
trainer = trl.GRPOTrainer(model=make_model(len(tokenizer), seed=1), reward_funcs=[accuracy, brevity], args=args,
                          train_dataset=rows, processing_class=tokenizer)
trainer.train()
raise SystemExit("trained, which covey verify --trl must not let happen")
"""


def test_covey_verify_trl_runs_the_script_up_to_train_and_checks_its_trainer(tmp_path, capsys):
    from pathlib import Path

    from covey.cli import main

    script = tmp_path / "train_grpo.py"
    script.write_text(SCRIPT.format(root=str(Path(__file__).parent.parent)))
    assert main(["verify", "--trl", str(script), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "every stage passed" in out and "direction" in out
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    with pytest.raises(FileNotFoundError, match="is not a file; give the path of your TRL training script"):
        main(["verify", "--trl", str(tmp_path / "missing.py")])


def broken(completions, **kwargs):
    raise KeyError("score")


def test_an_error_in_the_scoring_path_names_its_stage_and_place(tmp_path, monkeypatch):
    report = verify_trl(trl_trainer(tmp_path, reward_funcs=(accuracy, broken)))
    failure = next(c for c in report.checks if c.status == "FAIL")
    assert report.first_failure == "rewards" and "in broken" in failure.value and "test_verify_trl.py" in failure.value

    def no_kernel(self, *args, **kwargs):  # as TRL 1.15 without Triton: its fused log-prob kernel is None
        return None.apply()
    monkeypatch.setattr(trl_grpo.GRPOTrainer, "_get_per_token_logps_and_entropies", no_kernel)
    report = verify_trl(trl_trainer(tmp_path, beta=0.0))
    assert report.first_failure == "logprobs", [(c.stage, c.value) for c in report.checks if c.status == "FAIL"]


def reward_model(vocab_size: int):
    """A sequence classifier with one label, as TRL takes for a reward model."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    return LlamaForSequenceClassification(config).eval()


class RowsShifted(torch.nn.Module):
    """A reward model whose scores come back one row late (as a batch put together in the wrong order)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        out = self.model(**inputs)
        out.logits = out.logits.roll(1, 0)
        return out


@pytest.mark.parametrize("defect", [None, "scores shifted by one row"])
def test_a_reward_model_is_scored_row_by_row_through_trl(tmp_path, defect):
    trainer = trl_trainer(tmp_path, reward_funcs=(accuracy, brevity))
    model = reward_model(len(trainer.processing_class))
    trainer.reward_funcs.append(RowsShifted(model) if defect else model)
    trainer.reward_processing_classes.append(trainer.processing_class)
    trainer.reward_func_names.append("tiny-reward-model")
    trainer.reward_weights = torch.tensor([1.0, 0.5, 1.0])
    trainer.args.reward_weights = [1.0, 0.5, 1.0]
    report = verify_trl(trainer)
    checks = {c.name: c.status for c in report.checks if "tiny-reward-model" in c.name}
    assert checks["tiny-reward-model is not constant"] == "PASS"
    lined_up = checks["tiny-reward-model: each value is its own completion's"]
    assert lined_up == ("FAIL" if defect else "PASS"), [(c.name, c.value) for c in report.checks]
    assert report.first_failure == ("rewards" if defect else None)


@pytest.mark.parametrize("loss_type", list(core.LOSS_TYPES))
def test_trls_loss_of_every_loss_type_of_the_registry_is_checked_against_its_formula(tmp_path, loss_type):
    report = verify_trl(trl_trainer(tmp_path, loss_type=loss_type))
    loss = [c for c in report.checks if c.stage == "loss" and c.name.startswith(f"TRL's {loss_type} loss")]
    assert [c.status for c in loss] == ["PASS", "PASS"], [(c.name, c.value) for c in loss]
