"""Reward models in reward_funcs, as TRL takes them: a tiny sequence classifier built here, given by
folder and as an object, scored as its own forward scores the same text, and trained against."""

import json
import shutil

import pytest
import torch
import yaml

from covey import GRPOConfig, GRPOTrainer
from covey.errors import ConfigError, RewardError
from covey.rewards import RewardPool, load_reward_func, reward_name, reward_reference
from covey.rewards.reward_model import BATCH_SIZE
from tests.conftest import make_model, make_tokenizer

CHATS = [{"prompt": [{"role": "user", "content": f"say {c}"}]} for c in "abcd"]


def make_classifier(vocab_size: int, num_labels: int = 1, seed: int = 0):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         num_labels=num_labels, pad_token_id=0)
    return LlamaForSequenceClassification(config).eval()


@pytest.fixture
def classifier_dir(tmp_path, tokenizer):
    folder = tmp_path / "tiny-reward-model"
    make_classifier(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def own_scores(model, tokenizer, texts):
    """The model's own forward on each text alone (no padding): the score TRL takes, logits[:, 0]."""
    with torch.no_grad():
        return [model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts]


def test_a_reward_model_scores_each_text_as_its_own_forward_does(classifier_dir, tokenizer):
    by_folder = load_reward_func(str(classifier_dir))
    model = make_classifier(len(tokenizer))  # the same weights (same seed), handed over as an object
    by_object = load_reward_func(model, processing_class=make_tokenizer())
    count = BATCH_SIZE + 3  # over one batch, and of lengths that need padding
    prompts = [f"question {i}: " for i in range(count)]
    completions = ["x" * (1 + 3 * i % 11) for i in range(count)]
    expected = own_scores(model, tokenizer, [p + c for p, c in zip(prompts, completions)])
    for reward in (by_folder, by_object):
        scores = reward(prompts=prompts, completions=completions)
        assert scores == pytest.approx(expected, abs=1e-5)
        assert len(set(scores)) > 1
    chat_prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    chat_completions = [[{"role": "assistant", "content": "y" * (i + 1)}] for i in range(3)]
    texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(chat_prompts, chat_completions)]
    assert by_folder(prompts=chat_prompts, completions=chat_completions) == pytest.approx(
        own_scores(model, tokenizer, texts), abs=1e-5)
    assert not by_folder.model.training and not any(p.grad is not None for p in by_folder.model.parameters())


def test_a_reward_model_is_named_and_saved_as_trl_names_it(classifier_dir, tokenizer):
    by_folder = load_reward_func(str(classifier_dir))
    assert reward_name(by_folder) == "tiny-reward-model"  # the basename of where it came from
    assert reward_reference(str(classifier_dir)) == reward_reference(by_folder) == str(classifier_dir)
    model = make_classifier(len(tokenizer))
    assert reward_reference(model) == "<in-memory reward model LlamaForSequenceClassification>"
    assert reward_name(load_reward_func(model, processing_class=tokenizer)) == "LlamaForSequenceClassification"


def test_what_cannot_score_is_refused_with_the_reason(tmp_path, tokenizer, tiny_model_dir, classifier_dir):
    with pytest.raises(RewardError, match=r"is a causal language model \(LlamaForCausalLM\), not a sequence classifier"):
        load_reward_func(str(tiny_model_dir))
    two_labels = tmp_path / "two-labels"
    make_classifier(len(tokenizer), num_labels=2).save_pretrained(two_labels)
    with pytest.raises(RewardError, match="has 2 labels, and covey scores with a classifier of one"):
        load_reward_func(str(two_labels))
    with pytest.raises(RewardError, match="has 2 labels"):
        load_reward_func(make_classifier(len(tokenizer), num_labels=2), processing_class=tokenizer)
    with pytest.raises(RewardError, match="is a causal language model"):
        load_reward_func(make_model(len(tokenizer)), processing_class=tokenizer)
    no_head = tmp_path / "no-head"  # a config naming no architecture, over weights without a classifier head
    shutil.copytree(tiny_model_dir, no_head)
    config = json.loads((no_head / "config.json").read_text())
    del config["architectures"]
    (no_head / "config.json").write_text(json.dumps(config))
    with pytest.raises(RewardError, match="its checkpoint lacks score.weight, which would start random"):
        load_reward_func(str(no_head))
    no_tokenizer = tmp_path / "no-tokenizer"
    make_classifier(len(tokenizer)).save_pretrained(no_tokenizer)
    with pytest.raises(RewardError, match="the folder holds no tokenizer .* reward_processing_classes"):
        load_reward_func(str(no_tokenizer))
    assert load_reward_func(str(no_tokenizer), processing_class=tokenizer)(prompts=["a"], completions=["b"])
    with pytest.raises(RewardError, match="was not loaded from a folder or hub id.*reward_processing_classes"):
        load_reward_func(make_classifier(len(tokenizer)))
    with pytest.raises(RewardError, match="not a built-in .*not a reward model .*there is none at"):
        load_reward_func(str(tmp_path / "missing-folder"))


def test_the_trainer_checks_reward_models_before_training(tmp_path, tokenizer, tiny_model, classifier_dir):
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=4)

    def count_a(completions, **kwargs):
        return [c[0]["content"].count("a") for c in completions]

    with pytest.raises(ConfigError, match=r"the number of reward_processing_classes \(1\) must match the number of reward functions \(2\)"):
        GRPOTrainer(model=tiny_model, reward_funcs=[str(classifier_dir), count_a], args=args, train_dataset=CHATS,
                    processing_class=tokenizer, reward_processing_classes=[tokenizer])
    with pytest.raises(RewardError, match="gives a tokenizer for reward function 'count_a', which is not a reward"):
        GRPOTrainer(model=tiny_model, reward_funcs=[str(classifier_dir), count_a], args=args, train_dataset=CHATS,
                    processing_class=tokenizer, reward_processing_classes=[None, tokenizer])
    plain = make_tokenizer()
    plain.chat_template = None
    with pytest.raises(RewardError, match="the prompts are chats, and its tokenizer has no chat template"):
        GRPOTrainer(model=tiny_model, reward_funcs=str(classifier_dir), args=args, train_dataset=CHATS,
                    processing_class=tokenizer, reward_processing_classes=plain)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_run_trains_against_a_reward_model_and_saves_where_it_came_from(tmp_path, tokenizer, tiny_model,
                                                                          classifier_dir, workers):
    def count_a(completions, **kwargs):
        return [c[0]["content"].count("a") / 4 for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=4, per_device_train_batch_size=4,
                      max_completion_length=6, learning_rate=1e-3, eval_max_samples=0, reward_num_workers=workers,
                      logging_steps=1)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[str(classifier_dir), count_a], args=args,
                          train_dataset=CHATS, processing_class=tokenizer, quiet=True)
    reward_model = trainer.parts.rewards.funcs[0]
    assert not RewardPool([reward_model, count_a], 1).runs(reward_model)  # always in the trainer's process
    trainer.train()
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rewards/tiny-reward-model/std"] > 0 for m in metrics)  # the model tells completions apart
    assert yaml.safe_load((run / "config.yaml").read_text())["reward_funcs"][0] == str(classifier_dir)
    reloaded = GRPOConfig.from_dict(yaml.safe_load((run / "config.yaml").read_text()))
    assert reward_name(load_reward_func(reloaded.reward_funcs[0])) == "tiny-reward-model"
