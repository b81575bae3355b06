"""The output head and the log-softmax, chunk by chunk: each completion token's log-prob (and entropy)
from the decoder's final hidden states, without ever holding the logits of all N tokens.

    logits_c = transform(hidden_c @ W.T + b)           the chunk's logits, in the head's compute dtype
    logp_c, H_c = log_softmax(logits_c / t)[ids_c]     after the temperature (and truncation), in float32

``transform`` is what a model's own forward does after its head: Gemma's final-logit softcapping,
Cohere's logit scale, Granite's logits scaling (``logits_transform``). Where there is no transform and no
truncation of the distribution (a "plain" chunk) the head makes the softmax itself; else through
``core.token_logprobs``. Both take their gradient from the one hand-written backward of the log-softmax,
``core.softmax_backward``.

A chunk is as many tokens as have float32 logits within the pass's budget (``logprob_budget_mib``, by
default ``core.LOGPROB_CHUNK_BYTES``), so a small micro-batch runs in one. Inside a chunk, a few rows at a
time become float32 (log-)softmaxes (``PLAIN_WORKING_SHARE``, ``CORE_WORKING_SHARE``). A linear head runs
in ``_ChunkedLinearHead``, which keeps, within the same budget, what the last chunks' backward starts from
and computes the others' logits again (what each of its ways gains against the simpler one:
``benchmarks/head_strategies.py``, docs/training.md). Any other head (a LoRA adapter on it, or a copy that
``lora_modules_to_save`` trains) runs as the module it is, each chunk under ``torch.utils.checkpoint``.
Both compose with autocast, DDP and FSDP2 (the head's parameters are those the caller's pass gathered).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from covey import core
from covey.core import (LOGPROB_CHUNK_BYTES, TokenDistribution, logprob_chunk_tokens, logprob_working_rows,
                        token_logprobs)
from covey.errors import ModelError
from covey.models import Float32Head, plain_model

PLAIN_WORKING_SHARE = 4
"""The plain softmax makes a quarter of a chunk's rows into a float32 log-softmax at once
(``core.logprob_working_rows``), one such copy at a time beside the chunk's logits, so the pass's peak is
a chunk and a quarter (the plan's ``logprob_pass_bytes`` counts the same)."""

CORE_WORKING_SHARE = 16
"""Through ``core.token_logprobs`` (a transform after the head, or a truncated distribution) a sixteenth:
it holds up to about eight float32-sized copies of its rows at once (counted on a top-k and top-p
distribution: the scaled logits, the truncation's sort, its int64 order and masks, the log-softmax), and
three for the temperature alone, so a sixteenth keeps them within about half a chunk."""


@dataclass(frozen=True)
class LinearHead:
    """A linear output head as the log-prob pass computes it: ``transform(F.linear(hidden, weight, bias))``
    in ``dtype`` (autocast's, float32 for ``cast_lm_head_to_fp32``, else the weight's)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype
    transform: Callable[[torch.Tensor], torch.Tensor] | None

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``hidden`` (any leading shape); ``weight``: the weight already cast to ``dtype``."""
        weight = self.weight.to(self.dtype) if weight is None else weight
        bias = None if self.bias is None else self.bias.to(self.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            logits = torch.nn.functional.linear(hidden.to(self.dtype), weight, bias)
            return logits if self.transform is None else self.transform(logits)


def logits_transform(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the model's forward does to its head's output, read from its config (the same operations in
    the same order as transformers' Gemma2/3, Cohere and Granite models), or None."""
    scale = getattr(config, "logit_scale", None) if config.model_type.startswith("cohere") else None
    divisor = getattr(config, "logits_scaling", None) if config.model_type.startswith("granite") else None
    cap = getattr(config, "final_logit_softcapping", None)
    if scale is None and divisor is None and cap is None:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if divisor is not None:
            logits = logits / divisor
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform


def head_logprobs(model: torch.nn.Module, hidden_NH: torch.Tensor, ids_N: torch.Tensor, temperature: float | TokenDistribution = 1.0,
                  with_entropy: bool = False, entropy_grad: bool = False, chunk: int | None = None,
                  budget: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp_N, entropy_N or None) of tokens ``ids_N`` after final hidden states ``hidden_NH``, under
    ``model``'s output head, ``chunk`` tokens at a time (default: as many as ``budget`` bytes of float32
    logits hold, ``LOGPROB_CHUNK_BYTES``); a pass with a gradient keeps, for as many chunks as have float32
    logits within the same budget, what their backward starts from. The entropy carries a gradient only
    with ``entropy_grad``."""
    budget = LOGPROB_CHUNK_BYTES if budget is None else budget
    head = plain_model(model).get_output_embeddings()
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    chunk = chunk or logprob_chunk_tokens(vocab, budget)
    transform = logits_transform(plain_model(model).config)
    entropy = with_entropy or entropy_grad
    if type(head) in (torch.nn.Linear, Float32Head):
        linear = LinearHead(head.weight, head.bias, _compute_dtype(head, hidden_NH), transform)
        grad = torch.is_grad_enabled() and (hidden_NH.requires_grad or head.weight.requires_grad
                                            or (head.bias is not None and head.bias.requires_grad))
        frozen = grad and hidden_NH.requires_grad and not (head.weight.requires_grad or
                                                           (head.bias is not None and head.bias.requires_grad))
        distribution = temperature if isinstance(temperature, TokenDistribution) else TokenDistribution(temperature)
        run = _Pass(linear, distribution, entropy, entropy_grad, _Chunks(len(ids_N), chunk, budget if grad else 0, vocab),
                    frozen)
        logp_N, entropy_N = _ChunkedLinearHead.apply(hidden_NH, linear.weight, linear.bias, ids_N, run)
    else:
        logp_N, entropy_N = _chunked_module_head(head, transform, hidden_NH, ids_N, temperature, entropy,
                                                 entropy_grad, chunk)
    return logp_N, entropy_N if entropy else None


def _compute_dtype(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.dtype:
    """The dtype the model's own head computes in: float32 (cast_lm_head_to_fp32), autocast's, else the weight's."""
    if isinstance(head, Float32Head):
        return torch.float32
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype


@dataclass(frozen=True)
class _Chunks:
    """The pass's chunks of ``tokens`` rows, ``size`` at a time, and how many of them (the last ``kept``)
    keep what their backward starts from: those whose float32 logits fit ``keep_bytes`` (with ``size`` from
    the same budget, the last whole chunk)."""

    tokens: int
    size: int
    keep_bytes: int
    vocab: int

    @property
    def slices(self) -> list[slice]:
        """The short chunk (where ``size`` does not divide ``tokens``) first, so the last ones, which are kept,
        are whole."""
        short = self.tokens % self.size
        return [slice(0, short)] * bool(short) + _chunks(self.tokens - short, self.size, short)

    def working_rows(self, share: int) -> int:
        """Rows of a chunk made into float32 (log-)softmaxes at once (``core.logprob_working_rows``)."""
        return logprob_working_rows(self.size, self.vocab, share)

    @property
    def kept(self) -> int:
        held, kept = 0, 0
        for rows in reversed(self.slices):
            held += (rows.stop - rows.start) * self.vocab * 4
            if held > self.keep_bytes:
                break
            kept += 1
        return kept


@dataclass(frozen=True)
class _Pass:
    """What one chunked pass through a linear head is asked for, beside its tensors."""

    head: LinearHead
    distribution: TokenDistribution
    with_entropy: bool  # the entropies are made
    entropy_grad: bool  # and carry a gradient (the entropy bonus)
    plan: _Chunks
    frozen: bool  # only the hidden states take a gradient (a LoRA adapter elsewhere): the forward keeps slopes

    @property
    def plain(self) -> bool:
        """No transform after the head and no truncation of the distribution: the softmax of logits / t,
        made here; else through the transform and ``core.token_logprobs``."""
        return self.head.transform is None and not self.distribution.truncates

    @property
    def t(self) -> float:
        return self.distribution.temperature


class _ChunkedLinearHead(torch.autograd.Function):
    """Log-probs (and entropies) through a linear head, chunk by chunk:

        d/d hidden_c = g_c @ W        d/d W = sum over chunks of g_c.T @ hidden_c        d/d b = sum of g_c

    where g_c is the gradient of the chunk's (pre-transform) logits, made by ``core.softmax_backward``. For
    the last chunks, as far as the budget allows (every chunk where the micro-batch fits it), the forward
    saves what their backward starts from: a plain chunk's float32 softmax p (log p for the entropy bonus)
    in place of its logits, which the backward turns into their gradient in place; any other chunk's logits
    (the transform and the softmax are made again from them). The other chunks' logits are computed again,
    in the memory of a kept chunk already used where there is one. A frozen head saves, per token, the
    slopes d logp_t / d hidden_t (and d H_t / d hidden_t for the entropy bonus) instead, H numbers a token,
    which the backward scales by the incoming gradients: no logits kept, none computed again.

    Everything is saved with ``ctx.save_for_backward``, so saved-tensor hooks (offloading) see it. The
    backward writes its gradients in the kept chunks' memory: a second backward through the same graph
    (``retain_graph``) is refused where a chunk was kept."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, ids_N, run: _Pass):
        N = len(ids_N)
        logp_N = torch.empty(N, dtype=torch.float32, device=hidden_NH.device)
        entropy_N = torch.empty(N if run.with_entropy else 0, dtype=torch.float32, device=hidden_NH.device)
        weight = weight_VH.to(run.head.dtype)
        # d logp / d hidden and d H / d hidden per token, for a frozen head
        slopes = [torch.empty(hidden_NH.shape, dtype=torch.float32, device=hidden_NH.device)
                  for _ in range(1 + run.entropy_grad)] if run.frozen else []
        kept = []  # per kept chunk, from the first kept: what its backward starts from
        slices = run.plan.slices
        first_kept = len(slices) - (0 if run.frozen else run.plan.kept)
        for index, rows in enumerate(slices):
            # the logits are handed on, not held here: they are the kept chunk's memory, or freed
            if run.frozen:
                logp, entropy, chunk_slopes = _slopes(run, _head_linear(run.head, hidden_NH[rows], weight),
                                                      ids_N[rows], weight)
                for slope, chunk_slope in zip(slopes, chunk_slopes):
                    slope[rows] = chunk_slope
            else:
                logp, entropy, start = _chunk_logprobs(run, _head_linear(run.head, hidden_NH[rows], weight),
                                                       ids_N[rows], keep=index >= first_kept)
                if start is not None:
                    kept.append(start)
            logp_N[rows] = logp.detach()
            if run.with_entropy:
                entropy_N[rows] = entropy.detach()
        if run.frozen:
            ctx.save_for_backward(*slopes)
        else:
            ctx.save_for_backward(hidden_NH, weight_VH, bias_V, ids_N, logp_N, entropy_N, *kept)
        ctx.run, ctx.hidden_dtype, ctx.used_kept = run, hidden_NH.dtype, False
        if not run.entropy_grad:
            ctx.mark_non_differentiable(entropy_N)
        ctx.set_materialize_grads(False)  # an output the loss does not use has no gradient to add
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, grad_entropy_N):
        run = ctx.run
        if grad_logp_N is None and grad_entropy_N is None:
            return (None,) * 5
        if run.frozen:
            grad_hidden = 0
            for slope, grad in zip(ctx.saved_tensors, (grad_logp_N, grad_entropy_N)):
                if grad is not None:
                    grad_hidden = grad_hidden + slope * grad.unsqueeze(1)
            return (grad_hidden.to(ctx.hidden_dtype),) + (None,) * 4
        if ctx.used_kept:
            raise RuntimeError("a second backward through covey's chunked log-prob pass: the first wrote its "
                               "gradients over what the forward kept; run the forward again (or pass budget=0 to "
                               "head_logprobs, which keeps nothing)")
        hidden_NH, weight_VH, bias_V, ids_N, logp_N, entropy_N, *kept = ctx.saved_tensors
        ctx.used_kept = bool(kept)
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        weight = weight_VH.to(run.head.dtype)
        grad_hidden = torch.empty_like(hidden_NH) if needs_hidden else None
        grad_weight = grad_bias = None  # float32 sums over the chunks
        slices = run.plan.slices
        first_kept = len(slices) - len(kept)
        spare = None  # a kept chunk's memory, its gradient used: where the logits computed again are made
        # the kept chunks first, so that the logits computed again can take their memory
        for index in [*range(first_kept, len(slices)), *range(first_kept)]:
            rows = slices[index]
            hidden = hidden_NH[rows].to(run.head.dtype)
            if index >= first_kept:
                start = kept[index - first_kept]
            else:
                start = _head_linear(run.head, hidden, weight, _memory(spare, rows, run.head.dtype))
            grad_logits = _logits_gradient(run, start, ids_N[rows], logp_N[rows], entropy_N[rows] if run.entropy_grad
                                           else None, _part(grad_logp_N, rows),
                                           _part(grad_entropy_N, rows) if run.entropy_grad else None,
                                           computed_again=index < first_kept, spare=spare)
            with torch.autocast(hidden.device.type, enabled=False):
                if needs_hidden:
                    grad_hidden[rows] = grad_logits @ weight
                if needs_weight:
                    grad_weight = _accumulate(grad_weight, grad_logits.T, hidden)
                if needs_bias:
                    part = grad_logits.sum(0, dtype=torch.float32)
                    grad_bias = part if grad_bias is None else grad_bias.add_(part)
            if index >= first_kept:
                spare = start
            start = grad_logits = None  # freed before the next chunk's logits are made
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight_VH.dtype),
                None if grad_bias is None else grad_bias.to(bias_V.dtype), None, None)


def _chunk_logprobs(run: _Pass, linear_cV, ids_c, keep: bool):
    """(logp_c, entropy_c, what the chunk's backward starts from where ``keep``, else None) of a chunk's
    pre-transform logits ``linear_cV`` (made for this; a plain chunk's overwritten)."""
    if run.plain:
        return _plain_logprobs(linear_cV, ids_c, run.t, run.with_entropy,
                               None if not keep else "log_p" if run.entropy_grad else "p",
                               run.plan.working_rows(PLAIN_WORKING_SHARE))
    _, logp, entropy = _through_head(run, linear_cV, ids_c, graph=False, with_entropy=run.with_entropy)
    return logp, entropy, linear_cV if keep else None


def _logits_gradient(run: _Pass, start, ids_c, logp_c, entropy_c, grad_logp_c, grad_entropy_c, computed_again: bool,
                     spare) -> torch.Tensor:
    """The gradient of a chunk's pre-transform logits, in the head's compute dtype, from what its backward
    starts from (``start``, used up): a plain chunk's kept p (log p for the entropy bonus) or its logits
    computed again (its log-softmax then made from the forward's log-probs, in ``spare`` where the logits are
    not float32); any other chunk's logits, through the transform and ``core.token_logprobs`` again."""
    if not run.plain:
        return _graph_gradient(run, start, ids_c, grad_logp_c, grad_entropy_c)
    if computed_again:
        start = _log_p_again(start, ids_c, run.t, logp_c, _memory(spare, slice(0, len(ids_c)), torch.float32))
    elif not run.entropy_grad:  # p kept
        return core.softmax_backward(start, ids_c, grad_logp_c, run.t).to(run.head.dtype)
    return core.log_softmax_backward(start, ids_c, grad_logp_c, run.t, entropy_c, grad_entropy_c).to(run.head.dtype)


def _log_p_again(linear_cV, ids_c, t: float, logp_c, into: torch.Tensor | None) -> torch.Tensor:
    """log p = log_softmax(x / t) of a chunk's logits x computed again, from the forward's log-probs: the
    log-normaliser is x_id / t - logp_id, so one pass over the chunk makes it (no exp and sum); float32, in
    the logits' memory where they are float32, else in ``into`` (or new)."""
    z = linear_cV.float() if into is None or linear_cV.dtype == torch.float32 else into.copy_(linear_cV)
    normaliser = z.gather(-1, ids_c[:, None]).div_(t).sub_(logp_c[:, None])
    log_p = z.div_(t) if t != 1 else z
    return log_p.sub_(normaliser)


def _memory(spare: torch.Tensor | None, rows: slice, dtype: torch.dtype) -> torch.Tensor | None:
    """[rows, V] of ``dtype`` in the memory of ``spare`` (a kept chunk whose gradient is used, of a whole
    chunk's rows), or None where there is none of that dtype."""
    if spare is None or spare.dtype != dtype or not spare.is_contiguous():
        return None
    n = rows.stop - rows.start
    return spare.view(-1)[:n * spare.shape[-1]].view(n, spare.shape[-1])


def _accumulate(total: torch.Tensor | None, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """total + left @ right, summed in float32 (the first product taken as the total: no zeros to add to);
    a product in another dtype is made in it and then added (as the model's own head would make it)."""
    if left.dtype == torch.float32:
        return left @ right if total is None else total.addmm_(left, right)
    product = (left @ right).float()
    return product if total is None else total.add_(product)


def _through_head(run: _Pass, linear_cV, ids_c, graph: bool, with_entropy: bool):
    """(linear, logp, entropy) of one chunk's pre-transform logits through the transform and
    ``core.token_logprobs``; with ``graph``, on an autograd graph from ``linear``, made a leaf for it."""
    linear = linear_cV.detach().requires_grad_(graph)
    with torch.set_grad_enabled(graph), torch.autocast(linear.device.type, enabled=False):
        logits = linear if run.head.transform is None else run.head.transform(linear)
        logp, entropy = token_logprobs(logits, ids_c, with_entropy, run.distribution,
                                       chunk=run.plan.working_rows(CORE_WORKING_SHARE), entropy_grad=run.entropy_grad)
    return linear, logp, entropy


def _graph_gradient(run: _Pass, linear_cV, ids_c, grad_logp, grad_entropy) -> torch.Tensor:
    """The gradient of a chunk's pre-transform logits through the transform and ``core.token_logprobs`` (whose
    backward is ``core.softmax_backward``), given its log-probs' and entropies' (either None where unused)."""
    linear, logp, entropy = _through_head(run, linear_cV, ids_c, graph=True, with_entropy=run.entropy_grad)
    pairs = [(logp, grad_logp), (entropy, grad_entropy)]
    outputs, grads = zip(*[(output, grad) for output, grad in pairs if grad is not None])
    return torch.autograd.grad(outputs, linear, grads)[0]


def _slopes(run: _Pass, linear_cV, ids_c, weight_VH):
    """(logp_c, entropy_c, slopes) of a frozen head's chunk (``linear_cV`` made for this): d logp_t / d hidden_t
    = (onehot(id) - p) W / t and, for the entropy bonus, d H_t / d hidden_t = -(p (log p + H_t)) W / t: the
    gradients of the logits at g_logp = 1 (g_H = 1) from ``core.softmax_backward``, times W."""
    ones = torch.ones(len(ids_c), device=linear_cV.device)
    if not run.plain:  # the gradients through the transform and core.token_logprobs, one output at a time
        linear, logp, entropy = _through_head(run, linear_cV, ids_c, graph=True, with_entropy=run.with_entropy)
        grads = [torch.autograd.grad(output, linear, ones, retain_graph=True)[0]
                 for output in (logp, entropy)[:1 + run.entropy_grad]]
        with torch.autocast(linear.device.type, enabled=False):
            return logp, entropy, [grad @ weight_VH for grad in grads]
    # from the chunk's log-softmax, with at most its p beside it
    logp, entropy, log_p = _plain_logprobs(linear_cV, ids_c, run.t, run.with_entropy, "log_p",
                                           run.plan.working_rows(PLAIN_WORKING_SHARE))
    with torch.autocast(log_p.device.type, enabled=False):
        p = log_p.exp() if run.entropy_grad else log_p.exp_()
        slopes = []
        if run.entropy_grad:
            entropy_part = core.softmax_backward(p, ids_c, None, run.t, log_p, entropy, ones)
            slopes.append(entropy_part.to(weight_VH.dtype) @ weight_VH)
        log_p = entropy_part = None
        logp_part = core.softmax_backward(p, ids_c, ones, run.t)
        slopes.insert(0, logp_part.to(weight_VH.dtype) @ weight_VH)
    return logp, entropy, slopes


def _plain_logprobs(linear_cV, ids_c, t: float, with_entropy: bool, keep: str | None, working: int):
    """(logp_c, entropy_c or empty, kept or None) of a chunk's logits x (``linear_cV``, made for this and
    overwritten) under log p = log_softmax(x / t), in float32, ``working`` rows at a time:

        logp_id = log p_id        H = -sum_j p_j log p_j (clamped at 0 against rounding)

    ``keep``: what the backward of a kept chunk starts from, float32 [c, V], written over the logits where
    they are float32: "p" (the log-probs' gradient needs p alone) or "log_p" (the entropy's needs log p);
    None keeps nothing."""
    c, V = linear_cV.shape
    kept = None if keep is None else linear_cV if linear_cV.dtype == torch.float32 else \
        torch.empty(c, V, dtype=torch.float32, device=linear_cV.device)
    logp_c = torch.empty(c, dtype=torch.float32, device=linear_cV.device)
    entropy_c = torch.empty(c if with_entropy else 0, dtype=torch.float32, device=linear_cV.device)
    for rows in _chunks(c, working):
        z = linear_cV[rows].float()  # the logits' own memory where float32 (not needed after this)
        log_p = (z.div_(t) if t != 1 else z).log_softmax(-1)
        logp_c[rows] = core.logprob_at(log_p, ids_c[rows])
        if keep == "log_p":
            kept[rows] = log_p
            if with_entropy:
                entropy_c[rows] = core.entropy_of(log_p.exp(), log_p)
        elif keep == "p" or with_entropy:
            p = torch.exp(log_p, out=kept[rows] if keep == "p" else z)
            if with_entropy:
                entropy_c[rows] = core.entropy_of(p, log_p)
        log_p = p = None  # freed before the next rows' working copy is made
    return logp_c, entropy_c, kept


def _head_linear(head: LinearHead, hidden_cH, weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden @ W.T (+ b) in the head's compute dtype, no graph; in ``out`` where given (the same product)."""
    with torch.no_grad(), torch.autocast(hidden_cH.device.type, enabled=False):
        bias = None if head.bias is None else head.bias.to(head.dtype)
        hidden = hidden_cH.to(head.dtype)
        if out is None:
            return torch.nn.functional.linear(hidden, weight, bias)
        return torch.mm(hidden, weight.T, out=out) if bias is None else torch.addmm(bias, hidden, weight.T, out=out)


def _chunked_module_head(head: torch.nn.Module, transform, hidden_NH, ids_N, temperature, with_entropy,
                         entropy_grad, chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """The same log-probs through a head that is a module of its own kind (an adapter on it): each chunk
    under ``torch.utils.checkpoint``, so only its inputs are kept and its logits come back in the backward."""

    def chunk_logprobs(hidden_cH: torch.Tensor, ids_c: torch.Tensor):
        logits = head(hidden_cH)
        logits = logits if transform is None else transform(logits)
        logp, entropy = token_logprobs(logits, ids_c, with_entropy, temperature,
                                       chunk=logprob_working_rows(chunk, logits.shape[-1], CORE_WORKING_SHARE),
                                       entropy_grad=entropy_grad)
        return logp, entropy if with_entropy else logp.new_empty(0)

    grad = torch.is_grad_enabled() and (hidden_NH.requires_grad or any(p.requires_grad for p in head.parameters()))
    parts = [checkpoint(chunk_logprobs, hidden_NH[rows], ids_N[rows], use_reentrant=False) if grad
             else chunk_logprobs(hidden_NH[rows], ids_N[rows]) for rows in _chunks(len(ids_N), chunk)]
    if not parts:
        empty = hidden_NH.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def check_head(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Once per model config: the log-prob pass's head (``head_logprobs``) gives the logits the model's own
    forward does on ``ids`` (a few tokens, (1, n)); a model whose forward does something after its head
    that covey does not know is refused rather than trained on other log-probs than it samples from."""
    plain = plain_model(model)
    config = plain.config
    seen = _CHECKED.get(id(config))
    if seen is not None and seen() is config:
        return
    was_training = model.training
    model.eval()  # no dropout: the two forwards compare, and the check draws no random numbers from the run's
    try:
        # with gradients on (and the results detached): a forward without them leaves a 4-bit model with a
        # LoRA adapter (bitsandbytes on CPU) unable to train its adapter afterwards
        with torch.enable_grad():
            want = model(input_ids=ids, use_cache=False).logits.float().detach()
            hidden = plain.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state.detach()
        head, transform = plain.get_output_embeddings(), logits_transform(config)
        with torch.no_grad():
            if type(head) in (torch.nn.Linear, Float32Head):
                got = LinearHead(head.weight, head.bias, _compute_dtype(head, hidden), transform).logits(hidden)
            else:
                got = head(hidden) if transform is None else transform(head(hidden))
    finally:
        model.train(was_training)
    exact = got.dtype == hidden.dtype == torch.float32  # else logits of ~3 significant digits
    tolerance = (1e-4 if exact else 2e-2) * (1 + float(want.abs().max()))
    got = got.float()
    off = float((got - want).abs().max())
    if not off <= tolerance:
        raise ModelError(f"the {config.model_type} model's forward does something to its logits after its output head "
                         f"that covey's log-prob pass does not (logits differ by up to {off:.3g}); covey knows the "
                         "softcapping and scaling of Gemma, Cohere and Granite models: use one of the architectures "
                         "covey supports")
    _CHECKED[id(config)] = weakref.ref(config)


_CHECKED: dict[int, weakref.ref] = {}  # id(model config) -> the config, once check_head passed


def _chunks(N: int, chunk: int, start: int = 0) -> list[slice]:
    """N rows from ``start`` in slices of ``chunk`` (the last shorter where it does not divide N)."""
    return [slice(start + first, start + min(first + chunk, N)) for first in range(0, N, chunk)]


def _part(tensor: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows]
