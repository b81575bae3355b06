"""Log-probs: the distribution a completion token is sampled from (temperature, top-k, top-p, min-p),
each token's log-prob and entropy under it, chunk by chunk with a hand-written backward, and the masks
of a completion's tokens.

    logp_BT = log softmax(logits[b, t] / temperature)[ids[b, t]]        (always <= 0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOGPROB_CHUNK_TOKENS = 128
"""Rows of logits ``token_logprobs`` turns into float32 log-softmaxes at once (its working copies)."""

LOGPROB_CHUNK_BYTES = 128 * 2**20
"""The output head's budget in the log-prob pass (``covey.train.head``) where a micro-batch's logits do not
fit a quarter of the free memory (``logprob_budget``; a run sets its own with ``logprob_budget_mib``): the head runs on as many completion tokens at once as have float32 logits within
it (``logprob_chunk_tokens``: 682 tokens of a vocabulary of 49,152, 220 of Qwen's 151,936), so a
micro-batch that fits runs in one chunk; in a pass with a gradient the forward keeps, for the chunks that
fit the same budget (the last), their float32 softmax in place of their logits, which the backward turns
into the logits' gradient in place before it computes the other chunks' logits again. At the worst moment
the pass holds one chunk's float32 logits and a float32 working copy of a quarter of a chunk (of the
default budget's chunk at most, ``logprob_working_rows``): 160 MiB at the default, whatever the vocabulary
and the length (under bf16 autocast, or with the entropy bonus, up to twice the budget; with both, three
times); beside them, per token, its hidden state and two float32 results, and one float32 V x H
accumulator of the head weight's gradient where the weight trains. A frozen head (LoRA) keeps no chunk:
per token, the slopes of its log-prob (and entropy) in the hidden state. A larger budget makes fewer and
larger matrix products and computes fewer logits twice; a smaller one lowers the peak."""


def logprob_budget(asked_mib: int | None, head_tokens: int, vocab: int, free_bytes: int | None) -> int:
    """The log-prob pass's budget in bytes: ``asked_mib`` (``logprob_budget_mib``) where given; else every
    float32 logit of a micro-batch (``head_tokens`` x ``vocab``: computed once, none again in the backward)
    where they take at most a quarter of ``free_bytes``, the memory free once the model is loaded (None:
    not known), else ``LOGPROB_CHUNK_BYTES``."""
    if asked_mib is not None:
        return asked_mib * 2**20
    whole = head_tokens * vocab * 4
    if whole <= LOGPROB_CHUNK_BYTES or free_bytes is None or whole > free_bytes // 4:
        return LOGPROB_CHUNK_BYTES
    return whole


def logprob_chunk_tokens(vocab: int, budget: int | None = None) -> int:
    """Completion tokens the output head runs on at once: those whose float32 logits fit ``budget`` bytes
    (``LOGPROB_CHUNK_BYTES``), at least one."""
    return max(1, (LOGPROB_CHUNK_BYTES if budget is None else budget) // (4 * vocab))


def logprob_working_rows(chunk: int, vocab: int, share: int) -> int:
    """Rows of a chunk of ``chunk`` tokens made into float32 (log-)softmaxes at once: a ``share``-th of the
    chunk, and never more than a ``share``-th of the default budget's chunk (a larger budget holds more
    logits, not larger working copies), at least one."""
    return max(1, min(chunk, logprob_chunk_tokens(vocab)) // share)


@dataclass(frozen=True)
class TokenDistribution:
    """What a completion token is sampled from, given the model's logits x: softmax(x / temperature) over
    the tokens that top_k, top_p and min_p keep, applied in that order (transformers' and the fast
    engine's; 0, 1.0 and 0 keep every token). The engines report the log-probs of this distribution, and
    the trainer computes its own of the same one, so the policy trained is the one that samples and the
    engine/trainer ratio carries no factor of the probability mass the truncation kept."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    suppressed: tuple[int, ...] = ()  # tokens never sampled (a vision-language model's image tokens)

    @property
    def truncates(self) -> bool:
        return bool(self.top_k) or self.top_p < 1.0 or bool(self.min_p) or bool(self.suppressed)

    def logits(self, logits_NV: torch.Tensor, ids_N: torch.Tensor | None = None) -> torch.Tensor:
        """x / temperature in float32, -inf at the tokens the truncation drops, which it decides without a
        gradient; never at ``ids_N``, the tokens sampled (a token the engine kept stays on the support
        where rounding or a policy moved since sampling would drop it)."""
        scaled = _scaled(logits_NV, self.temperature)
        if not self.truncates:
            return scaled
        with torch.no_grad():
            kept = scaled
            if self.suppressed:  # before the truncation, as transformers' and vLLM's samplers do
                kept = scaled.index_fill(-1, torch.tensor(self.suppressed, device=scaled.device), -torch.inf)
            removed = truncated_away(kept, self.top_k, self.top_p, self.min_p) | kept.isneginf()
            if ids_N is not None:
                removed.scatter_(-1, ids_N.unsqueeze(-1), False)
        return scaled.masked_fill(removed, -torch.inf)


def truncated_away(scaled: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The tokens top-k, then top-p (the most likely token always stays), then min-p remove from
    ``scaled``, the logits after the temperature: a bool mask (..., V)."""
    removed = torch.zeros_like(scaled, dtype=torch.bool)
    if top_k and top_k < scaled.shape[-1]:
        removed |= scaled < torch.topk(scaled, top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        ascending, order = torch.sort(scaled.masked_fill(removed, -torch.inf), descending=False, dim=-1)
        drop_sorted = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop_sorted[..., -1] = False
        removed |= drop_sorted.scatter(-1, order, drop_sorted)
    if min_p:
        probs = scaled.masked_fill(removed, -torch.inf).softmax(-1)
        removed |= probs < min_p * probs.max(-1, keepdim=True).values
    return removed


def token_logprobs(logits_NV: torch.Tensor, ids_N: torch.Tensor, with_entropy: bool = False,
                   temperature: float | TokenDistribution = 1.0, chunk: int = LOGPROB_CHUNK_TOKENS,
                   entropy_grad: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(logits / temperature)[ids], its entropy or None) per position, in float32,
    ``chunk`` positions at a time so a float32 copy of all the logits is never held. Works on any
    leading shape (..., V). ``temperature``: a number, or the whole ``TokenDistribution`` sampled from
    (then over the tokens its truncation keeps). The entropy carries a gradient only with
    ``entropy_grad`` (an entropy bonus trains on it); else it is a plain value.
    """
    shape = ids_N.shape
    distribution = temperature if isinstance(temperature, TokenDistribution) else TokenDistribution(temperature)
    logp_N, entropy_N = _TokenLogprobs.apply(logits_NV.reshape(-1, logits_NV.shape[-1]), ids_N.reshape(-1),
                                             distribution, with_entropy or entropy_grad, chunk, entropy_grad)
    return logp_N.reshape(shape), entropy_N.reshape(shape) if with_entropy or entropy_grad else None


class _TokenLogprobs(torch.autograd.Function):
    """The log-softmax at the chosen ids, and optionally the entropy, with the hand-written backward
    (``softmax_backward``). Autograd through logsumexp + gather would keep float32 copies of every chunk for
    the backward and make several passes over them; this keeps only the logits as given (and the entropy,
    one number a position) and makes the softmax again chunk by chunk when the gradient is asked for."""

    @staticmethod
    def forward(ctx, logits_NV, ids_N, distribution, with_entropy, chunk, entropy_grad):
        logp_N = torch.empty(ids_N.shape, dtype=torch.float32, device=logits_NV.device)
        entropy_N = torch.empty(ids_N.shape if with_entropy else 0, dtype=torch.float32, device=logits_NV.device)
        for first in range(0, len(ids_N), chunk):
            rows = slice(first, first + chunk)
            log_softmax = distribution.logits(logits_NV[rows], ids_N[rows]).log_softmax(-1)
            logp_N[rows] = logprob_at(log_softmax, ids_N[rows])
            if with_entropy:
                log_p = _finite(log_softmax) if distribution.truncates else log_softmax
                entropy_N[rows] = entropy_of(log_softmax.exp(), log_p)
        if entropy_grad:
            ctx.save_for_backward(logits_NV, ids_N, entropy_N)
        else:
            ctx.save_for_backward(logits_NV, ids_N)
            ctx.mark_non_differentiable(entropy_N)
        ctx.distribution, ctx.chunk = distribution, chunk
        ctx.set_materialize_grads(False)  # an output the loss does not use has no gradient to add
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, grad_entropy_N):
        logits_NV, ids_N, *entropy = ctx.saved_tensors
        grad_NV = torch.empty_like(logits_NV)
        t = ctx.distribution.temperature
        for first in range(0, len(ids_N), ctx.chunk):
            rows = slice(first, first + ctx.chunk)
            scaled = ctx.distribution.logits(logits_NV[rows], ids_N[rows])
            grad_logp = None if grad_logp_N is None else grad_logp_N[rows]
            if grad_entropy_N is None:  # log-probs only: one fused softmax
                grad_NV[rows] = softmax_backward(scaled.softmax(-1), ids_N[rows], grad_logp, t)
            else:
                grad_NV[rows] = log_softmax_backward(scaled.log_softmax(-1), ids_N[rows], grad_logp, t,
                                                     entropy[0][rows], grad_entropy_N[rows],
                                                     off_support=ctx.distribution.truncates)
        return grad_NV, None, None, None, None, None


def logprob_at(log_p_NV: torch.Tensor, ids_N: torch.Tensor) -> torch.Tensor:
    """log p at each row's id: the log-prob of the token sampled. [N]"""
    return log_p_NV.gather(-1, ids_N[:, None]).squeeze(-1)


def entropy_of(p_NV: torch.Tensor, log_p_NV: torch.Tensor) -> torch.Tensor:
    """H = -sum_j p_j log p_j per row (log p: 0 where p is 0, as 0 log 0 = 0), clamped at 0 against rounding,
    the product made in ``log_p_NV``'s memory (overwritten). A sum, whose pairwise float32 reduction is as exact
    as the log-softmax; a batch of dot products (bmm) was up to 30x further from a float64 entropy over a real
    vocabulary, and no faster. [N]"""
    return log_p_NV.mul_(p_NV).sum(-1).neg_().clamp_(min=0)


def softmax_backward(p_NV: torch.Tensor, ids_N: torch.Tensor, grad_logp_N: torch.Tensor | None,
                     temperature: float = 1.0, log_p_NV: torch.Tensor | None = None,
                     entropy_N: torch.Tensor | None = None, grad_entropy_N: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The gradient in the logits x of logp_id = log p_id and H = -sum_j p_j log p_j, p = softmax(x / t),
    given theirs (``grad_logp_N``, ``grad_entropy_N``; either None where the loss does not use it): the one
    hand-written backward of the log-softmax, which ``token_logprobs`` and the chunked output head use.

        d logp_id / dx_j = (onehot(id)_j - p_j) / t        d H / dx_j = -p_j (log p_j + H) / t

    that is -p_j (g_logp + g_H (log p_j + H)), plus g_logp at the id, divided by t. ``p_NV`` float32; the
    entropy's gradient needs its log ``log_p_NV`` too (0 where p is 0: no gradient off a truncation's support)
    and ``entropy_N``. Made in place, in float32, in the memory of ``p_NV`` (log-probs only) or of ``log_p_NV``
    (both overwritten)."""
    if grad_entropy_N is None:  # -p_j g_logp
        grad = p_NV.mul_(-grad_logp_N[:, None])
    else:
        grad = log_p_NV.add_(entropy_N[:, None]).mul_(grad_entropy_N[:, None])
        if grad_logp_N is not None:
            grad.add_(grad_logp_N[:, None])
        grad.mul_(p_NV).neg_()
    if grad_logp_N is not None:
        grad.scatter_add_(-1, ids_N[:, None], grad_logp_N[:, None])
    return grad.div_(temperature) if temperature != 1 else grad


def log_softmax_backward(log_p_NV: torch.Tensor, ids_N: torch.Tensor, grad_logp_N: torch.Tensor | None,
                         temperature: float = 1.0, entropy_N: torch.Tensor | None = None,
                         grad_entropy_N: torch.Tensor | None = None, off_support: bool = False) -> torch.Tensor:
    """``softmax_backward`` from log p alone (float32, overwritten): p made in its memory for the log-probs'
    gradient, beside it for the entropy's. ``off_support``: log p may be -inf (a truncated distribution)."""
    if grad_entropy_N is None:
        return softmax_backward(log_p_NV.exp_(), ids_N, grad_logp_N, temperature)
    p_NV = log_p_NV.exp()
    if off_support:
        log_p_NV.masked_fill_(p_NV == 0, 0.0)  # 0 log 0 = 0 off the support
    return softmax_backward(p_NV, ids_N, grad_logp_N, temperature, log_p_NV, entropy_N, grad_entropy_N)


def _finite(log_p: torch.Tensor) -> torch.Tensor:
    """Log-probs with the -inf of tokens off the support as 0 (their p is 0: 0 log 0 = 0)."""
    return log_p.masked_fill(log_p == -torch.inf, 0.0)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()  # the temperature is applied after the cast, not in the logits' own dtype
    return logits if temperature == 1 else logits / temperature


def completion_mask(completion_ids_BT: torch.Tensor, eos_ids: list[int], lengths_B: torch.Tensor | None = None) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after it (padding). (B, T) long.

    ``lengths_B`` (optional) caps each row at its generated length, for rows that never hit EOS.
    """
    B, T = completion_ids_BT.shape
    is_eos_BT = torch.isin(completion_ids_BT, torch.tensor(eos_ids, device=completion_ids_BT.device))
    first_eos_B = torch.where(is_eos_BT.any(1), is_eos_BT.int().argmax(1), torch.full((B,), T, device=is_eos_BT.device))
    end_B = torch.minimum(first_eos_B + 1, torch.full_like(first_eos_B, T))
    if lengths_B is not None:
        end_B = torch.minimum(end_B, lengths_B)
    return length_mask(end_B, T)


def length_mask(lengths_B: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) long mask: 1 at the first ``lengths_B[b]`` positions of row b, 0 after."""
    positions_BT = torch.arange(T, device=lengths_B.device).expand(len(lengths_B), T)
    return (positions_BT < lengths_B.unsqueeze(1)).long()
