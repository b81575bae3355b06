"""The one configuration object of a covey run.

Field names follow TRL's ``GRPOConfig`` wherever TRL has the concept, so a TRL config moves across
unchanged; on the command line the same names are written in dash-case (``--learning-rate``).
The fields, each with a one-line help text (shown by ``covey train --help``) and used somewhere, are
``covey.config_fields.RunSettings``; this module reads them in and checks them.
The defaults are TRL's (TRL 1.16) for every field TRL has; ``DEMO`` is the built-in demo's preset (the
embedded SmolLM2-135M-Instruct on the ``arithmetic`` task, sized to finish in minutes on a laptop CPU),
which the command line runs when it is given no config file.

    >>> cfg = GRPOConfig.demo(learning_rate=2e-5, max_steps=10)
    >>> cfg.generation_batch_size // cfg.num_generations   # prompts per step (of each process)
    2
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from covey import rules
from covey.config_fields import DTYPES, RunSettings
from covey.config_values import coerce, read_yaml_mapping
from covey.errors import ConfigError, config_errors
from covey.trl_fields import AS_COVEY_DOES, covey_names, torch_cuda_bf16, trl_config_values


# model_init_kwargs keys that are covey fields (torch_dtype: transformers' older name of dtype)
MODEL_INIT_FIELDS = {"dtype": "dtype", "torch_dtype": "dtype", "revision": "model_revision",
                     "attn_implementation": "attn_implementation", "trust_remote_code": "trust_remote_code"}
# The demo preset: what `covey train` (verify, generate, plan, eval) runs when no config file is given, sized
# to finish in minutes on a laptop CPU. In Python, GRPOConfig.demo(...) asks for it; GRPOConfig() alone has
# TRL's defaults, and a config file starts from them too (with the demo's data and rewards where it names none).
DEMO = {"dataset": "arithmetic", "reward_funcs": ["answer_format", "answer_correct"], "max_steps": 30,
        "max_completion_length": 32, "learning_rate": 1e-5, "per_device_train_batch_size": 16,
        "lr_scheduler_type": "constant", "gradient_checkpointing": False, "logging_steps": 1,
        "log_completions": True, "num_completions_to_print": 4, "save_total_limit": 2,
        "per_device_eval_batch_size": 32}
# fields that say how a run continues, not what it trains: a resume may change them freely
RESUME_FIELDS = ("resume_from_checkpoint", "output_dir", "overwrite_output_dir")


@dataclass
class GRPOConfig(RunSettings):
    """A run's config: ``RunSettings`` read as TRL reads its own (TRL's names and defaults) and checked
    against ``covey.rules`` when it is made."""

    def __post_init__(self) -> None:
        for name, value in self.__dict__.pop("script_settings", {}).items():  # given to GRPOConfig(...) by name
            setattr(self, name, value)
        if (source := _copied_by_replace()) is not None:
            self._keep_what_replace_drops(source)
        elif "trl_settings" not in self.__dict__:  # built by a subclass's own dataclass __init__ (TRL's parser does)
            self._read_as_given()
        if self.bf16 is None:  # TRL's default: bfloat16 where a CUDA GPU computes in it, unless use_cpu
            self.bf16 = not self.use_cpu and torch_cuda_bf16()
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        for name in ("eval_strategy", "save_strategy"):
            if getattr(self, name) is False or str(getattr(self, name)).lower() == "false":  # YAML reads an unquoted no as false
                setattr(self, name, "no")
        # older TRL configs use true/false (a YAML bool, or text from the command line)
        if isinstance(self.scale_rewards, bool) or str(self.scale_rewards).lower() in ("true", "false"):
            self.scale_rewards = "group" if str(self.scale_rewards).lower() == "true" else "none"
        if self.fsdp is None or (isinstance(self.fsdp, (list, tuple)) and all(isinstance(w, str) for w in self.fsdp)):
            self.fsdp = " ".join(self.fsdp or [])  # TRL takes a list of its words too
        problems = []  # every bad value at once
        for f in dataclasses.fields(self):
            try:
                setattr(self, f.name, coerce(f.name, getattr(self, f.name), _field_type(type(self), f)))
            except ConfigError as e:
                problems.append(str(e))
                continue
            allowed = f.metadata.get("choices")
            if allowed and getattr(self, f.name) not in allowed:
                problems.append(f"{f.name}={getattr(self, f.name)!r} is not one of {', '.join(allowed)}")
        if problems:  # the range checks need values of the right types
            raise config_errors(problems)
        self._lift_model_init_kwargs()
        if self.use_vllm:
            self.rollout_engine = "vllm"
        rules.check(rules.CONFIG_RULES, self)
        rules.advise(self)

    def _keep_what_replace_drops(self, source: GRPOConfig) -> None:
        """A copy made by ``dataclasses.replace(source, ...)``: the settings the parser leaves to ModelConfig and
        ScriptArguments are no ``__init__`` arguments, so replace would reset them; they are the source's, as
        are what it accepted of TRL's and what was set (and now what the copy changed)."""
        for f in dataclasses.fields(self):
            if not f.init:
                setattr(self, f.name, getattr(source, f.name))
        changed = {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(source, f.name)}
        self.__dict__["trl_settings"] = dict(source.trl_settings)
        self.__dict__["fields_given"] = source.fields_given | changed

    def _read_as_given(self) -> None:
        """TRL's rules applied to the fields a subclass's own ``__init__`` set, as ``GRPOConfig(...)`` applies them
        (``generation_kwargs`` lifted, ...); what was given is what differs from the defaults."""
        every = dataclasses.fields(GRPOConfig)
        given = {f.name: getattr(self, f.name) for f in every if getattr(self, f.name) != _default(f)}
        fields, accepted, problems = covey_names(given, {f.name: _default(f) for f in every})
        if problems:
            raise config_errors(problems)
        for name, value in fields.items():
            setattr(self, name, value)
        own = {f.name for f in dataclasses.fields(self)} - {f.name for f in every}
        self.__dict__["trl_settings"] = accepted
        self.__dict__["fields_given"] = frozenset(fields) | own

    def _lift_model_init_kwargs(self) -> None:
        """Settings of model_init_kwargs that are covey fields (TRL recipes give the dtype there) move into
        those fields, which load every model (the policy, the engines' copies); both set differently: an error."""
        if not self.model_init_kwargs:
            return
        kwargs, problems = dict(self.model_init_kwargs), []
        for key, name in MODEL_INIT_FIELDS.items():
            if key not in kwargs:
                continue
            value = kwargs.pop(key)
            value = str(value).removeprefix("torch.") if name == "dtype" else value  # torch.bfloat16 from Python
            default = GRPOConfig.__dataclass_fields__[name].default
            if getattr(self, name) not in (default, value):
                problems.append(f"model_init_kwargs sets {key}={value!r} and {name}={getattr(self, name)!r}; give one")
            else:
                setattr(self, name, coerce(name, value, _field_type(GRPOConfig, GRPOConfig.__dataclass_fields__[name])))
        if problems:
            raise config_errors(problems)
        self.model_init_kwargs = kwargs or None
        if self.dtype not in DTYPES:
            raise ConfigError(f"model_init_kwargs: dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")

    def __getattr__(self, name: str) -> Any:
        """A TRL setting covey accepts as what it does (``optim``, ``do_eval``, ...) reads as given, or as
        TRL's default; scripts read them back."""
        settings = self.__dict__.get("trl_settings", {})
        if name in settings:  # a TRL setting accepted as what covey does, or a TRL subclass's own field
            return settings[name]
        if name in AS_COVEY_DOES:
            return AS_COVEY_DOES[name][0]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def replace(self, **changes: Any) -> "GRPOConfig":
        """A copy with ``changes`` (any field, those TRL keeps in ModelConfig too, which ``dataclasses.replace``
        cannot change), checked as a new config is; what was set stays set."""
        copy = type(self).__new__(type(self))
        copy.__dict__.update({**self.__dict__, **changes, "fields_given": self.fields_given | set(changes)})
        copy.__post_init__()
        return copy

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> "GRPOConfig":
        """The config of ``values`` (``source`` names where they came from); every unknown key and bad
        value is said at once, in one ConfigError. The same door as ``GRPOConfig(**values)``."""
        try:
            config = cls(**values)
        except ConfigError as e:
            raise config_errors(getattr(e, "problems", [str(e)]), source) from None
        except TypeError as e:  # a key that is no name (a number in YAML) cannot be a keyword
            raise config_errors([f"config keys must be field names such as learning_rate: {e}"], source) from None
        # a config file or command line is a whole run: its data and rewards default to the demo's
        config.__dict__["fields_given"] = config.fields_given | {"dataset", "reward_funcs"}
        return config

    @classmethod
    def demo(cls, **values: Any) -> "GRPOConfig":
        """The demo preset (``DEMO``: its task, rewards and sizes) with ``values`` over it."""
        return cls(**{**DEMO, **values})

    @classmethod
    def from_trl(cls, config: Any) -> "GRPOConfig":
        """covey's config of a TRL ``GRPOConfig`` object (or of a subclass of it), read field by field with the
        rules of ``GRPOConfig(...)``: every field covey cannot honour is named in one ConfigError. The
        subclass's own fields are kept, and read back as attributes."""
        values, own, changed = trl_config_values(config)
        made = cls.from_dict(values, source=f"the {type(config).__name__} handed to the trainer")
        made.__dict__["fields_given"] = frozenset(changed & made.fields_given)  # the data and rewards: the trainer's
        made.trl_settings.update(own)
        return made

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "GRPOConfig":
        """The config of the YAML file at ``path``, with ``overrides`` (the command line's) over its values."""
        return cls.from_dict({**read_yaml_mapping(path), **(overrides or {})}, source=str(path))


_dataclass_init = GRPOConfig.__init__  # the dataclass's own: covey's fields only


def _init_with_trl_names(self: GRPOConfig, *output_dir: Any, **values: Any) -> None:
    """``GRPOConfig(...)`` takes what TRL's takes: covey's fields, TRL's names for them, and every TRL and
    TrainingArguments field at a value that describes what covey does (kept in ``trl_settings``); any
    other is refused with every problem at once. One positional argument is output_dir, as in TRL."""
    if output_dir:
        if len(output_dir) > 1 or "output_dir" in values:
            raise ConfigError("GRPOConfig takes one positional argument, output_dir (as TRL's); give the others "
                              "by name, such as GRPOConfig(output_dir='runs/a', learning_rate=1e-5)")
        values = {"output_dir": output_dir[0], **values}
    every = dataclasses.fields(GRPOConfig)
    parser_names = {f.name for f in every if f.init}
    if parser_names <= values.keys():  # every field at once, as an argument parser gives them: the set ones differ
        values = {k: v for k, v in values.items() if k not in parser_names or v != _default(GRPOConfig.__dataclass_fields__[k])}
    fields, accepted, problems = covey_names(values, {f.name: _default(f) for f in every})
    self.__dict__["trl_settings"] = accepted
    self.__dict__["fields_given"] = frozenset(fields)  # what the caller set, not left at covey's default
    self.__dict__["script_settings"] = {k: v for k, v in fields.items() if k not in parser_names}
    try:
        _dataclass_init(self, **{k: v for k, v in fields.items() if k in parser_names})
    except ConfigError as e:
        problems.extend(getattr(e, "problems", [str(e)]))
    if problems:
        raise config_errors(problems)


_init_with_trl_names.__signature__ = inspect.signature(_dataclass_init).replace(  # for help() and editors
    parameters=[*inspect.signature(_dataclass_init).parameters.values(),
                *(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                                    default=f.default_factory() if f.default is dataclasses.MISSING else f.default)
                  for f in dataclasses.fields(GRPOConfig) if not f.init),  # the settings a parser leaves to ModelConfig
                inspect.Parameter("trl_settings", inspect.Parameter.VAR_KEYWORD)])
GRPOConfig.__init__ = _init_with_trl_names


class AsyncGRPOConfig(GRPOConfig):
    """TRL's ``AsyncGRPOConfig`` (stable from TRL 1.18): a GRPOConfig whose generation runs ahead of
    training (``async_generation``, docs/async.md), sampled by a vLLM server (``vllm_server_base_url``),
    with TRL's defaults for those; its settings of TRL's own asynchronous machinery are accepted at TRL's
    defaults. Any field can still be set, as in GRPOConfig."""

    DEFAULTS = {"async_generation": True, "use_vllm": True, "vllm_mode": "server", "max_staleness": 4}

    def __init__(self, *output_dir: Any, **values: Any) -> None:
        super().__init__(*output_dir, **{**self.DEFAULTS, **values})
        self.__dict__["fields_given"] = self.fields_given - (set(self.DEFAULTS) - set(values))


def _copied_by_replace() -> GRPOConfig | None:
    """The config ``dataclasses.replace`` is copying, where it is what builds this one (None elsewhere)."""
    frame = sys._getframe(2)
    for _ in range(6):  # replace -> the __init__ (covey's, then the dataclass's) -> __post_init__ -> here
        if frame is None:
            return None
        if frame.f_code.co_filename == dataclasses.__file__ and isinstance(frame.f_locals.get("obj"), GRPOConfig):
            return frame.f_locals["obj"]
        frame = frame.f_back
    return None


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@functools.cache  # resolving the annotations is slow, and every config resolves every field
def _field_type(config_class: type, f: dataclasses.Field) -> tuple[type, bool]:
    """(base type, optional) of a field of ``config_class`` (GRPOConfig or a subclass), from its annotation."""
    hint = typing.get_type_hints(config_class)[f.name]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if isinstance(hint, types.UnionType) else hint
    return typing.get_origin(base) or base, optional


def config_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(GRPOConfig))


