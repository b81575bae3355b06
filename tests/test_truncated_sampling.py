"""Sampling truncated by top_k, top_p or min_p: the trainer's log-probs are those of the distribution the
engines sample from (softmax over the tokens kept), so the engine/trainer ratio is 1 where both compute
in float32, not the probability mass the truncation kept (TRL issue 6789)."""

import pytest
import torch

from covey.core import TokenDistribution, token_logprobs, truncated_away
from covey.rollout import HFEngine, SamplingParams, left_pad
from covey.rollout.fast.engine import FastEngine, process_logits
from covey.train.forward import SequenceBatch, completion_logprobs
from tests.conftest import make_model
from tests.test_rollout_and_logprobs import _prompts

DISTRIBUTIONS = [TokenDistribution(0.7, top_k=5), TokenDistribution(1.0, top_p=0.8),
                 TokenDistribution(1.3, min_p=0.1), TokenDistribution(0.9, top_k=12, top_p=0.9, min_p=0.02)]


def _written_out(logits, ids, d: TokenDistribution):
    """log-probs and entropy of the truncated distribution, through autograd: masked logits, log_softmax."""
    scaled = logits.float() / d.temperature
    removed = truncated_away(scaled.detach(), d.top_k, d.top_p, d.min_p)
    removed.scatter_(-1, ids.unsqueeze(-1), False)
    log_p = scaled.masked_fill(removed, -torch.inf).log_softmax(-1)
    entropy = -(log_p.exp() * log_p.masked_fill(removed, 0.0)).sum(-1)
    return log_p.gather(-1, ids.unsqueeze(-1)).squeeze(-1), entropy


@pytest.mark.parametrize("d", DISTRIBUTIONS, ids=str)
def test_logprobs_and_entropy_are_those_of_the_tokens_kept_with_their_gradients(d):
    torch.manual_seed(0)
    logits = (torch.randn(37, 50) * 3).requires_grad_(True)
    ids = torch.randint(0, 50, (37,))
    logp, entropy = token_logprobs(logits, ids, True, d, chunk=8, entropy_grad=True)
    want_logp, want_entropy = _written_out(logits, ids, d)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert torch.allclose(logp, want_logp, atol=1e-5) and torch.allclose(entropy, want_entropy, atol=1e-5)
    weights = torch.randn(2, 37)
    got = torch.autograd.grad((weights[0] * logp + weights[1] * entropy).sum(), logits)[0]
    want = torch.autograd.grad((weights[0] * want_logp + weights[1] * want_entropy).sum(), logits)[0]
    assert torch.allclose(got, want, atol=1e-5)
    # the full vocabulary's log-probs are lower by the mass kept: what the ratio carried before
    full = token_logprobs(logits.detach(), ids, temperature=d.temperature)[0]
    assert (full <= logp.detach() + 1e-6).all() and (full < logp.detach() - 1e-3).any()


def test_a_sampled_token_the_truncation_would_drop_stays_on_the_support():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])
    d = TokenDistribution(top_k=2)
    logp, _ = token_logprobs(logits, torch.tensor([3]), temperature=d)  # not in the top 2
    kept = torch.tensor([4.0, 3.0, -1.0])
    assert torch.isfinite(logp).all() and torch.allclose(logp, kept.log_softmax(-1)[2:])


def test_the_fast_engine_samples_from_the_distribution_the_trainer_replays():
    torch.manual_seed(1)
    logits = torch.randn(6, 80) * 2
    for d in DISTRIBUTIONS:
        params = SamplingParams(4, d.temperature, d.top_p, d.top_k, d.min_p)
        assert params.distribution == d
        assert torch.equal(process_logits(logits, params, None), d.logits(logits))


@pytest.mark.parametrize("engine_kind", ["hf", "fast"])
@pytest.mark.parametrize("d", DISTRIBUTIONS[:2] + DISTRIBUTIONS[3:], ids=str)
def test_engine_and_trainer_logprobs_agree_under_truncated_sampling(tokenizer, engine_kind, d):
    """The ratio the engine correction would take is 1 (float32 on both sides), with top_k/top_p/min_p on."""
    model = make_model(len(tokenizer), seed=3)
    engine = (HFEngine if engine_kind == "hf" else FastEngine)(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    prompts = _prompts(tokenizer)
    params = SamplingParams(10, d.temperature, d.top_p, d.top_k, d.min_p)
    rollout = engine.generate(prompts, 4, params, seed=0)
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(4)], tokenizer.pad_token_id)
    batch = SequenceBatch(prompt_ids, prompt_mask, rollout.completion_ids_BT, rollout.completion_mask_BT)
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, batch, params.distribution, with_entropy=False)
        untruncated, _ = completion_logprobs(model, batch, d.temperature, with_entropy=False)
    mask = rollout.completion_mask_BT.bool()
    assert (trainer[mask] - rollout.sampling_logp_BT[mask]).abs().max() < 1e-4
    assert (untruncated[mask] - rollout.sampling_logp_BT[mask]).abs().max() > 1e-3  # what the ratio carried before
