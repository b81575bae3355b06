"""Sharding the model over the processes with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Under ``fsdp: full_shard`` (TRL's name; or an accelerate config of distributed_type FSDP) every
transformer block, and then the whole training pass around the model, is a ``fully_shard`` unit:
each process holds 1/N of every parameter, of its gradient and of AdamW's state, and a block's
parameters are gathered only while it runs (forward, and again in the backward). The gradients are
reduce-scattered as the backward goes, so each process's optimizer steps its own shards.

The training pass (``TrainingForward``) is the root unit, not the model itself: covey's passes call
into the model's parts (the decoder, the output head) beside its own forward, and the root's hooks
gather the parameters outside the blocks (embeddings, final norm, head) for all of them.

An engine that samples in the training process (fast, hf) samples from a whole, plain copy of the
weights (``PolicyCopy``), refreshed from the shards block by block before a round samples; a vLLM or
covey server receives the weights gathered block by block (``covey.models.policy_weights``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Mapping

import torch

from covey.errors import ConfigError, warn
from covey.models import SHARDED_PASSES, gathered_parameters, is_sharded

# TRL's (TrainingArguments') words for `fsdp` that covey does: full_shard; shard_grad_op (a block's parameters
# stay gathered from its forward to its backward); auto_wrap (every block its own unit, as covey always does)
FSDP_WORDS = ("full_shard", "shard_grad_op", "auto_wrap")
REFUSED_WORDS = {"offload": "offloading parameters to the CPU", "hybrid_shard": "hybrid sharding (within a node, "
                 "replicated across nodes)", "hybrid_shard_zero2": "hybrid sharding", "no_shard": "FSDP without "
                 "sharding (use plain data parallelism: leave fsdp out)"}
# accelerate launch passes an FSDP config to its processes as these variables (accelerate.utils.launch)
ACCELERATE_VARIABLES = {"FSDP_VERSION": "version", "FSDP_RESHARD_AFTER_FORWARD": "reshard_after_forward",
                        "FSDP_TRANSFORMER_CLS_TO_WRAP": "transformer_layer_cls_to_wrap",
                        "FSDP_AUTO_WRAP_POLICY": "auto_wrap_policy", "FSDP_STATE_DICT_TYPE": "state_dict_type",
                        "FSDP_OFFLOAD_PARAMS": "offload_params",
                        "FSDP_CPU_RAM_EFFICIENT_LOADING": "cpu_ram_efficient_loading",
                        "FSDP_ACTIVATION_CHECKPOINTING": "activation_checkpointing",
                        "FSDP_SYNC_MODULE_STATES": "sync_module_states", "FSDP_USE_ORIG_PARAMS": "use_orig_params",
                        "FSDP_FORWARD_PREFETCH": "forward_prefetch", "FSDP_BACKWARD_PREFETCH": "backward_prefetch"}


@dataclass(frozen=True)
class Sharding:
    """How the model is sharded: ``reshard_after_forward`` (full_shard) or not (shard_grad_op), the names
    of the block classes that are units of their own (None: the model's ``_no_split_modules``), and
    whether checkpoints hold the model whole too (``state_dict_type: FULL_STATE_DICT``)."""

    reshard_after_forward: bool = True
    block_classes: tuple[str, ...] | None = None
    whole_model_in_checkpoints: bool = False

    @staticmethod
    def from_settings(fsdp: str | list | None, fsdp_config: Mapping | None,
                      environ: Mapping[str, str]) -> Sharding | None:
        """The sharding a config (TRL's ``fsdp`` and ``fsdp_config``) or an accelerate FSDP launch asks for;
        None without one. Whatever covey would not do as asked is refused, all of it in one error."""
        words = [w for w in (fsdp.split() if isinstance(fsdp, str) else list(fsdp or [])) if w]
        launched = environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
        if not words and not launched:
            if fsdp_config:
                raise ConfigError("fsdp_config is given but fsdp is not set: add fsdp: full_shard (or launch with an "
                                  "accelerate config of distributed_type FSDP), or remove fsdp_config")
            return None
        problems = [f"fsdp: {w!r} asks for {REFUSED_WORDS[w]}, which covey does not do" if w in REFUSED_WORDS else
                    f"fsdp: {w!r} is not an FSDP option" for w in words if w not in FSDP_WORDS]
        options = {key.removeprefix("fsdp_"): value for key, value in (fsdp_config or {}).items()}
        problems += [f"fsdp_config: {key!r} is not an FSDP option covey knows (it honours {', '.join(CONFIG_KEYS)})"
                     for key in options if key not in CONFIG_KEYS]
        if launched:
            for variable, key in ACCELERATE_VARIABLES.items():
                if variable in environ and key not in options:
                    options[key] = environ[variable]
        reshard = "shard_grad_op" not in words
        if "reshard_after_forward" in options:
            reshard = _flag(options.pop("reshard_after_forward"), "reshard_after_forward", problems, reshard)
        block_classes = options.pop("transformer_layer_cls_to_wrap", None)
        if isinstance(block_classes, str):
            block_classes = [name.strip() for name in block_classes.split(",") if name.strip()]
        kind = str(options.pop("state_dict_type", None) or "SHARDED_STATE_DICT").upper()
        if kind not in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
            problems.append(f"fsdp_config: state_dict_type={kind!r} is not SHARDED_STATE_DICT or FULL_STATE_DICT")
        if _flag(options.pop("cpu_ram_efficient_loading", False), "cpu_ram_efficient_loading", problems, False):
            warn("fsdp_config: cpu_ram_efficient_loading (accelerate's default) asks that only the first "
                          "process read the weights from disk; covey loads the model in every process, then gives "
                          "every one the first one's weights: the same start, without that saving of host memory at "
                          "load. Set it false in the accelerate config to silence this", stacklevel=3)
        problems += _unsupported_options(options)
        if problems:
            raise ConfigError("; ".join(problems) + ". covey shards with FSDP2 (fully_shard) per transformer block: "
                              "fsdp: full_shard or shard_grad_op, with fsdp_config keys version: 2, "
                              "reshard_after_forward, transformer_layer_cls_to_wrap, state_dict_type "
                              "(docs/distributed.md)")
        return Sharding(reshard, tuple(block_classes) if block_classes else None, kind == "FULL_STATE_DICT")


def check_sharded_run(args) -> None:
    """Refuse what a sharded run cannot do (``args``: its GRPOConfig)."""
    problems = []
    if args.shard_optimizer_state:
        problems.append("shard_optimizer_state shards AdamW's state alone, and fsdp shards it already; remove "
                        "shard_optimizer_state")
    if args.quantization:
        problems.append(f"load_in_{args.quantization} with fsdp: covey does not shard quantized weights; train the "
                        "quantized model in one process per copy (without fsdp), or drop the quantization")
    if args.push_to_hub and args.hub_strategy != "end" and not args.save_only_model:
        problems.append(f"hub_strategy: {args.hub_strategy} pushes checkpoints, which under fsdp hold shards rather "
                        "than a model; use hub_strategy: end (the final model is whole), or save_only_model: true "
                        "(checkpoints of the whole model alone)")
    if problems:
        raise ConfigError("; ".join(problems))


def _flag(value, key: str, problems: list[str], default: bool) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "full_shard"):
        return True
    if text in ("false", "0", "shard_grad_op"):
        return False
    problems.append(f"fsdp_config: {key}={value!r} is not true or false")
    return default


# fsdp_config values that ask for nothing beyond what covey does
PLAIN_OPTIONS = {"version": ("2", 2), "auto_wrap_policy": ("TRANSFORMER_BASED_WRAP",),
                 "offload_params": (False, "false"), "activation_checkpointing": (False, "false"),
                 "sync_module_states": (True, "true"), "use_orig_params": (True, "true"),
                 "forward_prefetch": (False, "false")}
OPTION_ADVICE = {
    "version": "covey shards with FSDP2 only: set fsdp_version: 2",
    "auto_wrap_policy": "covey makes every transformer block a unit (TRANSFORMER_BASED_WRAP)",
    "offload_params": "covey keeps the parameters on the device",
    "activation_checkpointing": "covey's own setting is gradient_checkpointing: true",
    "sync_module_states": "covey always starts every process from the first one's weights",
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "forward_prefetch": "FSDP2 prefetches the next block's parameters itself",
}


# the keys of TRL's fsdp_config (and accelerate's FSDP plugin) that covey knows; the fsdp_ prefix is optional
CONFIG_KEYS = ("reshard_after_forward", "transformer_layer_cls_to_wrap", "state_dict_type", "cpu_ram_efficient_loading",
               "backward_prefetch", "min_num_params", *PLAIN_OPTIONS)


def _unsupported_options(options: dict) -> list[str]:
    """The fsdp_config options (``transformer_layer_cls_to_wrap`` and ``reshard_after_forward`` taken out)
    set to anything but what covey does."""
    problems = []
    for key, value in options.items():
        if key == "backward_prefetch":  # FSDP1's; FSDP2 prefetches backward by itself
            if value not in (None, "BACKWARD_PRE", "NO_PREFETCH"):
                problems.append(f"fsdp_config: backward_prefetch={value!r} is not an FSDP2 setting")
            continue
        if key == "min_num_params":  # read by size-based wrapping only, which auto_wrap_policy refuses
            continue
        if key in PLAIN_OPTIONS and value not in PLAIN_OPTIONS[key] and str(value) not in map(str, PLAIN_OPTIONS[key]):
            problems.append(f"fsdp_config: {key}={value!r} is not supported ({OPTION_ADVICE[key]})")
    return problems


def shard(module: torch.nn.Module, sharding: Sharding, bf16: bool, trained: bool = True) -> torch.nn.Module:
    """``module`` (a pass around the model, whose parameters are the model's) sharded in place over the
    process group: each transformer block a ``fully_shard`` unit, then ``module`` itself, which holds the
    rest. Under ``bf16`` the gathered parameters are bfloat16 and the gradients are reduced in float32
    (the shards, and AdamW's updates of them, stay float32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = transformer_blocks(module, sharding.block_classes)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, reshard_after_forward=sharding.reshard_after_forward, mp_policy=policy)
    # a trained pass's root parameters are needed again at once by its backward; a frozen one (the
    # reference) has none, so its root frees them after the forward too
    fully_shard(module, reshard_after_forward=not trained, mp_policy=policy)
    SHARDED_PASSES.add(module)
    return module


def transformer_blocks(module: torch.nn.Module, names: tuple[str, ...] | None) -> list[torch.nn.Module]:
    """The blocks of ``module``'s model that become units: modules of the named classes (by default the
    model's own ``_no_split_modules``, its decoder layers)."""
    from covey.models import plain_model

    model = plain_model(getattr(module, "model", module))
    wanted = set(names or getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in module.modules() if type(m).__name__ in wanted]
    if not blocks:
        found = sorted({type(m).__name__ for m in module.modules() if "layer" in type(m).__name__.lower()
                        or "block" in type(m).__name__.lower()})
        raise ConfigError(f"fsdp: no module of {model.__class__.__name__} is of the block classes "
                          f"{sorted(wanted) or '(the model names none)'}; set fsdp_config: "
                          f"transformer_layer_cls_to_wrap to its decoder layer's class ({', '.join(found) or 'none found'})")
    return blocks


def whole_state_dict(root: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The state dict of the model inside the sharded pass ``root``, under the model's own names: whole, on
    the first process's CPU (gathered tensor by tensor), and empty on the others. Every process calls it.
    None where ``root`` is not sharded (fsdp in one process): the model's own is whole."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(root):
        return None
    state = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    met, repeats = set(), set()  # a tied head is saved as the model saves it: once, under the embedding's name
    for name, param in root.named_parameters(remove_duplicate=False):
        if id(param) in met:
            repeats.add(name)
        met.add(id(param))
    return {name.removeprefix("model."): tensor for name, tensor in state.items() if name not in repeats}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor, or a sharded one (a DTensor) gathered whole: every process calls this at once."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def grad_norm_value(norm: torch.Tensor) -> float:
    """The float value of a gradient norm (a DTensor's, under sharding, is whole already)."""
    return float(whole(norm))


class PolicyCopy:
    """A whole, plain copy of a sharded policy, for an engine that samples in the training process (fast,
    hf). Made before the policy is sharded; its weights are held only while the engine samples: ``refresh``
    gathers them from the shards, a block at a time (every process at once), and ``release`` frees them
    again, so that the copy never sits beside the training pass's gradients and activations."""

    def __init__(self, policy: torch.nn.Module):
        self.model = copy.deepcopy(policy).requires_grad_(False)
        self.held = True  # its weights are there (and are the policy's, unless stale)
        self.stale = False  # the policy has changed since they were taken

    def policy_changed(self) -> None:
        """After an optimizer step: the next ``refresh`` gathers the weights again."""
        self.stale = True

    @torch.no_grad()
    def refresh(self, root: torch.nn.Module, policy: torch.nn.Module) -> None:
        """``policy``'s weights, from the sharded pass ``root`` around it, unless held and current."""
        if self.held and not self.stale:
            return
        own = dict(self.model.named_parameters(remove_duplicate=False))
        taken: set[int] = set()  # a tied head is the embedding's tensor
        for name, param in gathered_parameters(root, policy):
            if id(own[name]) not in taken:
                own[name].data = param.detach().clone()
                taken.add(id(own[name]))
        self.held, self.stale = True, False

    def release(self) -> None:
        """Free the weights until the next ``refresh``."""
        for param in self.model.parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.held = False
