"""The log-prob pass runs the output head a chunk of tokens at a time (covey.train.head): its log-probs,
entropies and gradients equal those of the plain pass that applies the head to every token at once
(``_full_logits_reference`` below, the model's own forward and a log-softmax over all its logits), and it
never holds the logits of more than a chunk of tokens.

Tolerances: float32, 1e-5 absolute (values) and 1e-5 absolute + 1e-4 relative (gradients); under bfloat16
autocast 2e-2 absolute on log-probs and entropies (bfloat16 logits carry ~3 significant digits, and both
passes round the same products differently once summed over chunks) and 2e-2 relative to the largest
gradient entry for gradients.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import covey.train.head as head_module
from covey.errors import ModelError
from covey.models import head_in_float32
from covey.train.forward import SequenceBatch, completion_logprobs
from covey.train.head import head_logprobs

V = 257  # a vocabulary that is neither a multiple of the chunk nor the hidden size
CHUNK = 5  # tokens per chunk in these tests: no batch below is a multiple of it


def _small(**extra):
    return dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                **extra)


def tiny(kind: str) -> torch.nn.Module:
    """A tiny random-weight model of each head covey meets."""
    from transformers import (Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig,
                              LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    from covey.models import add_lora

    torch.manual_seed(0)
    if kind in ("tied", "untied"):
        return LlamaForCausalLM(LlamaConfig(**_small(tie_word_embeddings=kind == "tied"))).eval()
    if kind == "softcap":  # a cap small enough to change these small logits a lot
        config = Gemma2Config(**_small(head_dim=8, final_logit_softcapping=0.5, sliding_window=16))
        config._attn_implementation = "eager"
        return Gemma2ForCausalLM(config).eval()
    if kind == "granite":  # logits divided by a scale after the head
        return GraniteForCausalLM(GraniteConfig(**_small(logits_scaling=0.25))).eval()
    if kind == "moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**_small(head_dim=8, moe_intermediate_size=16, num_experts=4,
                                                            num_experts_per_tok=2))).eval()
    base = LlamaForCausalLM(LlamaConfig(**_small(tie_word_embeddings=False)))
    # LoRA on the layers, or also on the head itself (then a module of peft's that runs as it is)
    targets = ["q_proj", "v_proj"] if kind == "lora" else ["q_proj", "lm_head"]
    model = add_lora(base, r=4, alpha=8, dropout=0.0, target_modules=targets)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model.eval()


def batch_of(rows: int = 5, prompt: int = 6, T: int = 9, seed: int = 0) -> SequenceBatch:
    """Groups of rows sharing a prompt, of several lengths, left-padded prompts."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(4, V, (rows, prompt), generator=g)
    prompt_ids[2:] = torch.randint(4, V, (1, prompt), generator=g)  # rows 2.. share one prompt
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    prompt_mask[:2, :2] = 0  # rows 0, 1: shorter prompts
    prompt_ids[prompt_mask == 0] = 0
    completion_ids = torch.randint(4, V, (rows, T), generator=g)
    lengths = torch.tensor([T, 3, T - 1, 1, 5][:rows])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    completion_ids[mask == 0] = 0
    return SequenceBatch(prompt_ids, prompt_mask, completion_ids, mask)


def _full_logits_reference(model, batch: SequenceBatch, temperature: float):
    """The plain pass: the model's own forward over every row in full, its logits at every completion
    position at once, then log_softmax(logits / temperature) gathered at the tokens, and the entropy."""
    input_ids = torch.cat([batch.prompt_ids_BP, batch.completion_ids_BT], 1)
    mask = torch.cat([batch.prompt_mask_BP, batch.completion_mask_BT], 1)
    outputs = model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    P = batch.prompt_ids_BP.shape[1]
    logits_BTV = outputs.logits[:, P - 1:-1].float() / temperature
    log_p = logits_BTV.log_softmax(-1)
    logp = log_p.gather(-1, batch.completion_ids_BT.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    on = batch.completion_mask_BT
    return logp * on, entropy * on


def _loss(logp, entropy, mask, entropy_weight):
    """A loss that weighs every token differently (so a gradient in the wrong place shows)."""
    weights = torch.linspace(0.5, 1.5, mask.numel()).reshape(mask.shape)
    loss = (logp * weights * mask).sum()
    return loss if entropy_weight == 0 else loss + entropy_weight * (entropy * mask).sum()


def _run(model, pass_, entropy_weight):
    model.zero_grad(set_to_none=True)
    logp, entropy = pass_()
    _loss(logp, entropy, batch_of().completion_mask_BT, entropy_weight).backward()
    grads = {n: p.grad.to_dense().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


def _compare(model, bf16: bool, temperature: float, entropy_weight: float, monkeypatch, **way):
    monkeypatch.setattr(head_module, "LOGPROB_CHUNK_BYTES", CHUNK * V * 4)
    batch = batch_of()
    mask = batch.completion_mask_BT == 1
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        want = _run(model, lambda: _full_logits_reference(model, batch, temperature), entropy_weight)
        got = _run(model, lambda: completion_logprobs(model, batch, temperature, with_entropy=True,
                                                      entropy_grad=entropy_weight != 0, **way)[:2], entropy_weight)
    atol = 2e-2 if bf16 else 1e-5
    assert (got[0][~mask] == 0).all() and (got[1][~mask] == 0).all()
    assert torch.allclose(got[0][mask], want[0][mask], atol=atol), float((got[0] - want[0]).abs().max())
    assert torch.allclose(got[1][mask], want[1][mask], atol=atol), float((got[1] - want[1]).abs().max())
    assert got[2].keys() == want[2].keys() and got[2]
    for name, grad in want[2].items():
        scale = float(grad.abs().max())
        close = torch.allclose(got[2][name], grad, atol=2e-2 * scale, rtol=0) if bf16 else \
            torch.allclose(got[2][name], grad, atol=1e-5, rtol=1e-4)
        assert close, (name, float((got[2][name] - grad).abs().max()), scale)
    return got, want


@pytest.mark.parametrize("kind", ["tied", "untied", "softcap", "granite", "lora", "lora-head"])
@pytest.mark.parametrize("temperature, entropy_weight", [(1.0, 0.0), (0.7, 0.3)])
def test_the_chunked_pass_equals_the_full_logits_pass_in_float32(kind, temperature, entropy_weight, monkeypatch):
    """Values and gradients of every trainable parameter (the head's weight among them, tied to the
    embedding or not), with the entropy bonus's gradient or without, the temperature applied per chunk."""
    model = tiny(kind).train()
    got, _ = _compare(model, False, temperature, entropy_weight, monkeypatch)
    head = [n for n in got[2] if "lm_head" in n or "embed_tokens" in n]
    assert head or kind == "lora"  # the head's gradient was compared (LoRA trains adapters only)


@pytest.mark.parametrize("kind", ["tied", "untied", "softcap"])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.1])
def test_the_chunked_pass_equals_the_full_logits_pass_under_bf16_autocast(kind, entropy_weight, monkeypatch):
    """bfloat16 logits, the kept chunk's softmax (or log-softmax, for the entropy bonus) held in float32."""
    model = tiny(kind).train()
    # the reference attends as the model does under autocast; so does the pass with float32_attention off
    _compare(model, True, 0.8, entropy_weight, monkeypatch, float32_attention=False)


def test_the_chunked_pass_equals_the_full_logits_pass_with_the_head_in_float32(monkeypatch):
    """cast_lm_head_to_fp32: the head computes in float32 under bfloat16 autocast; nearly the float32 result."""
    model = tiny("untied").train()
    head_in_float32(model)
    _compare(model, True, 1.0, 0.0, monkeypatch, float32_attention=False)


def test_the_chunked_pass_is_exact_under_gradient_checkpointing(monkeypatch):
    model = tiny("tied")
    model.gradient_checkpointing_enable()
    model.train()
    _compare(model, False, 0.9, 0.2, monkeypatch)


def test_the_router_loss_pass_takes_the_decoders_output_and_the_models_own_aux_loss(monkeypatch):
    monkeypatch.setattr(head_module, "LOGPROB_CHUNK_BYTES", CHUNK * V * 4)
    model = tiny("moe").train()
    batch = batch_of()
    logp, _, aux = completion_logprobs(model, batch, router_aux_loss=True)
    want, _ = _full_logits_reference(model, batch, 1.0)
    input_ids = torch.cat([batch.prompt_ids_BP, batch.completion_ids_BT], 1)
    mask = torch.cat([batch.prompt_mask_BP, batch.completion_mask_BT], 1)
    own = model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                output_router_logits=True).aux_loss
    assert torch.allclose(logp, want, atol=1e-5) and torch.allclose(aux, own)


@pytest.mark.parametrize("head", ["weight", "weight and bias", "frozen"])
@pytest.mark.parametrize("chunk", [1, 4, 7, 100])
@pytest.mark.parametrize("kept", ["none", "some", "all"])
def test_hidden_state_weight_and_bias_gradients_of_the_head_alone(chunk, head, kept):
    """From given hidden states: the gradient in the hidden states (per chunk), and in the head's weight and
    bias (summed over chunks), for chunks of one token, of sizes that do not divide N, and of more than N,
    the backward computing every chunk's logits again, some of them (the others kept from the forward) or
    none; or, the head frozen, the hidden states' alone (from slopes kept in the forward)."""
    budget = {"none": 0, "some": 9 * V * 4, "all": None}[kept]
    model = tiny("untied")
    bias = head == "weight and bias"
    if bias:
        model.lm_head.bias = torch.nn.Parameter(torch.randn(V) * 0.1)
    model.lm_head.weight.requires_grad_(head != "frozen")
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(23, 32, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (23,), generator=g)
    upstream_logp, upstream_entropy = torch.randn(23, generator=g), torch.randn(23, generator=g)
    results = []
    for chunked in (True, False):
        model.zero_grad(set_to_none=True)
        hidden.grad = None
        if chunked:
            logp, entropy = head_logprobs(model, hidden, ids, 0.6, with_entropy=True, entropy_grad=True, chunk=chunk,
                                          budget=budget)
        else:
            log_p = (model.lm_head(hidden).float() / 0.6).log_softmax(-1)
            logp, entropy = log_p.gather(-1, ids[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
        ((logp * upstream_logp).sum() + (entropy * upstream_entropy).sum()).backward()
        results.append([logp.detach(), entropy.detach(), hidden.grad.clone()]
                       + ([] if head == "frozen" else [model.lm_head.weight.grad.clone()])
                       + ([model.lm_head.bias.grad.clone()] if bias else []))
    for got, want in zip(*results):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), float((got - want).abs().max())


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_a_second_backward_is_refused_where_the_first_used_what_the_forward_kept(entropy_grad):
    """The backward of a kept chunk writes its gradient over what the forward kept: a second backward through
    the same graph (retain_graph) is refused with covey's error; a pass that kept nothing (budget 0) computes
    every chunk again and gives the same gradients twice."""
    model = tiny("untied")
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(11, 32, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (11,), generator=g)
    for budget in (8 * V * 4, 0):
        logp, entropy = head_logprobs(model, hidden, ids, 0.7, with_entropy=True, entropy_grad=entropy_grad,
                                      chunk=4, budget=budget)
        loss = (logp * torch.linspace(0.5, 1.5, 11)).sum() + (entropy.sum() if entropy_grad else 0)
        grads = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            hidden.grad = None
            if budget and grads:
                with pytest.raises(RuntimeError, match="second backward through covey's chunked log-prob pass"):
                    loss.backward(retain_graph=True)
                continue
            loss.backward(retain_graph=True)
            grads.append((hidden.grad.clone(), model.lm_head.weight.grad.clone()))
        if budget:
            kept = grads[0]
        else:
            for first, second, with_kept in zip(*grads, kept):
                assert torch.equal(first, second) and torch.allclose(first, with_kept, atol=1e-6, rtol=1e-5)


class _VocabularyTensors(TorchDispatchMode):
    """The shape of each new (not a view, not in place: a view of an input, t, view...) strided tensor whose
    last dimension is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.shapes: list[torch.Size] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == V and not aliases \
                    and t.layout == torch.strided:
                self.shapes.append(t.shape)
        return out

    def logits_made(self) -> int:
        """Those of two or more dimensions: logits of a chunk of tokens."""
        return sum(len(shape) >= 2 for shape in self.shapes)

    def most_rows(self) -> int:
        """The most tokens any of them holds the vocabulary of."""
        return max((shape.numel() // V for shape in self.shapes), default=0)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_backward_of_a_kept_chunk_makes_no_logits_of_its_own(entropy_grad):
    """Every chunk kept, float32: the backward turns the softmax the forward kept into the logits' gradient in
    place, so it allocates no [rows, V] tensor (the entropy bonus's gradient: one working copy, p, at a time)."""
    model = tiny("untied")
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(13, 32, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (13,), generator=g)
    logp, entropy = head_logprobs(model, hidden, ids, 0.9, with_entropy=True, entropy_grad=entropy_grad, chunk=5)
    spy = _VocabularyTensors()
    with spy:
        (logp.sum() + (entropy.sum() if entropy_grad else 0)).backward()
    assert spy.logits_made() == (3 if entropy_grad else 0)  # three chunks: 5, 5 and 3 tokens


class _LiveLogits(TorchDispatchMode):
    """The most rows of [rows, V] tensors alive at once (new tensors only: views and in-place results are
    their inputs' memory)."""

    def __init__(self):
        super().__init__()
        self.live = self.most = 0

    def _freed(self, rows: int) -> None:
        self.live -= rows

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == V and not aliases:
                self.live += t.shape[0]
                self.most = max(self.most, self.live)
                weakref.finalize(t, self._freed, t.shape[0])
        return out


def test_the_kept_chunks_come_last_in_the_forward_and_first_in_the_backward():
    """23 tokens in chunks of 3 (the short one, 2, first), a budget of 6 tokens: the last two chunks are kept.
    Their softmax never sits beside the logits of a chunk that is not kept: at most the kept chunk before the
    last (3 rows), the last's logits and its one working copy, a quarter of a chunk's rows (3 + 1), are alive
    at once, forward or backward."""
    model = tiny("untied")
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(23, 32, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (23,), generator=g)
    spy = _LiveLogits()
    with spy:
        logp, _ = head_logprobs(model, hidden, ids, 0.9, with_entropy=True, chunk=3, budget=6 * V * 4)
        forward = spy.most
        logp.sum().backward()
    assert forward == 3 + 3 + 1 and spy.most == forward and spy.live == 0


class _HeadProducts(TorchDispatchMode):
    """Counts the matrix products whose result has the vocabulary as its last dimension (logits)."""

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == V:
            self.rows.append(out.shape[0])
        return out


@pytest.mark.parametrize("budget_tokens, computed_again", [(23, []), (10, [2, 3, 3, 3, 3]), (4, [2] + [3] * 6),
                                                          (2, [2] + [3] * 7), (0, [2] + [3] * 7)])
def test_the_backward_computes_again_only_the_logits_the_budget_did_not_keep(budget_tokens, computed_again):
    """23 tokens in chunks of 3, the short chunk first: the forward keeps what the backward needs of the last
    chunks whose float32 logits fit the budget (all 23 tokens, the last 9, the last 3, none, none), and the
    backward computes only the others' logits again."""
    model = tiny("untied")
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(23, 32, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (23,), generator=g)
    forward, backward = _HeadProducts(), _HeadProducts()
    with forward:
        logp, entropy = head_logprobs(model, hidden, ids, 0.8, with_entropy=True, entropy_grad=True, chunk=3,
                                      budget=budget_tokens * V * 4)
    with backward:
        (logp.sum() - entropy.sum()).backward()
    assert forward.rows == [2] + [3] * 7
    assert backward.rows == computed_again


@pytest.mark.parametrize("kind", ["tied", "softcap", "lora", "lora-head"])
@pytest.mark.parametrize("share_prompt", [True, False])
def test_no_more_than_a_chunk_of_tokens_has_logits_at_once(kind, share_prompt, monkeypatch):
    """Forward and backward, whatever the pass (shared prompt and packed, or every row in full), no tensor
    holds the logits of more tokens than a chunk (or than the few the one-time head check runs on)."""
    monkeypatch.setattr(head_module, "LOGPROB_CHUNK_BYTES", CHUNK * V * 4)
    model = tiny(kind).train()
    batch = batch_of(T=20)
    N = int(batch.completion_mask_BT.sum())
    spy = _VocabularyTensors()
    with spy:
        logp, entropy = completion_logprobs(model, batch, 0.9, with_entropy=True, entropy_grad=True,
                                            share_prompt=share_prompt)
        (logp.sum() + entropy.sum()).backward()
    assert N > 5 * CHUNK and 0 < spy.most_rows() <= CHUNK


def test_a_model_that_changes_its_logits_after_its_head_in_a_way_covey_does_not_know_is_refused():
    model = tiny("tied")
    forward = model.forward

    def doubled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.forward = doubled
    with pytest.raises(ModelError, match="after its output head"):
        completion_logprobs(model, batch_of())
    assert completion_logprobs(tiny("softcap"), batch_of())[0].shape == (5, 9)  # softcapping: known


@pytest.mark.parametrize("way", ["no gradient", "head trained", "head frozen"])
def test_the_entropy_over_a_real_vocabulary_is_as_exact_as_float32_allows(way):
    """Against a float64 entropy, over SmolLM2's vocabulary (49,152): the sum's pairwise reduction stays
    within 1e-4; a batch of dot products drifted by up to 5e-4 and moved the logged entropy in its 4th digit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = 49152
    model = LlamaForCausalLM(LlamaConfig(**{**_small(tie_word_embeddings=False), "vocab_size": vocab,
                                            "num_hidden_layers": 1})).eval()
    with torch.no_grad():  # logits spread as a trained model's are: entropies of 1 to 8 nats
        model.lm_head.weight.normal_(0, 1)
    model.lm_head.weight.requires_grad_(way == "head trained")
    hidden = (torch.randn(64, 32) * 0.5).requires_grad_(way != "no gradient")
    ids = torch.randint(0, vocab, (64,))
    with torch.set_grad_enabled(way != "no gradient"):
        _, entropy = head_logprobs(model, hidden, ids, 0.7, with_entropy=True, chunk=16, budget=32 * vocab * 4)
    log_p = (model.lm_head(hidden.detach()).double() / 0.7).log_softmax(-1)
    exact = -(log_p.exp() * log_p).sum(-1)
    assert float((entropy.double() - exact).abs().max()) < 1e-4
