"""Reward models as reward functions, as TRL takes them: a sequence classifier with one output
(``AutoModelForSequenceClassification``, ``num_labels=1``) given in ``reward_funcs`` by hub id or
folder, or as a loaded model, with its tokenizer (``reward_processing_classes``, else the model's own).

The text it scores is TRL's: the prompt followed by the completion for plain text; for chat, the
whole conversation (the prompt's messages, then the completion's) through the reward tokenizer's chat
template. Texts are tokenized without added special tokens, padded on the right, and scored
``BATCH_SIZE`` at a time, in eval mode without gradients, on the device the model sits on; a text's
score is the model's one logit (``logits[:, 0]``) at its last token that is not padding.

A classifier of several labels is refused rather than read by its first logit (which TRL would take,
though it is rarely the reward): wrap such a model in a reward function of your own that turns its
logits into one score.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from covey.data.text import render_chat
from covey.errors import RewardError

BATCH_SIZE = 16  # texts per forward pass: long completions of a large model fit, short ones do not crawl
CLASSIFIER = "ForSequenceClassification"  # how transformers names the sequence-classifier class of each model
WHAT_IS_TAKEN = "reward_funcs takes reward models that are sequence classifiers with one label " \
                "(AutoModelForSequenceClassification, num_labels=1)"


class RewardModel:
    """``model`` (a sequence classifier with one label) and ``tokenizer`` as a reward function:
    ``reward_model(prompts=..., completions=...) -> [score, ...]``. ``reference``: the hub id or folder
    it was loaded from, which a run's saved config names (None: given as an object)."""

    in_trainer_process = True  # never in a reward worker: a forked process cannot use the GPU it may sit on

    def __init__(self, model: torch.nn.Module, tokenizer: Any, reference: str | None = None,
                 batch_size: int = BATCH_SIZE):
        source = getattr(getattr(model, "config", None), "_name_or_path", None) or reference or ""
        self.__name__ = Path(source).name or type(model).__name__  # as TRL names it: the model's basename
        check_classifier(model, self.__name__)
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token is None:
                raise RewardError(f"reward model {self.__name__!r}: its tokenizer has neither a pad token nor an "
                                  "end-of-sequence token to pad with; set tokenizer.pad_token")
            tokenizer.pad_token = tokenizer.eos_token
        # the model finds each text's last token as the last one that is not this padding
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.model, self.tokenizer, self.reference, self.batch_size = model.eval(), tokenizer, reference, batch_size
        self.chat_template_kwargs: dict | None = None  # the run's, which the trainer gives it (chats are rendered with them)

    def __call__(self, prompts: list, completions: list, **_: Any) -> list[float]:
        texts = [self.text(prompt, completion) for prompt, completion in zip(prompts, completions)]
        device = next(self.model.parameters()).device
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                inputs = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                        padding_side="right", add_special_tokens=False).to(device)
                scores += self.model(**inputs).logits[:, 0].float().tolist()
        return scores

    def text(self, prompt: Any, completion: Any) -> str:
        """What the model scores: prompt and completion as one text (a chat through the chat template)."""
        if isinstance(prompt, str):
            return prompt + completion
        self.check_prompt(prompt)
        return render_chat(self.tokenizer, list(prompt) + list(completion), False,
                           template_kwargs=self.chat_template_kwargs)

    def check_prompt(self, prompt: Any) -> None:
        """Refuse chat prompts where the tokenizer has no chat template to write the conversation with."""
        if not isinstance(prompt, str) and getattr(self.tokenizer, "chat_template", None) is None:
            raise RewardError(f"reward model {self.__name__!r}: the prompts are chats, and its tokenizer has no chat "
                              "template to write prompt and completion as one text; give one that has "
                              "(reward_processing_classes), or use plain-text prompts")

    def to(self, device: torch.device | str) -> RewardModel:
        self.model.to(device)
        return self


def check_classifier(model: torch.nn.Module, name: str) -> None:
    kind = type(model).__name__
    if not kind.endswith(CLASSIFIER):
        raise RewardError(f"reward model {name!r} is {_kind(kind)}, not a sequence classifier; {WHAT_IS_TAKEN}")
    _check_labels(getattr(model.config, "num_labels", None), name)


def _check_labels(labels: int | None, name: str) -> None:
    if labels != 1:
        raise RewardError(f"reward model {name!r} has {labels} labels, and covey scores with a classifier of one "
                          "(its logit is the reward); for a classifier of several, write a reward function that "
                          "turns its logits into one score")


def _kind(architecture: str) -> str:
    return f"a causal language model ({architecture})" if architecture.endswith("ForCausalLM") else f"a {architecture}"


def load_reward_model(name: str, tokenizer: Any = None, trust_remote_code: bool = False,
                      device: torch.device | str | None = None) -> RewardModel:
    """The reward model in folder or hub repository ``name`` (in the checkpoint's own dtype, as TRL
    loads it), with ``tokenizer`` or the one saved beside it, on ``device``. Whatever makes it unusable
    is said: not a classifier, several labels (before the weights load where the config shows either),
    no trained head, no tokenizer."""
    from transformers import AutoModelForSequenceClassification, PretrainedConfig

    try:
        config, _ = PretrainedConfig.get_config_dict(name)  # as saved: which labels it declares, if any
    except (OSError, ValueError) as e:
        raise RewardError(f"reward model {name!r} could not be loaded ({str(e).strip()}); give a hub id or a folder "
                          "with config.json and weights") from e
    architectures = config.get("architectures") or []
    if architectures and not any(a.endswith(CLASSIFIER) for a in architectures):
        raise RewardError(f"reward model {name!r} is {_kind(architectures[0])}, not a sequence classifier; "
                          f"{WHAT_IS_TAKEN}")
    if "id2label" in config or "num_labels" in config:
        _check_labels(len(config["id2label"]) if "id2label" in config else config["num_labels"], name)
    try:  # one label where the config declares none (transformers would assume two), as TRL loads it
        model, loading = AutoModelForSequenceClassification.from_pretrained(
            name, num_labels=1, trust_remote_code=trust_remote_code, dtype="auto", output_loading_info=True,
            ignore_mismatched_sizes=True)  # a head of another size is reported below, by its size
    except (OSError, ValueError) as e:
        raise RewardError(f"reward model {name!r} could not be loaded: {str(e).strip()}") from e
    for key, saved_shape, _ in sorted(loading.get("mismatched_keys") or []):
        _check_labels(saved_shape[0], name)  # a head of several labels, saved without declaring them
    if missing := sorted(loading.get("missing_keys") or []):
        raise RewardError(f"reward model {name!r}: its checkpoint lacks {', '.join(missing[:3])}"
                          f"{' ...' if len(missing) > 3 else ''}, which would start random; {WHAT_IS_TAKEN}, "
                          "trained and saved with their head")
    tokenizer = tokenizer if tokenizer is not None else reward_tokenizer(name, trust_remote_code)
    if device is not None:
        model = model.to(device)
    return RewardModel(model, tokenizer, reference=name)


def reward_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved with reward model ``name``."""
    from transformers import AutoTokenizer

    fix = "save the tokenizer with the model (tokenizer.save_pretrained), or pass it in reward_processing_classes"
    folder = Path(name).expanduser()
    if folder.is_dir() and not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise RewardError(f"reward model {name!r}: the folder holds no tokenizer (tokenizer.json or "
                          f"tokenizer_config.json); {fix}")
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise RewardError(f"reward model {name!r}: its tokenizer could not be loaded ({' '.join(str(e).split())}); "
                          f"{fix}") from e


def reward_model_from_object(model: torch.nn.Module, tokenizer: Any = None,
                             trust_remote_code: bool = False) -> RewardModel:
    """A loaded sequence classifier as a reward model; without ``tokenizer``, the one saved where the
    model was loaded from (as TRL does)."""
    source = getattr(getattr(model, "config", None), "_name_or_path", None)
    check_classifier(model, source or type(model).__name__)
    if tokenizer is None:
        if not source:
            raise RewardError(f"the reward model {type(model).__name__} was not loaded from a folder or hub id, so "
                              "its tokenizer cannot be found; pass it in reward_processing_classes")
        tokenizer = reward_tokenizer(source, trust_remote_code)
    return RewardModel(model, tokenizer)
