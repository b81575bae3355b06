"""The fast engine's forward passes: a prompt prefill, then one token per row per step.

Two implementations behind the same three calls (``prefill``, ``step``, ``keep``):

- ``LeanDecoder``, for Llama-family models (``LeanDecoder.supports``): the same function as the
  Hugging Face forward written out as plain tensor operations over a preallocated KV cache. It
  skips what a general forward pays on every step (cache objects, mask building, module dispatch)
  and, in bfloat16 or for a LoRA policy, runs on its own copy of the weights (LoRA merged; in
  bfloat16 with q/k/v and gate/up fused into one matrix each), built at the start of a rollout and
  dropped at its end, so it never holds memory while the trainer does. A plain float32 model is
  run on its own parameters. On CPU, how it multiplies is chosen once (``WAYS_TO_MULTIPLY``). Where
  covey's own kernel runs (``decode_kernel``), a float32 decode step runs in it whole (``LayerStack``), on
  those same matrices; the embedding lookup and the final norm stay in torch, and the head and
  small prefills multiply through the kernel's products. In bfloat16 where the CPU has AMX, the copy
  is laid out in the kernel's tiles instead, and every forward multiplies through it. Elsewhere,
  through oneDNN's linear on matrices laid out once per rollout (the bfloat16 copies and a LoRA
  policy's merged ones in their place; in float32 a fused prepacked copy beside a full model's
  matrices, for steps of ``PREPACKED_FLOAT32_FROM_ROWS`` rows or more; in bfloat16 on a CPU without
  bfloat16 products, float32 copies of the bfloat16 matrices). Measured in BENCHMARKS.md.
- ``ModelDecoder``: the model's own forward with a ``DynamicCache``, for every other model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from covey.models import (bfloat16_products_in_software, cache_keyword, is_peft_model, lora_merge_blocker, plain_model,
                          policy_weights)
from covey.rollout.fast import decode_kernel

ARCHITECTURES = ("llama", "qwen2")


# How a lean decoder multiplies by its matrices on CPU: "kernel", covey's own kernel (float32, and
# bfloat16 with AMX; the whole decode step in it; ``decode_kernel``); "prepacked", oneDNN's linear on
# a prepacked copy; "plain", ``F.linear``; "fastest", the first of these that runs here. On GPU,
# always "plain".
WAYS_TO_MULTIPLY = ("fastest", "kernel", "prepacked", "plain")

# Float32 products with fewer rows than this run faster through ``F.linear`` on the weights as they
# are; from it on, through oneDNN's prepacked layout (measured in BENCHMARKS.md). bfloat16 ones are
# faster prepacked at every row count.
PREPACKED_FLOAT32_FROM_ROWS = 4


@functools.cache
def onednn_linear(dtype: torch.dtype = torch.bfloat16) -> tuple[Callable, Callable] | None:
    """(pack, linear): oneDNN's linear on weights reordered once into its own layout (what
    torch.compile emits for CPU linears), or None where this torch build lacks it for ``dtype`` or
    it disagrees with ``F.linear`` on a small product. ``pack(weight)`` gives the weight
    ``linear(x, packed, bias)`` takes."""
    def pack(weight):
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def linear(x, weight, bias=None):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    try:
        if not torch.backends.mkldnn.is_available():
            return None
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        generator = torch.Generator().manual_seed(0)
        x, weight, bias = (torch.randn(shape, generator=generator).to(dtype) for shape in ((3, 2, 64), (48, 64), 48))
        tolerance = 1e-4 if dtype == torch.float32 else 1e-2
        if not torch.allclose(linear(x, pack(weight), bias).float(), F.linear(x, weight, bias).float(), atol=tolerance):
            return None
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return pack, linear


def prepacked_linear(dtype: torch.dtype) -> tuple[Callable, Callable] | None:
    """(pack, linear) on prepacked matrices in ``dtype``: oneDNN's (``onednn_linear``); for bfloat16 where
    torch multiplies it in software, oneDNN's float32 linear on float32 copies of the bfloat16 matrices,
    each product rounded to bfloat16 (the numbers of ``models.Float32Products``, without widening the
    matrices at every step). None where neither runs."""
    onednn = onednn_linear(dtype)
    if onednn is not None or dtype != torch.bfloat16 or not bfloat16_products_in_software(torch.device("cpu")):
        return onednn
    if onednn_linear(torch.float32) is None:
        return None
    pack32, linear32 = onednn_linear(torch.float32)

    def pack(weight):
        return pack32(weight.to(torch.bfloat16).float())

    def linear(x, weight, bias=None):
        return linear32(x.float(), weight, None if bias is None else bias.float()).to(torch.bfloat16)
    return pack, linear


def linear_products(fuse: bool, onednn: tuple | None) -> Callable:
    """``multiply`` for ``Products.build`` through ``F.linear`` or, given ``onednn`` (from
    ``onednn_linear``), oneDNN's linear on prepacked copies; ``fuse`` concatenates the matrices
    whose outputs sit side by side (q/k/v, gate/up) into one."""
    pack, linear = onednn if onednn else ((lambda weight: weight), F.linear)

    def multiply(parts: list[tuple]) -> Callable:
        if fuse and len(parts) > 1:
            biases = [b for _, b in parts]
            parts = [(torch.cat([w for w, _ in parts]), torch.cat(biases) if biases[0] is not None else None)]
        parts = [(pack(w), b) for w, b in parts]
        if len(parts) == 1:
            (weight, bias), = parts
            return lambda x: linear(x, weight, bias)
        return lambda x: torch.cat([linear(x, w, b) for w, b in parts], -1)
    return multiply


@dataclass
class Products:
    """The matrix products of a forward, each a function x -> x times its matrices, outputs side by
    side: per layer ``qkv``, ``o``, ``gate_up`` and ``down``, then the output ``head``. ``kind`` says
    how they multiply (one of ``WAYS_TO_MULTIPLY`` but "fastest")."""

    layers: list[dict[str, Callable]]
    head: Callable
    kind: str

    @staticmethod
    def build(take: Callable, n_layers: int, head_name: str, multiply: Callable, kind: str) -> Products:
        """``take(name)`` gives a weight or bias (None if absent); ``head_name`` names the output head's
        matrix (the embedding's when tied); ``multiply(parts)`` gives the function of a list of
        (weight, bias) whose outputs sit side by side."""
        layers = [{name: multiply(parts) for name, parts in layer_parts(take, i).items()} for i in range(n_layers)]
        return Products(layers, multiply([(take(head_name), take("lm_head.bias"))]), kind)


# The matrix products of a Llama-family layer, in the order a forward runs them: each the module and
# the matrices whose outputs sit side by side
LAYER_PRODUCTS = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o": ("self_attn", ("o_proj",)),
                  "gate_up": ("mlp", ("gate_proj", "up_proj")), "down": ("mlp", ("down_proj",))}


def layer_parts(take: Callable, i: int) -> dict[str, list[tuple]]:
    """Layer i's (weight, bias) of each product of ``LAYER_PRODUCTS``, by ``take(name)`` (None if
    absent). Where one matrix of a product has a bias, the others get zero ones."""
    products = {}
    for name, (module, matrices) in LAYER_PRODUCTS.items():
        prefix = f"model.layers.{i}.{module}"
        ws = [take(f"{prefix}.{m}.weight") for m in matrices]
        bs = [take(f"{prefix}.{m}.bias") for m in matrices]
        given = next((b for b in bs if b is not None), None)
        if given is not None:
            bs = [b if b is not None else given.new_zeros(w.shape[0]) for w, b in zip(ws, bs)]
        products[name] = list(zip(ws, bs))
    return products


def _adapter_it_cannot_run(model: torch.nn.Module) -> bool:
    """A LoRA policy runs on its merged weights: not one whose adapters do not merge, nor one with
    DoRA's magnitudes or lora_bias's biases (a PEFT model's, or added through transformers'
    ``add_adapter``), which the lean layers have no place for."""
    adapters = getattr(model, "peft_config", {}).values()
    return ((is_peft_model(model) and lora_merge_blocker(model) is not None)
            or any(getattr(c, "use_dora", False) or getattr(c, "lora_bias", False) for c in adapters))


class LeanDecoder:
    """Decode-only forward of a Llama-family model. ``dtype`` is that of its weight matrices, matrix
    products, rotary embedding and KV cache; the residual stream and the norms stay in float32. With
    covey's kernel, only the matrices are in ``dtype`` (``cache_dtype`` float32).
    ``multiply``: how it multiplies by its matrices on CPU, one of ``WAYS_TO_MULTIPLY``."""

    @staticmethod
    def supports(model: torch.nn.Module, dtype: torch.dtype) -> bool:
        config = getattr(plain_model(model), "config", None)
        return (config is not None and config.model_type in ARCHITECTURES
                and getattr(config, "hidden_act", None) == "silu"
                and not getattr(config, "use_sliding_window", False)
                and getattr(config, "pretraining_tp", 1) in (None, 1)
                and not _adapter_it_cannot_run(model))

    @torch.no_grad()
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, max_length: int, multiply: str = "fastest"):
        base = plain_model(model)
        config = base.config
        self.dtype, self.max_length = dtype, max_length
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.embed, self.rotary = base.get_input_embeddings(), base.model.rotary_emb
        self.scale = base.model.layers[0].self_attn.scaling
        if multiply not in WAYS_TO_MULTIPLY:
            raise ValueError(f"multiply must be one of {WAYS_TO_MULTIPLY}, not {multiply!r}")
        on_cpu = base.model.norm.weight.device.type == "cpu"
        kernel = on_cpu and multiply in ("fastest", "kernel") and decode_kernel.available(dtype)
        if multiply == "kernel" and not kernel:
            raise ValueError(f"covey's decode kernel cannot run here in {dtype} (see covey.rollout.fast.decode_kernel)")
        # in bfloat16 where AMX runs the kernel, matrices are laid out in its tiles (biases in float32)
        tiles = kernel and dtype == torch.bfloat16

        def cast(t):
            if t.dim() == 1:
                return t.float() if tiles else t
            return decode_kernel.tile_bf16(t) if tiles else t.to(dtype)
        # matrices are cast as they come (a LoRA policy's merged weights are never all held in float32),
        # but for the embedding: the lookup reads the model's own table, so the decoder needs it only as
        # a tied head, which is known once the weights have all come
        embedding = "model.embed_tokens.weight"
        weights = {name: t if name == embedding else cast(t) for name, t in policy_weights(model)}
        if "lm_head.weight" in weights:
            weights.pop(embedding, None)
        elif embedding in weights:
            weights[embedding] = cast(weights[embedding])
        n_layers, model_dtype = config.num_hidden_layers, base.model.norm.weight.dtype
        self.norms = [tuple(weights.pop(f"model.layers.{i}.{n}.weight").float()
                            for n in ("input_layernorm", "post_attention_layernorm")) for i in range(n_layers)]
        self.norm = weights.pop("model.norm.weight").float()
        head_name = embedding if embedding in weights else "lm_head.weight"
        self.products = self._choose_products(weights, n_layers, head_name, model_dtype,
                                              full_model=plain_model(model) is model, on_cpu=on_cpu, kernel=kernel,
                                              choice=multiply)
        # with covey's kernel, a decode step's layers run in one call of it
        self.layer_stack = (decode_kernel.LayerStack([layer_parts(weights.get, i) for i in range(n_layers)],
                                                     self.norms, self.n_heads, self.n_kv_heads, self.head_dim,
                                                     self.eps, self.scale)
                            if self.products_for(1).kind == "kernel" else None)
        self.cache_dtype = torch.float32 if self.layer_stack is not None else dtype  # of rotary and cache too
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0  # cache positions filled
        self.valid_BL: torch.Tensor | None = None  # (B, max_length) which cache positions hold real tokens
        # with the kernel, row b's cache is row slots_B[b] of keys/values: rows leave without a copy; its
        # prompt's positions (the first prefix_length) are row prefix_slots_B[b], shared by its group, and
        # the first prompt_slots rows of keys/values are the prompts'
        self.slots_B: torch.Tensor | None = None
        self.prefix_slots_B: torch.Tensor | None = None
        self.prefix_length = self.prompt_slots = 0

    def _choose_products(self, weights: dict, n_layers: int, head_name: str, model_dtype: torch.dtype,
                         full_model: bool, on_cpu: bool, kernel: bool, choice: str) -> list[tuple[int, Products]]:
        """(fewest rows, products) from the most rows down: the first that fits a forward runs it.
        ``kernel``: whether covey's kernel runs here in this dtype."""
        if kernel and self.dtype == torch.bfloat16:  # AMX sums forwards of any rows at the pace of the stream
            return [(1, Products.build(weights.get, n_layers, head_name, decode_kernel.matrices, "kernel"))]
        onednn = prepacked_linear(self.dtype) if on_cpu and choice in ("fastest", "prepacked") else None
        if self.dtype != model_dtype or (onednn is not None and not kernel and not full_model):
            # the matrices are new copies anyway (cast, or a LoRA policy's merged ones): fuse them, lay them
            # out for oneDNN, and take each once, so that the unfused copies are freed as we go
            def take(name):
                return weights.pop(name).to(self.dtype) if name in weights else None
            kind = "prepacked" if onednn else "plain"
            return [(1, Products.build(take, n_layers, head_name, linear_products(True, onednn), kind))]
        # the model's own matrices (or a LoRA policy's merged ones), as they are
        plain = Products.build(weights.get, n_layers, head_name, linear_products(False, None), "plain")
        if kernel:  # in float32, on those same matrices, for decode steps
            return [(decode_kernel.MAX_ROWS + 1, plain),
                    (1, Products.build(weights.get, n_layers, head_name, decode_kernel.matrices, "kernel"))]
        # for steps with many rows, a fused prepacked copy beside the model's own matrices (a full model's
        # optimizer state outweighs it)
        if onednn is not None:
            packed = Products.build(weights.get, n_layers, head_name, linear_products(True, onednn), "prepacked")
            return [(PREPACKED_FLOAT32_FROM_ROWS if self.dtype == torch.float32 else 1, packed), (1, plain)]
        return [(1, plain)]

    def products_for(self, rows: int) -> Products:
        """The matrices a forward over ``rows`` positions multiplies by."""
        return next(products for fewest, products in self.products if rows >= fewest)

    # ---- the three calls ----------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, ids_NP: torch.Tensor, mask_NP: torch.Tensor, positions_NP: torch.Tensor,
                repeats: int) -> torch.Tensor:
        """Run the N prompts once, then give each ``repeats`` rows of cache. Logits (N * repeats, V)."""
        N, P = ids_NP.shape
        device = ids_NP.device
        # with the kernel, the rows of a group read their prompt's positions from its one copy: the cache holds
        # the N prompts, then a row for each sample (whose positions before P are never read)
        self.prompt_slots = N if self.layer_stack is not None else 0
        shape = (self.prompt_slots + N * repeats if self.prompt_slots else N, self.n_kv_heads, self.max_length, self.head_dim)
        new = torch.empty if self.prompt_slots else torch.zeros
        self.keys = [new(shape, dtype=self.cache_dtype, device=device) for _ in self.norms]
        self.values = [new(shape, dtype=self.cache_dtype, device=device) for _ in self.norms]
        self.valid_BL = torch.zeros(N, self.max_length, dtype=torch.bool, device=device)
        self.valid_BL[:, :P] = mask_NP.bool()
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        # every query may see itself, so the padding positions never attend to nothing (NaN)
        attend = (causal & self.valid_BL[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=device)
        logits = self._forward(ids_NP, positions_NP, attend[:, None])[:, -1]  # into the first N rows: the prompts'
        if self.prompt_slots:
            self.prefix_slots_B = torch.arange(N, dtype=torch.int32).repeat_interleave(repeats)
            self.slots_B = N + torch.arange(N * repeats, dtype=torch.int32)
            self.prefix_length = P
            self.valid_BL = self.valid_BL.repeat_interleave(repeats, dim=0)
        else:
            self.slots_B = torch.arange(N, dtype=torch.int32)
            if repeats > 1:
                self.keep(torch.arange(N, device=device).repeat_interleave(repeats))
        return logits.repeat_interleave(repeats, dim=0)

    @torch.no_grad()
    def step(self, ids_B: torch.Tensor, positions_B: torch.Tensor) -> torch.Tensor:
        """One new token per row. Logits (B, V)."""
        self._check_room(1)
        self.valid_BL[:, self.length] = True
        if self.layer_stack is not None:
            x = self.embed(ids_B).float()
            cos, sin = (t[:, 0].contiguous() for t in self.rotary(x, positions_B[:, None]))
            self.layer_stack.step(x, cos, sin, self.valid_BL, self.slots_B, self.length, self.keys, self.values,
                                  self.prefix_slots_B, self.prefix_length)
            self.length += 1
            return self.products_for(len(ids_B)).head(self._rms_norm(x, self.norm)).float()
        attend = self.valid_BL[:, None, None, : self.length + 1]
        return self._forward(ids_B[:, None], positions_B[:, None], attend)[:, -1]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows of the cache (in this order; an index may repeat)."""
        self.valid_BL = self.valid_BL[rows]
        if self.prompt_slots:
            self.prefix_slots_B = self.prefix_slots_B[rows.cpu()]
            if len(rows.unique()) == len(rows):
                # the kernel's steps read each row's cache where it lies (the only forwards that follow;
                # a prefill starts a new cache)
                self.slots_B = self.slots_B[rows.cpu()]
                return
        # a copy of the rows kept (the prompts' first, as they are)
        kept = torch.cat([torch.arange(self.prompt_slots), self.slots_B[rows.cpu()].long()]).to(rows.device)
        self.keys = [k[kept] for k in self.keys]
        self.values = [v[kept] for v in self.values]
        self.slots_B = self.prompt_slots + torch.arange(len(rows), dtype=torch.int32)

    # ---- the model ----------------------------------------------------------------------------

    def _forward(self, ids_BS: torch.Tensor, positions_BS: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        B, S = ids_BS.shape
        self._check_room(S)
        start, end = self.length, self.length + S
        x = self.embed(ids_BS).float()
        cos, sin = (t[:, :, None].to(self.cache_dtype) for t in self.rotary(x, positions_BS))  # (B, S, 1, head_dim)
        half = self.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)  # so that rotate_half(t) * sin = t.roll(half) * sin
        n_qk = (self.n_heads + self.n_kv_heads) * self.head_dim
        products = self.products_for(B * S)
        for i, (layer, (attn_norm, mlp_norm)) in enumerate(zip(products.layers, self.norms)):
            qkv = layer["qkv"](self._rms_norm(x, attn_norm))
            # rotary embedding of the query and key heads at once, straight from the projection
            qk = qkv[..., :n_qk].view(B, S, -1, self.head_dim)
            qk = (qk * cos + qk.roll(half, -1) * sin).transpose(1, 2)
            q, k = qk.split([self.n_heads, self.n_kv_heads], 1)
            v = qkv[..., n_qk:].view(B, S, -1, self.head_dim).transpose(1, 2)
            self.keys[i][:B, :, start:end] = k  # the first B rows of the cache (all of it but in a prefill with the kernel)
            self.values[i][:B, :, start:end] = v
            attn = F.scaled_dot_product_attention(q, self.keys[i][:B, :, :end], self.values[i][:B, :, :end],
                                                  attn_mask=attend, scale=self.scale, enable_gqa=True)
            x = x + layer["o"](attn.transpose(1, 2).reshape(B, S, -1))
            gate, up = layer["gate_up"](self._rms_norm(x, mlp_norm)).chunk(2, -1)
            x = x + layer["down"](F.silu(gate) * up)
        self.length = end
        return products.head(self._rms_norm(x, self.norm)).float()

    def _check_room(self, new_positions: int) -> None:
        if self.length + new_positions > self.max_length:
            raise ValueError(f"the decoder's cache holds {self.max_length} positions; "
                             f"{self.length + new_positions} were asked for")

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the float32 stream ``x``, handed on in the matrix dtype."""
        return F.rms_norm(x, weight.shape, weight, self.eps).to(self.dtype)


class ModelDecoder:
    """The same three calls over the model's own forward and a ``DynamicCache``."""

    def __init__(self, model: torch.nn.Module):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=getattr(plain_model(model), "config", None))
        self.cache_keyword = cache_keyword(model)
        self.attention_BL: torch.Tensor | None = None

    def _forward(self, **inputs) -> torch.Tensor:
        out = self.model(**inputs, **{self.cache_keyword: self.cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    @torch.no_grad()
    def prefill(self, ids_NP, mask_NP, positions_NP, repeats: int) -> torch.Tensor:
        logits = self._forward(input_ids=ids_NP, attention_mask=mask_NP, position_ids=positions_NP)
        if repeats > 1:  # reorder_cache: every kind of layer has it (a hybrid model's linear attention too)
            self.cache.reorder_cache(torch.arange(len(ids_NP), device=ids_NP.device).repeat_interleave(repeats))
        self.attention_BL = mask_NP.repeat_interleave(repeats, dim=0)
        return logits.repeat_interleave(repeats, dim=0)

    @torch.no_grad()
    def step(self, ids_B, positions_B) -> torch.Tensor:
        self.attention_BL = torch.cat([self.attention_BL, torch.ones_like(self.attention_BL[:, :1])], dim=1)
        return self._forward(input_ids=ids_B[:, None], attention_mask=self.attention_BL,
                             position_ids=positions_B[:, None])

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.reorder_cache(rows)
        self.attention_BL = self.attention_BL[rows]
