"""Each invariant of the GRPO maths (SPEC.md) as a small exact test."""

import math

import pytest
import torch

from covey import core
from covey.core import BatchCounts, completion_mask, group_advantages, policy_loss
from tests.conftest import loss_settings

kl_k3 = core.KL_ESTIMATORS["k3"]


def test_token_logprobs_equal_log_softmax_gather_and_are_nonpositive():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 4
    ids = torch.randint(0, 11, (3, 5))
    got, entropy = core.token_logprobs(logits, ids, with_entropy=True, chunk=4)  # chunks cross rows
    logp_all = torch.log_softmax(logits, -1)
    assert torch.allclose(got, logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1), atol=1e-6)
    assert torch.allclose(entropy, -(logp_all.exp() * logp_all).sum(-1), atol=1e-5)
    assert (got <= 0).all() and got.shape == entropy.shape == (3, 5)
    cooled, _ = core.token_logprobs(logits.bfloat16(), ids, temperature=0.7)  # divided after the float32 cast
    want = torch.log_softmax(logits.bfloat16().float() / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(cooled, want, atol=1e-6)


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 1.3)])
def test_token_logprobs_gradient_equals_autograd_of_log_softmax(dtype, temperature):
    # the hand-written backward (onehot - softmax) / temperature, chunked, against autograd's
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 11) * 4).to(dtype)
    ids = torch.randint(0, 11, (3, 5))
    weights = torch.randn(3, 5)
    mine = logits.clone().requires_grad_()
    (core.token_logprobs(mine, ids, with_entropy=True, temperature=temperature, chunk=4)[0] * weights).sum().backward()
    reference = logits.clone().requires_grad_()
    logp = torch.log_softmax(reference.float() / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (logp * weights).sum().backward()
    assert mine.grad.dtype == dtype
    assert torch.allclose(mine.grad.float(), reference.grad.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    assert mine.grad.float().abs().sum() > 0


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 1.3)])
@pytest.mark.parametrize("uses", ["both", "entropy only"])
def test_entropy_gradient_equals_autograd_of_the_entropy(dtype, temperature, uses):
    # dH/dz_j = -p_j (log p_j + H), divided by the temperature, chunked; alone or beside the log-probs' own
    torch.manual_seed(1)
    logits = (torch.randn(3, 5, 11) * 4).to(dtype)
    ids = torch.randint(0, 11, (3, 5))
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    mine = logits.clone().requires_grad_()
    logp, entropy = core.token_logprobs(mine, ids, temperature=temperature, chunk=4, entropy_grad=True)
    ((logp * a if uses == "both" else 0) + entropy * b).sum().backward()
    reference = logits.clone().requires_grad_()
    log_p = torch.log_softmax(reference.float() / temperature, -1)
    want_entropy = -(log_p.exp() * log_p).sum(-1)
    ((log_p.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * a if uses == "both" else 0) + want_entropy * b).sum().backward()
    assert torch.allclose(entropy, want_entropy, atol=1e-5)
    assert mine.grad.dtype == dtype
    assert torch.allclose(mine.grad.float(), reference.grad.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    assert mine.grad.float().abs().sum() > 0


def test_entropy_carries_no_gradient_unless_asked():
    logits = torch.randn(2, 7, requires_grad=True)
    _, entropy = core.token_logprobs(logits, torch.tensor([1, 2]), with_entropy=True)
    assert not entropy.requires_grad
    _, entropy = core.token_logprobs(logits, torch.tensor([1, 2]), entropy_grad=True)
    assert entropy.requires_grad


def test_token_logprobs_operand_order_matters():
    # a reversed subtraction (logsumexp - selected) would be >= 0 everywhere
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    value = core.token_logprobs(logits, torch.tensor([[0]]))[0].item()
    assert value == pytest.approx(2.0 - math.log(math.exp(2) + 1 + math.exp(-1)))


def test_token_entropy_uniform_and_peaked():
    uniform = core.token_logprobs(torch.zeros(1, 2, 8), torch.zeros(1, 2, dtype=torch.long), with_entropy=True)[1]
    assert torch.allclose(uniform, torch.full((1, 2), math.log(8)))
    peaked = core.token_logprobs(torch.tensor([[[100.0, 0.0, 0.0]]]), torch.tensor([[0]]), with_entropy=True)[1]
    assert peaked.item() < 1e-6


def test_group_advantages_sum_to_zero_and_follow_reward_order():
    rewards = torch.tensor([1.0, 3.0, 2.0, 0.0, 0.5, 0.7])
    adv, zero_std = group_advantages(rewards, group_size=3)
    for group in adv.view(2, 3):
        assert abs(group.sum().item()) < 1e-6
    assert adv[1] > adv[2] > adv[0] and adv[5] > adv[4] > adv[3]
    # exact value: (r - mean) / (std + eps), std unbiased as in the paper's implementation
    g = torch.tensor([1.0, 3.0, 2.0])
    assert adv[:3].tolist() == pytest.approx(((g - g.mean()) / (g.std() + core.ADVANTAGE_EPS)).tolist())
    assert zero_std.tolist() == [False, False]


def test_constant_group_gets_zero_advantage_and_is_reported():
    adv, zero_std = group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), group_size=2)
    assert adv[:2].tolist() == [0.0, 0.0]
    assert zero_std.tolist() == [True, False]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_constant_group_of_any_size_and_value_is_exactly_zero(scale):
    # the mean of six 0.1s is not 0.1 in floating point: the std comes out near 1e-17, not 0
    for G in (3, 5, 6, 7, 12):
        for value in (0.1, 0.7, 1.1, 2.3):
            rewards = torch.tensor([value] * G + [float(i) for i in range(G)], dtype=torch.float64)
            adv, zero_std = group_advantages(rewards, G, scale)
            assert zero_std.tolist() == [True, False], (G, value)
            assert adv[:G].tolist() == [0.0] * G
    # NaN (no reward) left out: equal among the rest is constant; one reward or none is constant too
    nan = float("nan")
    _, zero_std = group_advantages(torch.tensor([0.1, nan, 0.1, nan, nan, 0.3, nan, nan, nan, 1.0, nan, 2.0]), 3)
    assert zero_std.tolist() == [True, True, True, False]


def test_advantage_eps_is_small_relative_to_std():
    # a reward spread of 0.01 must still give advantages near +-0.7, not be flattened by eps
    adv, _ = group_advantages(torch.tensor([0.0, 0.01]), group_size=2)
    assert adv[1].item() == pytest.approx(0.7071, rel=0.02)


def test_scale_rewards_variants():
    rewards = torch.tensor([0.0, 2.0, 10.0, 14.0])
    none, _ = group_advantages(rewards, 2, scale="none")
    assert none.tolist() == [-1.0, 1.0, -2.0, 2.0]
    batch, _ = group_advantages(rewards, 2, scale="batch")
    assert torch.allclose(batch, none / (rewards.std() + core.ADVANTAGE_EPS))
    with pytest.raises(ValueError):
        group_advantages(rewards, 2, scale="bogus")


def test_kl_k3_zero_when_equal_and_nonnegative():
    torch.manual_seed(0)
    logp = -torch.rand(4, 6) * 3
    assert torch.equal(kl_k3(logp, logp), torch.zeros(4, 6))
    assert (kl_k3(logp, -torch.rand(4, 6) * 3) >= 0).all()


def test_completion_mask_includes_first_eos_and_excludes_padding():
    ids = torch.tensor([[5, 6, 9, 0, 0], [5, 9, 9, 7, 0], [5, 6, 7, 8, 4]])
    mask = completion_mask(ids, eos_ids=[9])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]


def _inputs(B=4, T=5, seed=0):
    torch.manual_seed(seed)
    logp = (-torch.rand(B, T, dtype=torch.float64) * 2).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.randn(B, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logp, old, adv, mask


def test_ratio_is_one_on_first_pass_and_loss_is_minus_mean_advantage():
    logp, _, adv, mask = _inputs()
    counts = BatchCounts(sequences=4, tokens=int(mask.sum()), micro_batches=1, max_completion_length=5)
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, counts, loss_settings(loss_type="grpo"))
    assert loss.item() == pytest.approx(-adv.mean().item())
    assert stats.clip_low_sum == 0 and stats.clip_high_sum == 0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_each_loss_type_matches_its_formula(loss_type):
    logp, old, adv, mask = _inputs()
    counts = BatchCounts(sequences=4, tokens=int(mask.sum()), micro_batches=1, max_completion_length=7)
    loss, _ = policy_loss(logp, old, adv, mask, counts, loss_settings(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28))
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    per_token = -torch.min(ratio * a, ratio.clamp(0.8, 1.28) * a)
    m = mask.double()
    want = {
        "grpo": ((per_token * m).sum(1) / m.sum(1)).mean(),
        "bnpo": (per_token * m).sum() / m.sum(),
        "dr_grpo": (per_token * m).sum() / (4 * 7),
        "dapo": (per_token * m).sum() / m.sum(),
    }[loss_type]
    assert abs(loss.item() - want.item()) <= 1e-12 * max(1.0, abs(want.item()))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_micro_batches_add_up_to_the_full_batch(loss_type):
    logp, old, adv, mask = _inputs(B=6, T=4, seed=1)  # rows 0-2 hold 8 tokens, rows 3-5 hold 12
    counts = BatchCounts(sequences=6, tokens=int(mask.sum()), micro_batches=1, max_completion_length=4)
    full, _ = policy_loss(logp, old, adv, mask, counts, loss_settings(loss_type=loss_type, beta=0.1), old - 0.1)
    full_grad, = torch.autograd.grad(full, logp)
    split_counts = BatchCounts(sequences=6, tokens=int(mask.sum()), micro_batches=2, max_completion_length=4)
    halves = (slice(0, 3), slice(3, 6))
    total, grad = 0.0, torch.zeros_like(logp)
    for rows in halves:
        part, _ = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], split_counts,
                              loss_settings(loss_type=loss_type, beta=0.1), old[rows] - 0.1)
        total += part.item()
        grad += torch.autograd.grad(part, logp)[0]
    if loss_type != "bnpo":
        assert total == pytest.approx(full.item(), rel=1e-12)
        assert torch.allclose(grad, full_grad, rtol=1e-12)
        return
    # bnpo: each micro-batch's own token mean, then the mean of the two, written out here; with 8 and 12
    # tokens in the halves, not the full batch's token mean
    ratio, a, d = torch.exp(logp - old), adv[:, None], (old - 0.1) - logp
    per_token = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a) + 0.1 * (torch.exp(d) - d - 1)
    m = mask.double()
    want = sum((per_token[rows] * m[rows]).sum() / m[rows].sum() for rows in halves) / 2
    want_grad, = torch.autograd.grad(want, logp)
    assert total == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(grad, want_grad, rtol=1e-12)
    assert total != pytest.approx(full.item(), rel=1e-3)


def test_padding_never_enters_the_loss():
    logp, old, adv, mask = _inputs()
    counts = BatchCounts(sequences=4, tokens=int(mask.sum()), micro_batches=1, max_completion_length=5)
    loss, _ = policy_loss(logp, old, adv, mask, counts, loss_settings(loss_type="grpo"))
    garbage = old.clone()
    garbage[mask == 0] = 50.0  # absurd values where the mask is 0
    loss2, _ = policy_loss(logp, garbage, adv, mask, counts, loss_settings(loss_type="grpo"))
    assert loss.item() == pytest.approx(loss2.item(), rel=1e-12)
    grad, = torch.autograd.grad(loss, logp)
    assert (grad[mask == 0] == 0).all()


def test_gradient_step_raises_positive_and_lowers_negative_advantage_logprobs():
    logp = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.long)
    counts = BatchCounts(sequences=2, tokens=6, micro_batches=1, max_completion_length=3)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, counts, loss_settings(loss_type="grpo"))
    grad, = torch.autograd.grad(loss, logp)
    assert (grad[0] < 0).all() and (grad[1] > 0).all()  # descent raises row 0, lowers row 1


def test_kl_penalty_adds_beta_times_k3_and_is_reported():
    logp, old, adv, mask = _inputs()
    ref = old - 0.2
    counts = BatchCounts(sequences=4, tokens=int(mask.sum()), micro_batches=1, max_completion_length=5)
    base, _ = policy_loss(logp, old, adv, mask, counts, loss_settings(loss_type="dapo"))
    with_kl, stats = policy_loss(logp, old, adv, mask, counts, loss_settings(loss_type="dapo", beta=0.5), ref)
    kl = (kl_k3(logp, ref) * mask).sum()
    assert with_kl.item() == pytest.approx(base.item() + 0.5 * kl.item() / mask.sum().item(), rel=1e-12)
    assert stats.kl_sum == pytest.approx(kl.item())
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, mask, counts, loss_settings(beta=0.5))


def test_clipping_stats_count_clipped_tokens():
    logp = torch.log(torch.tensor([[1.5, 1.0], [0.5, 1.0]], dtype=torch.float64))
    old = torch.zeros(2, 2, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.long)
    counts = BatchCounts(sequences=2, tokens=4, micro_batches=1, max_completion_length=2)
    _, stats = policy_loss(logp, old, adv, mask, counts, loss_settings(epsilon_low=0.2, epsilon_high=0.2))
    assert stats.clip_high_sum == 1 and stats.clip_low_sum == 1


def test_entropy_is_reported_over_masked_tokens():
    logp, old, adv, mask = _inputs()
    entropy = torch.rand(4, 5, dtype=torch.float64)
    counts = BatchCounts(sequences=4, tokens=int(mask.sum()), micro_batches=1, max_completion_length=5)
    _, stats = policy_loss(logp, old, adv, mask, counts, loss_settings(), entropy_BT=entropy)
    assert stats.entropy_sum == pytest.approx((entropy * mask).sum().item())
