"""The trainer's forward passes: per-token log-probs of completions under a model.

The completion tokens of each row follow its (left-padded) prompt. Only the logits that predict
real completion tokens are turned into log-probs, after division by the sampling temperature, so
they are those of the distribution the completions were drawn from.

The G completions of a group share one prompt, so by default the prompt is run once per group
and its keys and values are handed to each completion (gradients flow back through them into the
shared prefix). The completions of a group are then packed end to end into as few rows as fit the
longest one, each attending only to the prompt and to itself, so padding costs almost nothing:
the same numbers as running every row in full, for a fraction of the work.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from covey.core import TokenDistribution
from covey.models import cache_keyword, is_sharded, plain_model
from covey.train.head import check_head, head_logprobs
from covey.vision import PromptImages, backbone, model_inputs, picture_errors

PACKED_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # each tested equal to the unpacked forward


@dataclass(frozen=True)
class SequenceBatch:
    """Prompt + completion token ids of a set of rows, ready for a forward pass."""

    prompt_ids_BP: torch.Tensor  # (B, P) left-padded
    prompt_mask_BP: torch.Tensor  # (B, P) 1 on prompt tokens
    completion_ids_BT: torch.Tensor  # (B, T) right-padded
    completion_mask_BT: torch.Tensor  # (B, T) 1 on generated tokens (EOS included)
    # a vision-language model's prompts: each row's pictures as the model takes them (None: no row has any)
    images: tuple[PromptImages | None, ...] | None = None

    def rows(self, index: slice) -> "SequenceBatch":
        """A subset of rows with the padding columns they all share removed."""
        prompt_mask = self.prompt_mask_BP[index]
        completion_mask = self.completion_mask_BT[index]
        first = int((prompt_mask.sum(0) > 0).nonzero()[0]) if prompt_mask.any() else prompt_mask.shape[1]
        last = int(completion_mask.sum(1).max())
        return SequenceBatch(self.prompt_ids_BP[index, first:], prompt_mask[:, first:],
                             self.completion_ids_BT[index, :last], completion_mask[:, :last],
                             None if self.images is None else self.images[index])

    def prompt_groups(self) -> torch.Tensor:
        """For each row, the index of its run of consecutive rows with the same prompt. (B,)"""
        same = (self.prompt_ids_BP[1:] == self.prompt_ids_BP[:-1]).all(1) & \
               (self.prompt_mask_BP[1:] == self.prompt_mask_BP[:-1]).all(1)
        return torch.cat([torch.zeros(1, dtype=torch.long), (~same).long().cumsum(0)])


class TrainingForward(torch.nn.Module):
    """``completion_logprobs`` of ``model`` as a module's forward: the pass that torch's distributed
    engines wrap whole (its calls into the model's parts, for the shared prompts and the packed head,
    included). DistributedDataParallel sums the gradients of the training pass while the backward runs;
    under FSDP2 it is the root unit (``covey.train.sharding``), and every pass of the model goes through it."""

    def __init__(self, model: torch.nn.Module, logprob_budget_bytes: int | None = None):
        super().__init__()
        self.model = model
        self.logprob_budget_bytes = logprob_budget_bytes  # the head's chunk (None: core.LOGPROB_CHUNK_BYTES)

    def forward(self, batch: SequenceBatch, temperature: float | TokenDistribution, with_entropy: bool = True,
                entropy_grad: bool = False, router_aux_loss: bool = False) -> tuple[torch.Tensor, ...]:
        return completion_logprobs(self.model, batch, temperature, with_entropy=with_entropy,
                                   entropy_grad=entropy_grad, router_aux_loss=router_aux_loss,
                                   logprob_budget_bytes=self.logprob_budget_bytes)


def completion_logprobs(model: torch.nn.Module, batch: SequenceBatch, temperature: float | TokenDistribution = 1.0,
                        with_entropy: bool = False, share_prompt: bool = True, pack: bool = True,
                        float32_attention: bool = True, entropy_grad: bool = False, router_aux_loss: bool = False,
                        logprob_budget_bytes: int | None = None) -> tuple[torch.Tensor, ...]:
    """(logp_BT, entropy_BT or None) of the completion tokens under ``temperature`` (a number, or the whole
    distribution sampled from: ``core.TokenDistribution``); 0 at padding positions. ``share_prompt``
    and ``pack`` (where the model allows it) only change the work done, not the numbers;
    ``float32_attention``: an SDPA model on CPU attends in float32 whatever autocast says;
    ``entropy_grad``: the entropy carries its gradient (for an entropy bonus); ``router_aux_loss``: a
    mixture-of-experts model's load-balancing loss over the rows comes third (every row then runs in full,
    the router seeing each prompt once per row, as in transformers' own forward). The output head runs on
    a few tokens at a time (``covey.train.head``, as many as have float32 logits within
    ``logprob_budget_bytes``): the logits of all the tokens are never held at once."""
    device = next(model.parameters()).device
    pack = pack and _packable(model)
    # a checkpointed layer recomputes its forward in the backward, outside this call: the attention must be
    # the same there, so it stays the model's own
    float32_attention = float32_attention and not _checkpointing(model)
    aux: list[torch.Tensor] = []  # the router's loss, where asked
    with _float32_attention(model) if float32_attention else contextlib.nullcontext():
        # the same few tokens whatever the batch (even none): every process of a sharded model runs the same check
        check_head(model, torch.arange(4, device=device).unsqueeze(0))
        if batch.images is not None:  # the pictures' features stand in the prompts: every row runs whole
            hidden_NH, rows_N, cols_N = _every_row_with_images(model, batch)
        elif router_aux_loss:
            hidden_NH, rows_N, cols_N = _every_row_in_full(model, batch, aux)
        else:
            hidden_NH, rows_N, cols_N = completion_hidden_states(model, batch, share_prompt, pack)
    ids_N = batch.completion_ids_BT[rows_N, cols_N].to(device)
    logp_N, entropy_N = head_logprobs(model, hidden_NH, ids_N, temperature, with_entropy, entropy_grad=entropy_grad,
                                      budget=logprob_budget_bytes)
    at = (rows_N.to(device), cols_N.to(device))
    zeros_BT = torch.zeros(batch.completion_ids_BT.shape, device=device)
    return zeros_BT.index_put(at, logp_N), None if entropy_N is None else zeros_BT.index_put(at, entropy_N), *aux


def completion_hidden_states(model: torch.nn.Module, batch: SequenceBatch, share_prompt: bool = True,
                             pack: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden_NH, rows_N, cols_N): the decoder's final hidden states that predict each real completion
    token (row, column), for the output head to turn into logits. ``pack``: pack the completions (only
    for a model ``_packable`` accepts)."""
    device = next(model.parameters()).device
    group_B = batch.prompt_groups()
    # checkpointed layers drop the KV cache while gradients are on, so sharing would lose the prompt; a
    # hybrid model's recurrent layers keep a state, not keys and values, for the completions to attend to
    if (not share_prompt or _checkpointing(model) or int(group_B[-1]) + 1 == len(group_B)
            or _has_recurrent_layers(model)):
        return _every_row_in_full(model, batch)
    with _sparse_tied_embedding_gradient(model) if pack else contextlib.nullcontext():
        prompts = _SharedPrompts.run(model, batch, group_B)
        lengths_B = batch.completion_mask_BT.sum(1)
        started_B = (lengths_B > 0).nonzero().squeeze(1)
        # each prompt's last position predicts its completions' first token
        outputs = [prompts.last_hidden[group_B[started_B].to(device)]]
        rows, cols = [started_B], [torch.zeros_like(started_B)]
        # every completion token but the last attends to its group's prompt keys and values
        if int(lengths_B.max()) > 1:
            rest, rest_rows, rest_cols = (_packed_completions if pack else _padded_completions)(model, batch, prompts)
            outputs.append(rest)
            rows.append(rest_rows)
            cols.append(rest_cols)
    return torch.cat(outputs), torch.cat(rows), torch.cat(cols)


@contextlib.contextmanager
def _sparse_tied_embedding_gradient(model: torch.nn.Module):
    """For a pass whose output head then runs on the same (trainable) matrix as the input embedding:
    the embedding lookups hand back sparse gradients (the rows looked up), which autograd adds into
    the head's dense one, instead of a dense zero-filled copy of the whole table per lookup. The
    same gradient (tested), and about 0.1 s less per lookup for the default model on CPU."""
    base = plain_model(model)
    embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
    tied = isinstance(embedding, torch.nn.Embedding) and getattr(head, "weight", None) is embedding.weight
    # a sharded model's gradients are reduce-scattered dense
    if not (torch.is_grad_enabled() and tied and embedding.weight.requires_grad) or embedding.sparse or \
            is_sharded(base):
        yield
        return
    embedding.sparse = True  # read when the lookup runs; its backward keeps the choice
    try:
        yield
    finally:
        embedding.sparse = False


def _every_row_in_full(model: torch.nn.Module, batch: SequenceBatch, router_aux_loss: list | None = None):
    """Prompt and completion of every row in one forward (no sharing); hidden states as
    ``completion_hidden_states``. ``router_aux_loss``: a list that gets the model's load-balancing loss (a
    mixture-of-experts model): the model's own forward then runs, its head on no position at all, and the
    decoder's output is taken on its way to the head."""
    device = next(model.parameters()).device
    P = batch.prompt_ids_BP.shape[1]
    input_ids = torch.cat([batch.prompt_ids_BP, batch.completion_ids_BT], dim=1)
    attention_mask = torch.cat([batch.prompt_mask_BP, batch.completion_mask_BT], dim=1)
    # positions count real tokens only, exactly as generation numbers them under left padding
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    inputs = dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                  position_ids=position_ids.to(device), use_cache=False)
    decoder = plain_model(model).get_decoder()
    if router_aux_loss is None:
        hidden = decoder(**inputs).last_hidden_state
    else:
        taken = []
        hook = decoder.register_forward_hook(lambda module, args, output: taken.append(output.last_hidden_state))
        try:
            outputs = model(**inputs, output_router_logits=True,
                            logits_to_keep=torch.zeros(0, dtype=torch.long, device=device))
        finally:
            hook.remove()
        hidden = taken[-1]
        router_aux_loss.append(outputs.aux_loss)
    rows_N, cols_N = batch.completion_mask_BT.nonzero(as_tuple=True)
    # position P - 1 + t predicts completion token t
    return hidden[rows_N.to(device), (cols_N + P - 1).to(device)], rows_N, cols_N


def _every_row_with_images(model: torch.nn.Module, batch: SequenceBatch):
    """A vision-language model's pass over rows whose prompts show pictures: prompt and completion of every
    row in one forward of the backbone (vision tower, projector and language model) with each row's pixel
    inputs, exactly as sampling gave them; hidden states as ``completion_hidden_states``. Positions are the
    model's own where it computes them from the pictures (Qwen-VL's 3-D rotary positions), else they count
    real tokens only, as generation numbers them under left padding."""
    device = next(model.parameters()).device
    P, T = batch.prompt_ids_BP.shape[1], batch.completion_ids_BT.shape[1]
    input_ids = torch.cat([batch.prompt_ids_BP, batch.completion_ids_BT], dim=1)
    attention_mask = torch.cat([batch.prompt_mask_BP, batch.completion_mask_BT], dim=1)
    inner = backbone(plain_model(model))
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask,
                  **model_inputs(batch.images, batch.prompt_mask_BP, T))
    if not hasattr(inner, "get_rope_index"):
        inputs["position_ids"] = (attention_mask.cumsum(1) - 1).clamp(min=0)
    dtype = next(model.parameters()).dtype
    inputs = {key: value.to(device, dtype=dtype if value.is_floating_point() else value.dtype)
              for key, value in inputs.items()}
    with picture_errors():
        hidden = inner(**inputs, use_cache=False).last_hidden_state
    rows_N, cols_N = batch.completion_mask_BT.nonzero(as_tuple=True)
    return hidden[rows_N.to(device), (cols_N + P - 1).to(device)], rows_N, cols_N


@dataclass
class _SharedPrompts:
    """Each distinct prompt of a batch run once: the keys and values its completions attend to."""

    group_B: torch.Tensor  # (B,) each row's prompt
    prompt_mask: torch.Tensor  # (prompts, P) their attention masks
    cache: Any  # transformers' DynamicCache over the prompts
    cache_keyword: str
    last_hidden: torch.Tensor  # (prompts, H) the decoder's final hidden state at each one's last position

    @classmethod
    def run(cls, model: torch.nn.Module, batch: SequenceBatch, group_B: torch.Tensor):
        from transformers import DynamicCache

        device = next(model.parameters()).device
        first_row = torch.cat([torch.zeros(1, dtype=torch.long),
                               (group_B[1:] != group_B[:-1]).nonzero().squeeze(1) + 1])
        ids, mask = batch.prompt_ids_BP[first_row], batch.prompt_mask_BP[first_row]
        cache, key = DynamicCache(config=model.config), cache_keyword(model)
        inputs = dict(input_ids=ids.to(device), attention_mask=mask.to(device),
                      position_ids=(mask.cumsum(1) - 1).clamp(min=0).to(device), use_cache=True, **{key: cache})
        last = plain_model(model).get_decoder()(**inputs).last_hidden_state[:, -1]
        return cls(group_B, mask, cache, key, last)

    def select_rows(self, prompt_R: torch.Tensor) -> None:
        """The cache holds, for each of R rows, the keys and values of prompt ``prompt_R[r]``. Through
        ``index_select``, whose backward adds up each prompt's repeats in a fixed order, so gradients
        are the same from run to run (the indexing the cache itself uses accumulates them in parallel
        on CPU, in an order that varies)."""
        from transformers.cache_utils import DynamicLayer

        for layer in self.cache.layers:
            if type(layer) is DynamicLayer and layer.keys is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys.index_select(0, prompt_R), layer.values.index_select(0, prompt_R)
            else:
                layer.batch_select_indices(prompt_R)


def _padded_completions(model, batch: SequenceBatch, prompts: _SharedPrompts):
    """One row per completion, padded to the longest (for models that cannot take a packing mask). The
    decoder's hidden states at the real slots."""
    device = next(model.parameters()).device
    T = batch.completion_ids_BT.shape[1]
    group_B = prompts.group_B
    prompts.select_rows(group_B.to(device))
    attention_mask = torch.cat([prompts.prompt_mask[group_B], batch.completion_mask_BT], dim=1)[:, :-1]
    positions = prompts.prompt_mask.sum(1)[group_B].unsqueeze(1) + torch.arange(T - 1).unsqueeze(0)
    hidden = plain_model(model).get_decoder()(
        input_ids=batch.completion_ids_BT[:, :-1].to(device), attention_mask=attention_mask.to(device),
        position_ids=positions.to(device), use_cache=True, **{prompts.cache_keyword: prompts.cache}).last_hidden_state
    rows_N, cols_N = batch.completion_mask_BT[:, 1:].nonzero(as_tuple=True)
    return hidden[rows_N.to(device), cols_N.to(device)], rows_N, cols_N + 1


def _packed_completions(model, batch: SequenceBatch, prompts: _SharedPrompts):
    """The completions of each group packed end to end into rows as long as the longest one. The
    decoder's hidden states at the real slots (the output head is left to the caller).

    Token t of completion b sits at (row_b, offset_b + t - 1) of its packed row and predicts token
    t; a block-diagonal causal mask keeps each completion to its group's prompt and itself.
    """
    device = next(model.parameters()).device
    group_B, prompt_mask = prompts.group_B, prompts.prompt_mask
    inputs_B = (batch.completion_mask_BT.sum(1) - 1).clamp(min=0)  # tokens fed: all but the last
    capacity = int(inputs_B.max())
    row_B, offset_B, row_group_R = _first_fit(inputs_B.tolist(), group_B.tolist(), capacity)
    R = len(row_group_R)
    b_N, t_N = (torch.arange(capacity).unsqueeze(0) < inputs_B.unsqueeze(1)).nonzero(as_tuple=True)
    r_N, c_N = torch.tensor(row_B)[b_N], torch.tensor(offset_B)[b_N] + t_N
    row_group_R = torch.tensor(row_group_R)
    input_ids = torch.zeros(R, capacity, dtype=torch.long)
    input_ids[r_N, c_N] = batch.completion_ids_BT[b_N, t_N]
    positions = torch.zeros(R, capacity, dtype=torch.long)
    positions[r_N, c_N] = prompt_mask.sum(1)[group_B[b_N]] + t_N
    owner_RC = torch.full((R, capacity), -1)  # the completion each packed slot belongs to; -1 is padding
    owner_RC[r_N, c_N] = b_N
    attention_mask = _packing_mask(model, owner_RC, prompt_mask[row_group_R])
    prompts.select_rows(row_group_R.to(device))
    hidden = plain_model(model).get_decoder()(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), position_ids=positions.to(device),
        use_cache=True, **{prompts.cache_keyword: prompts.cache}).last_hidden_state
    return hidden[r_N.to(device), c_N.to(device)], b_N, t_N + 1


def _packing_mask(model, owner_RC: torch.Tensor, prompt_mask_RP: torch.Tensor) -> torch.Tensor:
    """(R, 1, C, P + C) attention mask of packed rows: each slot sees its row's prompt and the slots
    of its own completion up to itself. Boolean, or additive where the model's attention is eager."""
    C = owner_RC.shape[1]
    same_completion = (owner_RC.unsqueeze(2) == owner_RC.unsqueeze(1)) & torch.ones(C, C, dtype=torch.bool).tril()
    sees_prompt = prompt_mask_RP.bool().unsqueeze(1) & (owner_RC >= 0).unsqueeze(2)
    allowed = torch.cat([sees_prompt, same_completion], dim=2).unsqueeze(1)
    if model.config._attn_implementation == "eager":  # eager attention adds its mask to the scores
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


# PyTorch's CPU backward of bfloat16 SDPA takes about twice as long as the float32 one at the shapes of
# these passes (queries of ~64 tokens, keys of ~64-200; measured with torch 2.13), so on CPU every
# log-prob pass of an SDPA model attends in float32: more exact, faster to train, and the no-grad
# passes (old and reference log-probs) compute the very function the training pass does.
_FLOAT32_SDPA = "sdpa_float32_on_cpu"


def _sdpa_float32_on_cpu(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, on CPU in float32 whatever autocast or the weights' dtype say
    (under autocast the queries and keys arrive in float32 from the rotary embedding and the values
    in bfloat16; SDPA would cast all three down). The output keeps the values' dtype."""
    if query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(value.dtype), weights


AttentionInterface.register(_FLOAT32_SDPA, _sdpa_float32_on_cpu)
AttentionMaskInterface.register(_FLOAT32_SDPA, sdpa_mask)


def _has_recurrent_layers(model: torch.nn.Module) -> bool:
    """Whether the model's cache holds a recurrent state in some layer (a hybrid of attention and linear
    attention or state-space layers, such as Nemotron-H or Qwen3-Next); read once per model config."""
    config = getattr(plain_model(model), "config", None)
    if config is None:
        return False
    seen = _RECURRENT.get(id(config))
    if seen is None or seen[0]() is not config:  # configs are not hashable: by id, while the same one lives
        seen = _RECURRENT[id(config)] = (weakref.ref(config), _cache_has_recurrent_layers(config))
    return seen[1]


_RECURRENT: dict[int, tuple[weakref.ref, bool]] = {}  # id(model config) -> (the config, _has_recurrent_layers)


def _cache_has_recurrent_layers(config: Any) -> bool:
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # a model whose config the cache cannot read: transformers decides in its forward
        return False
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers)


def _checkpointing(model: torch.nn.Module) -> bool:
    """Whether this forward checkpoints layers (gradient_checkpointing, with gradients on)."""
    return torch.is_grad_enabled() and model.training and any(
        getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


@contextlib.contextmanager
def _float32_attention(model: torch.nn.Module):
    """An SDPA model attends through ``_sdpa_float32_on_cpu`` (same masks) for the duration."""
    config = model.config
    before = getattr(config, "_attn_implementation", None)
    if before != "sdpa":
        yield
        return
    config._attn_implementation = _FLOAT32_SDPA
    try:
        yield
    finally:
        config._attn_implementation = before


def _first_fit(lengths: list[int], groups: list[int], capacity: int) -> tuple[list[int], list[int], list[int]]:
    """Pack sequences into rows of ``capacity`` slots, only sequences of the same group sharing a row
    (first fit, longest first). Returns each sequence's row and offset, and each row's group."""
    row_of, offset_of = [0] * len(lengths), [0] * len(lengths)
    row_group: list[int] = []
    row_used: list[int] = []
    for b in sorted(range(len(lengths)), key=lambda b: (groups[b], -lengths[b])):
        if lengths[b] == 0:
            continue
        row = next((r for r in range(len(row_group))
                    if row_group[r] == groups[b] and row_used[r] + lengths[b] <= capacity), None)
        if row is None:
            row_group.append(groups[b])
            row_used.append(0)
            row = len(row_group) - 1
        row_of[b], offset_of[b] = row, row_used[row]
        row_used[row] += lengths[b]
    return row_of, offset_of, row_group


def _packable(model: torch.nn.Module) -> bool:
    """Whether the model applies a custom (block-diagonal) attention mask as given: one of the
    architectures tested so, with SDPA or eager attention and no sliding-window layers (whose window
    a custom mask would drop). Others (ALiBi models build their bias from a 2D mask) run padded."""
    config = model.config
    if config.model_type not in PACKED_ARCHITECTURES or \
            getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False
