"""Every loss and advantage variant against a plain re-implementation of its paper's formula.

The references below are written from the papers with explicit loops over sequences and tokens,
in float64, on tiny random tensors with padded masks and several group sizes; covey's table-driven
code must match them in value and gradient to a relative error below 1e-10.
"""

import math

import pytest
import torch

from covey import core
from covey.core import BatchCounts, policy_loss, reported_metrics
from tests.conftest import loss_settings

TOL = 1e-10


def rel_err(a, b):
    a = torch.as_tensor(a, dtype=torch.float64).detach()
    b = torch.as_tensor(b, dtype=torch.float64).detach()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


def make_batch(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = logp.detach() + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return logp, old, ref, adv, mask


def seq_tokens(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def ref_clipped_term(r, a, eps_low, eps_high, delta=None, c=None):
    """min(r A, clip(r) A) with the optional caps, for one token (a scalar tensor)."""
    unclipped = r if delta is None else torch.clamp(r, max=delta)
    value = torch.min(unclipped * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
    if c is not None and a < 0:
        value = torch.max(value, c * a)
    return value


def ref_kl(kind, lp, rf):
    return {"k1": lp - rf, "k2": 0.5 * (lp - rf) ** 2, "k3": torch.exp(rf - lp) - (rf - lp) - 1}[kind]


def ref_sapo_gate(r, a, tau_pos, tau_neg):
    """SAPO's soft gate f(r) = 4 / tau * sigmoid(tau (r - 1)), tau_pos for a positive advantage."""
    tau = tau_pos if a > 0 else tau_neg
    return 4 / tau * torch.sigmoid(tau * (r - 1))


def ref_vespo_phi(logp_i, old_i, a, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's kernel phi(W) = W^k exp(lambda (1 - W)) of the sequence's importance weight
    W = prod_t pi(o_t) / pi_old(o_t) (k, lambda: the _pos ones for A >= 0), held constant."""
    W = math.prod(math.exp(float((lp - o).detach())) for lp, o in zip(logp_i, old_i))
    k, lam = (k_pos, lambda_pos) if a >= 0 else (k_neg, lambda_neg)
    return W ** k * math.exp(lam * (1 - W))


def reference_loss(logp, old, ref, adv, mask, loss_type, eps_low=0.2, eps_high=0.2, beta=0.0, kl="k3",
                   delta=None, c=None, level="token", L=None, sapo=(1.0, 1.05), vespo=(2.0, 3.0, 3.0, 2.0)):
    B = logp.shape[0]
    per_seq, total = [], []
    for i in range(B):
        toks = seq_tokens(mask, i)
        if level == "sequence":  # GSPO: s_i = exp(mean_t log r_it)
            s = torch.exp(sum(logp[i, t] - old[i, t] for t in toks) / len(toks))
        if loss_type == "vespo":
            phi = ref_vespo_phi([logp[i, t] for t in toks], [old[i, t] for t in toks], adv[i], *vespo)
        terms = []
        for t in toks:
            r = s if level == "sequence" else torch.exp(logp[i, t] - old[i, t])
            if loss_type == "cispo":  # MiniMax-M1's cap 1 + eps_IS_high, given as epsilon_high (TRL's form)
                term = torch.clamp(r, max=eps_high).detach() * adv[i] * logp[i, t]
            elif loss_type == "sapo":
                term = ref_sapo_gate(r, adv[i], *sapo) * adv[i]
            elif loss_type == "vespo":  # a REINFORCE term reweighted by the sequence's phi
                term = phi * adv[i] * logp[i, t]
            else:
                term = ref_clipped_term(r, adv[i], eps_low, eps_high, delta, c)
            if beta:
                term = term - beta * ref_kl(kl, logp[i, t], ref[i, t])
            terms.append(-term)
        per_seq.append(sum(terms) / len(toks))
        total.extend(terms)
    n_tokens = int(mask.sum())
    return {
        "grpo": sum(per_seq) / B,
        "bnpo": sum(total) / n_tokens,
        "dr_grpo": sum(total) / (B * L),
        "dapo": sum(total) / n_tokens,
        "cispo": sum(total) / n_tokens,
        "sapo": sum(per_seq) / B,  # the SAPO paper's 1/G sum_i 1/|o_i| sum_t
        "vespo": sum(total) / n_tokens,
    }[loss_type]


def covey_loss(logp, old, ref, adv, mask, L, **settings):
    counts = BatchCounts(sequences=logp.shape[0], tokens=float(mask.sum()), micro_batches=1, max_completion_length=L)
    loss, stats = policy_loss(logp, old, adv, mask, counts, loss_settings(**settings),
                              ref if settings.get("beta") else None)
    return loss, stats


CASES = [
    dict(loss_type="grpo"),
    dict(loss_type="bnpo"),
    dict(loss_type="dr_grpo"),
    dict(loss_type="dapo", epsilon_high=0.28),
    dict(loss_type="cispo", epsilon_high=1.1),
    dict(loss_type="cispo", epsilon_high=5.0),
    dict(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4),
    dict(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=0.2, epsilon_high=0.2),
    dict(loss_type="dapo", delta=1.5),
    dict(loss_type="grpo", clip_ratio_c=1.5),
    dict(loss_type="grpo", beta=0.1, kl_estimator="k1"),
    dict(loss_type="dapo", beta=0.1, kl_estimator="k2"),
    dict(loss_type="dr_grpo", beta=0.04, kl_estimator="k3"),
    dict(loss_type="sapo"),
    dict(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=4.0),
    dict(loss_type="sapo", importance_sampling_level="sequence"),
    dict(loss_type="sapo", beta=0.1, kl_estimator="k3"),
    dict(loss_type="vespo"),
    dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=5.0, vespo_lambda_neg=4.0),
    dict(loss_type="vespo", beta=0.1, kl_estimator="k2"),
]


@pytest.mark.parametrize("G", [2, 4, 8])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_and_gradient_equal_the_papers_formula(case, G):
    B, T, L = 2 * G, 5, 7
    logp, old, ref, adv, mask = make_batch(B, T, seed=G)
    settings = dict(case)
    loss, _ = covey_loss(logp, old, ref, adv, mask, L, **settings)
    grad, = torch.autograd.grad(loss, logp)
    want = reference_loss(logp, old, ref, adv, mask, settings["loss_type"], settings.get("epsilon_low", 0.2),
                          settings.get("epsilon_high", 0.2), settings.get("beta", 0.0),
                          settings.get("kl_estimator", "k3"), settings.get("delta"), settings.get("clip_ratio_c"),
                          settings.get("importance_sampling_level", "token"), L,
                          (settings.get("sapo_temperature_pos", 1.0), settings.get("sapo_temperature_neg", 1.05)),
                          tuple(settings.get(f"vespo_{name}", default) for name, default in
                                (("k_pos", 2.0), ("lambda_pos", 3.0), ("k_neg", 3.0), ("lambda_neg", 2.0))))
    want_grad, = torch.autograd.grad(want, logp)
    assert rel_err(loss, want) < TOL
    assert rel_err(grad, want_grad) < TOL
    assert (grad[mask == 0] == 0).all()


def test_gspo_token_equals_gspo_with_sequence_advantages():
    """GSPO-token (sg tricks) has GSPO's value and gradient when every token shares its sequence's A."""
    logp, old, ref, adv, mask = make_batch(6, 4, seed=3)
    loss, _ = covey_loss(logp, old, ref, adv, mask, 4, loss_type="grpo", importance_sampling_level="sequence")
    grad, = torch.autograd.grad(loss, logp)
    s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1))  # plain GSPO, gradient through s itself
    gspo = -torch.min(s * adv, torch.clamp(s, 0.8, 1.2) * adv).mean()
    gspo_grad, = torch.autograd.grad(gspo, logp)
    assert rel_err(loss, gspo) < TOL and rel_err(grad, gspo_grad) < TOL


def test_dual_clip_bounds_negative_advantage_objective():
    r = torch.tensor([[10.0]], dtype=torch.float64)
    counts = BatchCounts(1, 1.0, 1, 1)
    loss, _ = policy_loss(torch.log(r), torch.zeros(1, 1, dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64),
                          torch.ones(1, 1), counts, loss_settings(loss_type="grpo", clip_ratio_c=3.0))
    assert loss.item() == pytest.approx(3.0)  # without dual-clip it would be 10


def test_delta_caps_the_unclipped_ratio():
    r = torch.tensor([[10.0]], dtype=torch.float64)
    counts = BatchCounts(1, 1.0, 1, 1)
    loss, _ = policy_loss(torch.log(r), torch.zeros(1, 1, dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64),
                          torch.ones(1, 1), counts, loss_settings(loss_type="grpo", delta=4.0))
    assert loss.item() == pytest.approx(4.0)


def test_sapo_gate_is_the_policy_gradient_at_ratio_one_and_fades_smoothly_away_from_it():
    """SAPO's gradient weight on grad logp is f'(r) r = 4 sigmoid (1 - sigmoid) r: 1 at r = 1 (the
    plain policy gradient), small but never 0 far off, sooner for the larger negative-side tau."""
    r = torch.tensor([[1.0, 1.5, 3.0, 0.2]], dtype=torch.float64)
    counts = BatchCounts(1, 4.0, 1, 4)
    weights = {}
    for a in (1.0, -1.0):
        logp = torch.log(r).requires_grad_(True)
        settings = loss_settings(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=2.0)
        loss, stats = policy_loss(logp, torch.zeros_like(r), torch.tensor([a], dtype=torch.float64), torch.ones(1, 4),
                                  counts, settings)
        grad, = torch.autograd.grad(loss, logp)
        weights[a] = (-grad * 4 / a)[0]  # the weight per token (sequence mean over 4 tokens)
        assert stats.clip_high_sum == stats.clip_low_sum == 0  # a soft gate clips nothing
        assert "clip_ratio" not in reported_metrics(settings)  # and reports no clip ratios
    for a, tau in ((1.0, 1.0), (-1.0, 2.0)):
        sig = torch.sigmoid(tau * (r[0] - 1))
        assert rel_err(weights[a], 4 * sig * (1 - sig) * r[0]) < TOL
        assert weights[a][0].item() == pytest.approx(1.0) and (weights[a] > 0).all()
    assert weights[-1.0][2] < weights[1.0][2]


def test_vespo_weight_is_one_on_policy_and_reshapes_the_sequence_weight():
    """phi(1) = 1: on policy VESPO is REINFORCE; W is the product of the token ratios (no length
    normalisation), and the gradient per token is -phi(W) A / N whatever the ratio of that token."""
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]], dtype=torch.float64)).requires_grad_(True)
    counts = BatchCounts(1, 3.0, 1, 3)
    settings = loss_settings(loss_type="vespo")
    on_policy, stats = policy_loss(logp, logp.detach(), torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 3), counts,
                                   settings)
    assert stats.vespo_phi_sum == pytest.approx(1.0)
    assert rel_err(on_policy, -2.0 * logp.sum() / 3) < TOL
    old = logp.detach() - torch.tensor([[0.3, -0.1, 0.2]], dtype=torch.float64)  # W = e^0.4
    loss, stats = policy_loss(logp, old, torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 3), counts, settings)
    grad, = torch.autograd.grad(loss, logp)
    W = math.exp(0.4)
    phi = W ** 2.0 * math.exp(3.0 * (1 - W))
    assert stats.vespo_phi_sum == pytest.approx(phi, rel=1e-12)
    assert rel_err(grad, torch.full((1, 3), -phi * 2.0 / 3, dtype=torch.float64)) < TOL


def test_vespo_folds_token_engine_weights_into_its_sequence_weight():
    """pi / pi_old times the engine correction pi_old / pi_engine is pi / pi_engine: the weights enter W,
    they do not multiply the token losses."""
    logp, old, ref, adv, mask = make_batch(4, 5, seed=7)
    engine_BT = torch.exp(0.2 * torch.randn(4, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64))
    counts = BatchCounts(4, float(mask.sum()), 1, 5)
    loss, _ = policy_loss(logp, old, adv, mask, counts, loss_settings(loss_type="vespo"), engine_weights=engine_BT)
    grad, = torch.autograd.grad(loss, logp)
    engine_old = old - torch.log(engine_BT)  # pi_old * pi_engine / pi_old: the ratio the weights make
    want = reference_loss(logp, engine_old, ref, adv, mask, "vespo", L=5)
    want_grad, = torch.autograd.grad(want, logp)
    assert rel_err(loss, want) < TOL and rel_err(grad, want_grad) < TOL


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "sapo"])
def test_off_policy_mask_drops_negative_sequences_that_drifted_past_the_threshold(loss_type):
    """DeepSeek-V3.2 eq. 9: M_i = 0 iff A_i < 0 and 1/|o_i| sum_t log(pi_behaviour / pi) > delta."""
    logp, old, ref, adv, mask = make_batch(8, 5, seed=4)
    drift_scale_B1 = torch.tensor([2.0, 0.1] * 4, dtype=torch.float64)[:, None]  # every other sequence drifted far
    behaviour = logp.detach() + drift_scale_B1 * torch.rand(8, 5, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    delta = 0.5
    counts = BatchCounts(8, float(mask.sum()), 1, 5)
    loss, stats = policy_loss(logp, old, adv, mask, counts, loss_settings(loss_type=loss_type, off_policy_mask_threshold=delta),
                              behaviour_logp_BT=behaviour)
    grad, = torch.autograd.grad(loss, logp)
    dropped = [i for i in range(8) if adv[i] < 0 and
               sum(float((behaviour[i, t] - logp[i, t]).detach()) for t in seq_tokens(mask, i)) / len(seq_tokens(mask, i)) > delta]
    assert 0 < len(dropped) < int((adv < 0).sum())  # the example exercises both outcomes
    assert stats.off_policy_masked == len(dropped)
    kept_adv = adv.clone()
    kept_adv[dropped] = 0.0  # a dropped sequence contributes nothing to the policy term
    want = reference_loss(logp, old, ref, kept_adv, mask, loss_type, L=5)
    want_grad, = torch.autograd.grad(want, logp)
    assert rel_err(loss, want) < TOL and rel_err(grad, want_grad) < TOL


@pytest.mark.parametrize("top_entropy_quantile", [1.0, 0.5])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_entropy_bonus_is_the_coefficient_times_the_mean_entropy_of_the_trained_tokens(loss_type, top_entropy_quantile):
    logp, old, ref, adv, mask = make_batch(6, 5, seed=2)
    entropy = torch.rand(6, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64).requires_grad_(True)
    counts = BatchCounts(6, float(mask.sum()), 2, 5)  # one micro-batch of two
    settings = dict(loss_type=loss_type, top_entropy_quantile=top_entropy_quantile)
    plain, _ = policy_loss(logp, old, adv, mask, counts, loss_settings(**settings), entropy_BT=entropy.detach())
    bonus = loss_settings(**settings, entropy_bonus=core.EntropyBonus(coef=0.3))
    loss, stats = policy_loss(logp, old, adv, mask, counts, bonus, entropy_BT=entropy, entropy_coef=0.3)
    grad, = torch.autograd.grad(loss, entropy)
    trained = mask.bool()
    if top_entropy_quantile < 1:
        trained &= entropy.detach() >= torch.quantile(entropy.detach()[mask == 1], 1 - top_entropy_quantile)
    mean_entropy = entropy[trained].sum() / trained.sum()
    assert rel_err(loss, plain - 0.3 * mean_entropy / 2) < TOL
    assert rel_err(grad, -0.3 * trained.double() / trained.sum() / 2) < TOL
    assert stats.entropy_bonus_tokens == trained.sum().item()


def test_adaptive_entropy_control_follows_skywork_or1():
    """Skywork-OR1: after each step c <- c + delta if the entropy e <= target else c - delta, within
    [c_min, c_max]; a step applies c only while the last measured e <= target (none before the first)."""
    control = core.EntropyBonus(coef=0.05, adaptive=True, target=0.5, delta=0.1, coef_min=0.0, coef_max=0.25)
    coef, last, coefs = 0.05, None, []
    for e in [0.4, 0.3, 0.6, 0.2, 0.1, 0.1, 0.9, 0.9, 0.9]:
        assert control.applied(coef, last) == (coef if last is not None and last <= 0.5 else 0.0)
        moved = control.moved(coef, e)
        assert moved == pytest.approx(min(max(coef + (0.1 if e <= 0.5 else -0.1), 0.0), 0.25))
        coef, last = moved, e
        coefs.append(coef)
    assert max(coefs) == 0.25 and min(coefs) == 0.0  # both bounds reached
    assert core.EntropyBonus(coef=0.2).applied(0.2, None) == 0.2  # a fixed coefficient always applies
    assert core.EntropyBonus(adaptive=True).enabled and not core.EntropyBonus().enabled


# ---- advantages ---------------------------------------------------------------------------------


def reference_advantages(rewards, G, scale, eps=core.ADVANTAGE_EPS):
    out, batch = [], [r for r in rewards if not math.isnan(r)]
    batch_mean = sum(batch) / len(batch)
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in batch) / (len(batch) - 1))
    for g in range(0, len(rewards), G):
        group = [r for r in rewards[g:g + G] if not math.isnan(r)]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1)) if len(group) > 1 else 0.0
        denominator = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        out.extend(0.0 if math.isnan(r) else (r - mean) / denominator for r in rewards[g:g + G])
    return out


@pytest.mark.parametrize("G", [2, 4, 8])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_the_formula_with_none_rewards_ignored(G, scale):
    g = torch.Generator().manual_seed(G)
    rewards = torch.randn(3 * G, generator=g, dtype=torch.float64)
    rewards[1] = math.nan  # one sample whose reward functions all said None
    rewards[G: 2 * G] = 0.5  # a constant group
    adv, zero_std = core.group_advantages(rewards, G, scale)
    assert rel_err(adv, reference_advantages(rewards.tolist(), G, scale)) < TOL
    assert adv[1] == 0 and (adv[G:2 * G] == 0).all()
    assert zero_std.tolist() == [G == 2, True, False]  # with G = 2 the first group has one scored sample


def test_normalize_then_sum_normalises_each_reward_before_weighting():
    G = 4
    g = torch.Generator().manual_seed(0)
    rewards = torch.stack([torch.randn(8, generator=g, dtype=torch.float64) * 100,  # a reward on a large scale
                           torch.randn(8, generator=g, dtype=torch.float64)], dim=1)
    rewards[2, 1] = math.nan  # the second function does not apply to sample 2
    weights = torch.tensor([1.0, 2.0], dtype=torch.float64)
    adv, _ = core.advantages_from_rewards(rewards, weights, G, aggregation="normalize_then_sum")
    per_func = [reference_advantages(rewards[:, f].tolist(), G, "group") for f in range(2)]
    summed = [sum(w * (0.0 if math.isnan(rewards[i, f]) else per_func[f][i]) for f, w in enumerate([1.0, 2.0]))
              for i in range(8)]
    mean = sum(summed) / 8
    std = math.sqrt(sum((x - mean) ** 2 for x in summed) / 7)
    assert rel_err(adv, [(x - mean) / (std + core.ADVANTAGE_EPS) for x in summed]) < TOL
    plain, _ = core.advantages_from_rewards(rewards, weights, G, aggregation="sum_then_normalize")
    # the weighted sum first (sample 2's None left out of it), then one normalisation
    weighted = [sum(w * float(rewards[i, f]) for f, w in enumerate([1.0, 2.0]) if not math.isnan(rewards[i, f]))
                for i in range(8)]
    assert rel_err(plain, reference_advantages(weighted, G, "group")) < TOL


# ---- entropy masking and the engine correction --------------------------------------------------


def test_top_entropy_quantile_trains_only_high_entropy_tokens():
    logp, old, ref, adv, mask = make_batch(4, 6, seed=1)
    entropy = torch.rand(4, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    counts = BatchCounts(4, float(mask.sum()), 1, 6)
    loss, _ = policy_loss(logp, old, adv, mask, counts, loss_settings(loss_type="dapo", top_entropy_quantile=0.25),
                          entropy_BT=entropy)
    grad, = torch.autograd.grad(loss, logp)
    valid = sorted(entropy[mask == 1].tolist())
    threshold = torch.quantile(torch.tensor(valid, dtype=torch.float64), 0.75).item()
    keep = (entropy >= threshold) & (mask == 1)
    assert 0 < int(keep.sum()) < int(mask.sum())
    assert (grad[~keep] == 0).all() and (grad[keep] != 0).any()
    full_term = -torch.min(torch.exp(logp - old) * adv[:, None], torch.clamp(torch.exp(logp - old), 0.8, 1.2) * adv[:, None])
    want = (full_term * keep).sum() / mask.sum()  # still divided by every completion token (as in the paper)
    assert rel_err(loss, want) < TOL


@pytest.mark.parametrize("mode", core.ENGINE_CORRECTION_MODES)
def test_engine_importance_weights(mode):
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    engine = torch.tensor([[-1.5, -1.0, -0.5], [-1.1, -0.9, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    w = core.engine_importance_weights(trainer, engine, mask, core.EngineCorrection.from_mode(mode, clip_max=1.5, clip_min=0.5))
    token = [[math.exp(0.5), math.exp(-1.0), 1.0], [math.exp(0.1), math.exp(-0.1), 1.0]]
    if mode.startswith("sequence"):
        token = [[math.prod(row)] for row in token]  # product of token ratios = exp(sum of log-ratios)
    bound = (lambda x: min(max(x, 0.5), 1.5)) if mode.endswith("truncate") else (lambda x: x if 0.5 <= x <= 1.5 else 0.0)
    assert rel_err(w, [[bound(x) for x in row] for row in token]) < TOL


def test_engine_weights_multiply_the_policy_term():
    logp, old, ref, adv, mask = make_batch(4, 3, seed=2)
    counts = BatchCounts(4, float(mask.sum()), 1, 3)
    weights = torch.rand(4, 1, dtype=torch.float64)
    plain, _ = policy_loss(logp, old, adv * weights.squeeze(1), mask, counts, loss_settings(loss_type="grpo", epsilon_low=9, epsilon_high=9))
    weighted, _ = policy_loss(logp, old, adv, mask, counts, loss_settings(loss_type="grpo", epsilon_low=9, epsilon_high=9),
                              engine_weights=weights)
    assert rel_err(weighted, plain) < TOL  # with clipping out of reach, w * (r A) = r (w A)


def test_k1_k2_k3_agree_at_zero_and_k3_is_nonnegative():
    logp = -torch.rand(3, 4, dtype=torch.float64)
    for name, estimator in core.KL_ESTIMATORS.items():
        assert torch.equal(estimator(logp, logp), torch.zeros_like(logp)), name
    assert (core.KL_ESTIMATORS["k3"](logp, logp - torch.rand(3, 4, dtype=torch.float64)) >= 0).all()


def test_every_loss_type_of_the_registry_is_known_everywhere():
    """core.LOSS_TYPES is the one list of loss types: a variant missing from any layer that names them (the
    config's choices, covey verify's written-out formulas, its checks of TRL's loss, the table of
    docs/algorithms.md) fails here, and so does a name there that the registry lacks."""
    import dataclasses
    from pathlib import Path

    from covey.config import GRPOConfig
    from covey.verify import formulas, trl_training

    choices = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type").metadata["choices"]
    algorithms = (Path(__file__).parent.parent / "docs" / "algorithms.md").read_text()
    documented = {line.split("`")[1] for line in algorithms.splitlines() if line.startswith("| `")}
    places = {"the config's choices": set(choices), "verify's objectives": set(formulas.OBJECTIVES_WRITTEN_OUT),
              "verify's aggregations": set(formulas.AGGREGATIONS_WRITTEN_OUT),
              "verify --trl's aggregations": set(trl_training.TRL_AGGREGATIONS)}
    for name, (objective, aggregation) in core.LOSS_TYPES.items():
        assert objective in core.POLICY_OBJECTIVES and aggregation in core.LOSS_NORMALISERS, name
        missing = [where for where, names in {**places, "docs/algorithms.md": documented}.items() if name not in names]
        assert not missing, f"loss_type {name} is missing from {', '.join(missing)}"
    assert not {where: names - set(core.LOSS_TYPES) for where, names in places.items() if names - set(core.LOSS_TYPES)}


def test_every_reward_scale_and_kl_estimator_is_written_out_again_in_verify():
    """verify's independent formulas cover each entry of core's tables (whose keys are the config's choices)."""
    from covey.verify import formulas

    assert set(formulas.SPREADS_WRITTEN_OUT) == set(core.REWARD_SCALES)
    assert set(formulas.KL_WRITTEN_OUT) == set(core.KL_ESTIMATORS)
