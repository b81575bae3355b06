"""Every branch of the chunked head's pass (covey.train.head) against plain autograd: the full logits of
every token at once, the model's transform after its head, the distribution's truncation (decided without
a gradient, as the sampler decides it), log_softmax and gather, and the entropy, differentiated by torch.

Branches: the plain softmax (no transform, no truncation) and the way through ``core.token_logprobs`` (a
transform: Gemma's softcapping; a truncation: top-k and top-p, a vision-language model's suppressed image
tokens), each with every chunk kept, some, or none (computed again in the backward), or the head frozen (a
LoRA adapter elsewhere: the forward's slopes), with the entropy's gradient or without. Tolerances as
tests/test_chunked_logprobs.py's in float32: 1e-5 absolute (values), 1e-5 absolute + 1e-4 relative
(gradients).
"""

from __future__ import annotations

import pytest
import torch

from covey.core import TokenDistribution
from covey.train.head import head_logprobs, logits_transform

V, H, N, CHUNK = 257, 32, 23, 4  # 23 tokens: a short chunk of 3, then five of 4

DISTRIBUTIONS = {
    "temperature": TokenDistribution(0.7),
    "top_k and top_p": TokenDistribution(0.8, top_k=40, top_p=0.9),
    "image tokens suppressed": TokenDistribution(0.9, suppressed=tuple(range(200, 257))),
}
HEADS = {"linear": None, "softcapped": 5.0}  # Gemma's final_logit_softcapping, about the logits' spread
BUDGETS = {"every chunk kept": None, "some kept": 9, "none kept": 0}  # tokens of float32 logits


def _model(softcap: float | None, frozen: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    config.final_logit_softcapping = softcap
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # logits of a few units, as a trained model's: distributions far from uniform
        model.lm_head.weight.normal_(0, 0.5)
    model.lm_head.bias = torch.nn.Parameter(torch.randn(V) * 0.1)
    model.lm_head.requires_grad_(not frozen)
    return model


def _inputs():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    ids = torch.randint(0, 200, (N,), generator=g)  # none of the suppressed tokens
    return hidden, ids, torch.randn(N, generator=g), torch.randn(N, generator=g)


def _autograd_reference(model, hidden, ids, distribution: TokenDistribution):
    """Plain autograd over the full logits: the transform, x / t with the truncation's -inf (never at the
    token sampled), log_softmax, gather, and -sum p log p over the tokens kept."""
    transform = logits_transform(model.config)
    raw = model.lm_head(hidden) if transform is None else transform(model.lm_head(hidden))
    logits = raw.float() / distribution.temperature
    if distribution.truncates:
        with torch.no_grad():
            removed = distribution.logits(raw.detach(), ids).isneginf()
        logits = logits.masked_fill(removed, -torch.inf)
    log_p = logits.log_softmax(-1)
    logp = log_p.gather(-1, ids[:, None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p.masked_fill(log_p.isneginf(), 0.0)).sum(-1)
    return logp, entropy


def _values_and_gradients(model, way, entropy_grad: bool):
    hidden, ids, upstream_logp, upstream_entropy = _inputs()
    logp, entropy = way(model, hidden, ids)
    loss = (logp * upstream_logp).sum() + ((entropy * upstream_entropy).sum() if entropy_grad else 0)
    loss.backward()
    return [logp.detach(), entropy.detach(), hidden.grad] + [p.grad for p in model.lm_head.parameters()
                                                              if p.grad is not None]


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("distribution", list(DISTRIBUTIONS))
@pytest.mark.parametrize("way", [*BUDGETS, "head frozen"])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_each_branch_of_the_head_equals_plain_autograd(head, distribution, way, entropy_grad):
    frozen = way == "head frozen"
    model = _model(HEADS[head], frozen)
    d = DISTRIBUTIONS[distribution]
    budget = None if frozen else BUDGETS[way]

    def chunked(model, hidden, ids):
        return head_logprobs(model, hidden, ids, d, with_entropy=True, entropy_grad=entropy_grad, chunk=CHUNK,
                             budget=None if budget is None else budget * V * 4)

    got = _values_and_gradients(model, chunked, entropy_grad)
    model.zero_grad(set_to_none=True)
    want = _values_and_gradients(model, lambda m, h, i: _autograd_reference(m, h, i, d), entropy_grad)
    assert len(got) == len(want) == (3 if frozen else 5)  # logp, entropy, hidden (and the weight, the bias)
    for name, g, w in zip(["logp", "entropy", "hidden", "weight", "bias"], got, want):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-4), (name, float((g - w).abs().max()))


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("way", ["every chunk kept", "head frozen"])
def test_a_saved_tensor_hook_sees_what_the_pass_keeps(head, way):
    """Under torch.autograd.graph.saved_tensors_hooks (what offloading to the CPU uses), the pass packs
    what its backward starts from: the kept chunks' [rows, V] (their softmax, or the logits of a softcapped
    head), or a frozen head's slopes [N, H]; unpacked as copies, the gradients are unchanged."""
    frozen = way == "head frozen"
    d = DISTRIBUTIONS["temperature"]
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor.clone()  # as an offload would: the backward gets another tensor

    def chunked(model, hidden, ids):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            return head_logprobs(model, hidden, ids, d, with_entropy=True, entropy_grad=True, chunk=CHUNK)

    got = _values_and_gradients(_model(HEADS[head], frozen), chunked, True)
    if frozen:
        assert shapes.count((N, H)) == 2  # d logp / d hidden, d H / d hidden
    else:
        assert shapes.count((CHUNK, V)) == 5 and shapes.count((3, V)) == 1  # every chunk kept
    model = _model(HEADS[head], frozen)
    want = _values_and_gradients(model, lambda m, h, i: _autograd_reference(m, h, i, d), True)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-4), float((g - w).abs().max())
