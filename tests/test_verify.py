"""covey verify passes a clean pipeline and names the right stage for each planted defect.

Each mutation monkeypatches one of covey's own functions the way a real bug would break it; the
pipeline is a tiny random Llama with two rewards (one reading the `answer` column) and a KL term.
"""

import dataclasses
import sys

import pytest
import torch

import covey.core as core
import covey.rollout.fast.engine as fast_rollout
import covey.train.forward as logprobs
import covey.data.text as text
import covey.train.generation as generation_module
import covey.train.rounds as rounds_module
from covey.train.policy import Policy
import covey.rollout.engine as engine_module
from covey import GRPOConfig
from covey.agents import HermesFormat, ParsedTurn, ToolCall
from covey.rollout import FastEngine
from covey.rollout.engine import TurnByTurn, padded_rollout
from covey.verify import STAGES, verify
from tests.conftest import make_model

ROWS = [{"prompt": [{"role": "system", "content": "answer"}, {"role": "user", "content": f"what is {i} + {i}?"}],
         "answer": str(2 * i)} for i in range(6)]


def variety(completions, **kwargs):
    return [len(set(c[0]["content"])) / 8 for c in completions]


def mentions_answer(completions, answer, **kwargs):
    return [float(a in c[0]["content"]) + len(c[0]["content"]) / 100 for c, a in zip(completions, answer)]


def run_verify(tokenizer):
    args = GRPOConfig(num_generations=4, max_completion_length=10, beta=0.1, temperature=0.7,
                      reward_weights=[1.0, 2.0], seed=3)
    return verify(args, num_prompts=2, model=make_model(len(tokenizer), seed=5), processing_class=tokenizer,
                  train_dataset=ROWS, reward_funcs=[variety, mentions_answer])


def test_clean_pipeline_passes(tokenizer):
    report = run_verify(tokenizer)
    failures = [c for c in report.checks if c.status == "FAIL"]
    assert not failures, failures
    # async: under async_generation only; images: for prompts that show pictures (tests/test_vision.py);
    # probes: under probes=True, as covey verify runs (tests/test_reward_probes_in_runs.py)
    assert {c.stage for c in report.checks} == set(STAGES) - {"async", "images", "probes"}


def _shifted_rewards(original):
    def shifted(*args, **kwargs):
        return torch.roll(original(*args, **kwargs), shifts=1, dims=0)
    return shifted


def _misaligned_columns(original):
    def misaligned(rows):
        return {k: v[1:] + v[:1] for k, v in original(rows).items()}
    return misaligned


def _without_eos(original):
    def mask(ids, eos_ids, lengths=None):
        m = original(ids, eos_ids, lengths)
        ends_with_eos = torch.isin(ids.gather(1, (m.sum(1, keepdim=True) - 1).clamp(min=0)), torch.tensor(eos_ids))
        last = (m.sum(1) - 1).clamp(min=0)
        m[torch.arange(len(m))[ends_with_eos.squeeze(1)], last[ends_with_eos.squeeze(1)]] = 0
        return m
    return mask


def _ratio_against_reference(original):
    def loss(logp, old, adv, mask, counts, settings, ref=None, *args, **kwargs):
        return original(logp, ref if ref is not None else old, adv, mask, counts, settings, ref, *args, **kwargs)
    return loss


def _plant_in_core(mp, name, value):
    """Replace a function of the maths wherever it is called: through ``covey.core`` (the step, verify) and
    inside the module of covey.core that defines it (its callers there)."""
    mp.setattr(sys.modules[getattr(core, name).__module__], name, value)
    mp.setattr(core, name, value)


def _no_gradient_step(policy, max_grad_norm, progress):
    policy.optimizer.zero_grad(set_to_none=True)
    return 0.0, dataclasses.replace(progress, global_step=progress.global_step + 1)


def _optimistic_clip(t, s):
    ratio, adv = t.ratio_BT, t.advantages_B1
    return -torch.maximum(ratio * adv, torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high) * adv), {}


def _negated_logprobs(mp) -> None:
    """The log-probs with their sign flipped where both ways of the output head take them from the
    log-softmax (``core.logprob_at``: ``core.token_logprobs`` and the head's own softmax)."""
    _plant_in_core(mp, "logprob_at", lambda log_p, ids: -_ORIGINAL_LOGPROB_AT(log_p, ids))


MUTATIONS = {
    "log-softmax operands reversed": ("logprobs", lambda mp: _negated_logprobs(mp)),
    "advantage eps 1e4": ("advantages", lambda mp: _plant_in_core(
        mp, "group_advantages", lambda r, g, scale="group", eps=0: _ORIGINAL_GROUP_ADV(r, g, scale, 1e4))),
    "advantage sign flipped": ("advantages", lambda mp: _plant_in_core(
        mp, "advantages_from_rewards", lambda *a, **k: (lambda out: (-out[0], out[1]))(_ORIGINAL_ADV(*a, **k)))),
    "decode bug only for unterminated reasoning": ("decode", lambda mp: mp.setattr(
        text, "answer_after_reasoning",
        lambda t: t.split("<think>", 1)[1] if "<think>" in t and "</think>" not in t else _ORIGINAL_AFTER(t))),
    "ratio against the reference instead of old": ("loss", lambda mp: _plant_in_core(
        mp, "policy_loss", _ratio_against_reference(core.policy_loss))),
    "clipping takes the optimistic bound (max for min)": ("loss", lambda mp: mp.setitem(
        core.POLICY_OBJECTIVES, "clipped", core.Objective(_optimistic_clip))),
    "KL sign flipped": ("loss", lambda mp: mp.setitem(
        core.KL_ESTIMATORS, "k3", lambda logp, ref: -(torch.exp(ref - logp) - (ref - logp) - 1))),
    "padding included in the loss mask": ("logprobs", lambda mp: mp.setattr(
        fast_rollout, "completion_mask", lambda ids, eos, lengths=None: torch.ones_like(ids))),
    "EOS excluded from the mask": ("logprobs", lambda mp: mp.setattr(
        fast_rollout, "completion_mask", _without_eos(core.completion_mask))),
    "rewards shifted by one sample": ("rewards", lambda mp: mp.setattr(
        rounds_module, "score_completions", _shifted_rewards(rounds_module.score_completions))),
    "answer column misaligned with prompts": ("data", lambda mp: mp.setattr(
        rounds_module, "extra_columns", _misaligned_columns(rounds_module.extra_columns))),
    "loss normalised by the wrong count": ("loss", lambda mp: mp.setitem(
        core.LOSS_NORMALISERS, "generation_token_mean", lambda loss, mask, n: (loss * mask).sum() / n.sequences)),
    "gradients not applied": ("loss", lambda mp: mp.setattr(
        Policy, "apply_gradients", _no_gradient_step)),
    "sampling temperature ignored by the trainer": ("logprobs", lambda mp: mp.setattr(  # the training pass's own
        logprobs, "completion_logprobs",
        lambda model, batch, temperature=1.0, **k: _ORIGINAL_LOGPROBS(model, batch, 1.0, **k))),
    "reward weights ignored": ("rewards", lambda mp: _plant_in_core(
        mp, "weighted_reward_sum", lambda r, w: _ORIGINAL_SUM(r, torch.ones_like(w)))),
    "completions decoded with their prompt": ("decode", lambda mp: mp.setattr(
        generation_module, "decode_completions",
        lambda tok, ids, mask, conv, strip=False: (lambda out: (
            [[{"role": "assistant", "content": "user: " + c[0]["content"]}] for c in out[0]], out[1]))(
            text.decode_completions(tok, ids, mask, conv, strip)))),
    "batch advantages halved by the trainer": ("advantages", lambda mp: _plant_in_core(
        mp, "advantages_from_rewards", lambda r, *a, **k: (lambda out: (
            out[0] * (0.5 if r.shape[0] > 4 else 1.0), out[1]))(_ORIGINAL_ADV(r, *a, **k)))),
}
_ORIGINAL_GROUP_ADV = core.group_advantages
_ORIGINAL_LOGPROB_AT = core.logprob_at
_ORIGINAL_ADV = core.advantages_from_rewards
_ORIGINAL_LOGPROBS = logprobs.completion_logprobs
_ORIGINAL_AFTER = text.answer_after_reasoning
_ORIGINAL_SUM = core.weighted_reward_sum
_ORIGINAL_TOKEN_RATIO = core.IMPORTANCE_LEVELS["token"]


@pytest.mark.parametrize("defect", list(MUTATIONS))
def test_planted_defect_fails_at_the_right_stage(defect, tokenizer, monkeypatch):
    stage, plant = MUTATIONS[defect]
    plant(monkeypatch)
    report = run_verify(tokenizer)
    assert report.first_failure == stage, [(c.stage, c.name, c.value) for c in report.checks if c.status == "FAIL"]


def test_a_kl_term_without_its_bias_correction_weight_fails_the_loss_stage(tokenizer, monkeypatch):
    """use_bias_correction_kl multiplies the KL term by the importance ratio: at ratio 1 the weight is 1,
    so only the check away from ratio 1, against a reference apart from the policy, can see it dropped."""
    def without_kl_weight(logp, old, mask):
        log_ratio, _ = _ORIGINAL_TOKEN_RATIO(logp, old, mask)
        return log_ratio, torch.zeros_like(log_ratio)

    args = GRPOConfig(num_generations=4, max_completion_length=10, beta=0.1, use_bias_correction_kl=True,
                      temperature=0.7, reward_weights=[1.0, 2.0], seed=3)

    def run():
        return verify(args, num_prompts=2, model=make_model(len(tokenizer), seed=5), processing_class=tokenizer,
                      train_dataset=ROWS, reward_funcs=[variety, mentions_answer])

    assert run().first_failure is None
    monkeypatch.setitem(core.IMPORTANCE_LEVELS, "token", without_kl_weight)
    report = run()
    assert report.first_failure == "loss"
    assert [c.name for c in report.checks if c.status == "FAIL"] == ["value equals the formula away from ratio 1"]


def test_a_reward_function_that_raises_fails_the_rewards_stage(tokenizer):
    def broken(completions, **kwargs):
        if len(completions) > 2:  # fine on the pre-flight call, breaks on a real batch
            raise KeyError("score")
        return [0.0] * len(completions)

    report = verify(GRPOConfig(num_generations=4, max_completion_length=6), model=make_model(len(tokenizer)),
                    processing_class=tokenizer, train_dataset=ROWS, reward_funcs=[broken])
    assert report.first_failure == "rewards"
    assert any("'broken' raised KeyError" in c.hint for c in report.checks)


def test_an_async_reward_function_is_checked_like_a_sync_one(tokenizer):
    async def mentions_answer_async(completions, answer, **kwargs):
        return mentions_answer(completions, answer)

    report = verify(GRPOConfig(num_generations=4, max_completion_length=10, seed=3), model=make_model(len(tokenizer)),
                    processing_class=tokenizer, train_dataset=ROWS, reward_funcs=[variety, mentions_answer_async])
    failures = [(c.stage, c.name, c.hint) for c in report.checks if c.status == "FAIL"]
    assert not failures, failures
    assert any(c.name == "mentions_answer_async values belong to their completions" and c.status == "PASS"
               for c in report.checks)


@pytest.mark.parametrize("settings", [dict(top_entropy_quantile=0.5), dict(entropy_coef=0.1),
                                      dict(use_adaptive_entropy=True, entropy_target=10.0)])
def test_settings_outside_the_formula_check_are_reported_as_unchecked(tokenizer, settings):
    args = GRPOConfig(num_generations=4, max_completion_length=10, **settings)
    report = verify(args, model=make_model(len(tokenizer), seed=5), processing_class=tokenizer, train_dataset=ROWS,
                    reward_funcs=[variety, mentions_answer])
    row = next(c for c in report.checks if c.name == "value equals the formula at ratio 1")
    assert row.status == "WARN" and row.value == "not checked"
    assert not [c for c in report.checks if c.status == "FAIL"]


def relative_length(completions, **kwargs):
    """A reward that needs the whole batch (a z-score): it cannot score one completion alone."""
    import statistics

    lengths = [len(c[0]["content"]) for c in completions]
    spread = statistics.stdev(lengths) or 1.0
    return [(n - statistics.mean(lengths)) / spread for n in lengths]


def noisy_judge(completions, **kwargs):
    """Random like a sampling judge."""
    import random

    return [random.random() + len(c[0]["content"]) for c in completions]


@pytest.mark.parametrize("settings, rewards", [
    (dict(beta=0.0, seed=1), [variety]),  # the loss is ~1e-8 at ratio 1: float noise is not a wrong formula
    (dict(beta=0.0, seed=2), [variety]),
    (dict(mask_truncated_completions=True, max_completion_length=4), [variety, mentions_answer]),
    (dict(multi_objective_aggregation="normalize_then_sum"), [variety, mentions_answer]),
    (dict(), [relative_length, noisy_judge]),
    (dict(use_peft=True, temperature=1.0), [variety, mentions_answer]),  # a LoRA adapter's first step is small
])
def test_healthy_pipelines_do_not_fail(tokenizer, settings, rewards):
    args = GRPOConfig(**{**dict(num_generations=4, max_completion_length=10, temperature=0.7, seed=3), **settings})
    report = verify(args, num_prompts=2, model=make_model(len(tokenizer), seed=5), processing_class=tokenizer,
                    train_dataset=ROWS, reward_funcs=rewards)
    failures = [(c.stage, c.name, c.value) for c in report.checks if c.status == "FAIL"]
    assert not failures, failures


@pytest.mark.parametrize("settings", [
    *[dict(loss_type=name) for name in core.LOSS_TYPES],  # every loss type of the registry
    dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.05, epsilon_high=0.1),
    dict(loss_type="cispo", epsilon_high=1.2),
    dict(epsilon=0.1, epsilon_high=0.3), dict(delta=1.5), dict(clip_ratio_c=1.5),
    dict(importance_sampling_level="sequence", epsilon=0.05, epsilon_high=0.1, loss_type="grpo"),
    dict(beta=0.1, kl_estimator="k2", use_bias_correction_kl=True),
    dict(beta=0.1, kl_estimator="k1", importance_sampling_level="sequence", use_bias_correction_kl=True),
    dict(loss_type="sapo", sapo_temperature_pos=3.0, sapo_temperature_neg=6.0, beta=0.1),
    dict(loss_type="sapo", importance_sampling_level="sequence"),
    dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.7, vespo_k_neg=4.0),
    dict(off_policy_mask_threshold=0.05), dict(loss_type="vespo", off_policy_mask_threshold=0.05, beta=0.1),
    dict(entropy_coef=0.1),
])
def test_every_loss_variant_equals_the_formula_away_from_ratio_one(tokenizer, settings):
    args = GRPOConfig(**{**dict(num_generations=4, max_completion_length=10, temperature=0.7, seed=3, beta=0.0,
                                per_device_train_batch_size=8, learning_rate=1e-6, max_steps=1), **settings})
    report = verify(args, num_prompts=2, model=make_model(len(tokenizer), seed=5), processing_class=tokenizer,
                    train_dataset=ROWS, reward_funcs=[variety])
    [check] = [c for c in report.checks if c.name == "value equals the formula away from ratio 1"]
    assert check.status == "PASS", check
    assert not check.value.endswith(" 0% of ratios outside the clip range"), check  # clipping was exercised


def test_a_row_cut_at_the_length_limit_keeps_a_sampled_pad_token():
    from covey.verify.formulas import eos_mask

    ids = torch.tensor([[5, 6, 0, 0], [5, 3, 0, 0], [5, 7, 8, 0]])  # pad 0, EOS 3
    mask = eos_mask(ids, [3], 0, ["length", "eos", "stop"], max_length=4)
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]


def test_a_template_that_closes_the_users_turn_itself_passes(tokenizer):
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
                               "{% else %}{{ m.content }}{% endif %}{% endfor %}")  # add_generation_prompt ignored
    report = run_verify(tokenizer)
    assert not [c for c in report.checks if c.stage == "data" and c.status == "FAIL"]


@pytest.mark.parametrize("template, check", [
    ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}", "opens the assistant's turn"),
    ("{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}", "opens the assistant's turn"),
    ("{% for m in messages %}{% if m.role != 'assistant' %}<{{ m.role }}>{{ m.content }}\n{% endif %}{% endfor %}"
     "{% if add_generation_prompt %}<assistant>{% endif %}", "keeps assistant messages"),
])
def test_a_broken_chat_template_fails_the_data_stage(tokenizer, template, check):
    tokenizer.chat_template = template
    report = run_verify(tokenizer)
    assert report.first_failure == "data"
    assert any(c.status == "FAIL" and check in c.name for c in report.checks)


def test_a_model_that_does_not_load_fails_the_setup_stage(tmp_path, tokenizer):
    report = verify(GRPOConfig(model=str(tmp_path / "no-such-model"), num_generations=4, max_completion_length=6),
                    processing_class=tokenizer, train_dataset=ROWS, reward_funcs=[variety])
    assert report.first_failure == "setup"
    assert any("there is no folder" in c.hint for c in report.checks)


def test_a_sampler_that_fails_fails_the_engine_stage_not_the_rewards(tokenizer, monkeypatch):
    from covey.errors import ModelError
    from covey.rollout.fast.engine import FastEngine

    def broken(self, *args, **kwargs):
        raise ModelError("the sampler could not run")

    monkeypatch.setattr(FastEngine, "generate", broken)
    report = run_verify(tokenizer)
    assert report.first_failure == "engine"
    assert [c.stage for c in report.checks if c.status == "FAIL"] == ["engine"]
    assert any("the sampler could not run" in c.hint for c in report.checks)


# ---- episodes with tools: token-in, token-out ------------------------------------------------------------


class EveryTurnCalls(HermesFormat):
    """Reads a call to ``echo`` of the whole turn in every model turn, so a random model makes episodes."""

    def parse(self, text):
        return ParsedTurn([ToolCall("echo", {"text": text})])

    def render(self, call):
        return str(next(iter(call.arguments.values()), ""))


def echo(text: str) -> str:
    """Say the start of it back.

    Args:
        text: what to say
    """
    return f"echo {text[:3]}"


def run_agent_verify(tokenizer):
    args = GRPOConfig(num_generations=4, max_completion_length=40, temperature=0.7, seed=3, stop_strings=list("aeio"),
                      max_tool_calling_iterations=2, reward_weights=[1.0, 2.0], max_prompt_length=1024)
    return verify(args, num_prompts=2, model=make_model(len(tokenizer), seed=5), processing_class=tokenizer,
                  train_dataset=ROWS, reward_funcs=[variety, mentions_answer], tools=[echo],
                  tool_call_format=EveryTurnCalls())


def _re_encoded(original, tokenizer):
    """The engine's episodes with each turn of the model's ids replaced by its text encoded anew."""
    def generate_episodes(self, *args, **kwargs):
        rollout = original(self, *args, **kwargs)
        ids, sampled, logps = [], [], []
        for row in range(len(rollout.finish_reasons)):
            n = int(rollout.completion_mask_BT[row].sum())
            segments, start = [], 0
            flags = rollout.sampled_mask_BT[row, :n].tolist()
            for t in range(1, n + 1):
                if t == n or flags[t] != flags[start]:
                    segments.append((flags[start], rollout.completion_ids_BT[row, start:t].tolist()))
                    start = t
            row_ids, row_sampled = [], []
            for flag, segment in segments:
                if flag:
                    segment = tokenizer.encode(tokenizer.decode(segment, skip_special_tokens=True),
                                               add_special_tokens=False)
                row_ids += segment
                row_sampled += [flag] * len(segment)
            ids.append(row_ids)
            sampled.append(row_sampled)
            logps.append([0.0] * len(row_ids))
        return padded_rollout(ids, sampled, logps, rollout.finish_reasons, tokenizer.pad_token_id)
    return generate_episodes


def test_a_clean_pipeline_of_episodes_passes(tokenizer):
    report = run_agent_verify(tokenizer)
    assert not [c for c in report.checks if c.status == "FAIL"], [c for c in report.checks if c.status == "FAIL"]
    episodes = {c.name: c for c in report.checks if c.stage == "episodes"}
    assert {"tool calls round-trip through their format", "the trained ids are the ids the model sampled, turn after turn",
            "tokens a tool or the environment wrote are attended to, never trained"} <= set(episodes)
    assert "an episode called a tool" not in episodes  # it did: there were tokens between turns to check


@pytest.mark.parametrize("defect, stage", [
    ("tool-result tokens left in the loss mask", "episodes"),
    ("the assistant turn re-encoded from its text", "episodes"),
    ("a turn's prefix dropped before the next generation", "engine"),
])
def test_a_defect_of_episodes_fails_at_its_stage(defect, stage, tokenizer, monkeypatch):
    if defect == "tool-result tokens left in the loss mask":
        monkeypatch.setattr(rounds_module, "loss_mask", lambda rollout, masked: rollout.completion_mask_BT.clone())
    elif defect == "the assistant turn re-encoded from its text":
        monkeypatch.setattr(FastEngine, "generate_episodes", _re_encoded(FastEngine.generate_episodes, tokenizer))
    else:  # the engine samples each later turn from what followed the prompt only
        monkeypatch.setattr(FastEngine, "generate_episodes", TurnByTurn.generate_episodes)
        monkeypatch.setattr(engine_module, "continuation", lambda prompt, episode: episode)
    report = run_agent_verify(tokenizer)
    assert report.first_failure == stage, [(c.stage, c.name, c.value) for c in report.checks if c.status == "FAIL"]


def _probe_check(report, name):
    return next(c for c in report.checks if c.name == f"{name} tells a right answer from wrong ones")


def test_reward_probes_warn_of_a_reward_that_cannot_tell_right_from_wrong(tokenizer):
    def exact(completions, solution, **kwargs):  # numbers, and the column holds words: never a match
        from covey.rewards.answers import parse_number

        return [float(parse_number(s) is not None and parse_number(c[0]["content"]) == parse_number(s))
                for c, s in zip(completions, solution)]

    def counts_answer(completions, answer, **kwargs):
        return [float(a in c[0]["content"]) for c, a in zip(completions, answer)]

    def inverted(completions, answer, **kwargs):
        return [-float(a in c[0]["content"]) for c, a in zip(completions, answer)]

    words = {"2": "two", "4": "four", "6": "six", "8": "eight", "10": "ten"}
    rows = [{**row, "solution": words[row["answer"]]} for row in ROWS[1:]]
    report = verify(GRPOConfig(num_generations=4, max_completion_length=10, seed=3), num_prompts=2,
                    model=make_model(len(tokenizer), seed=5), processing_class=tokenizer, train_dataset=rows,
                    reward_funcs=[exact, counts_answer, inverted])
    alike = _probe_check(report, "exact")
    assert alike.status == "WARN" and "cannot tell right from wrong; is the solution column in the form" in alike.hint
    assert alike.value == "solution as an answer 0, empty 0, prompt echoed 0"
    assert _probe_check(report, "counts_answer").status == "PASS"
    assert "above the row's answer written as an answer" in _probe_check(report, "inverted").hint
    assert not [c for c in report.checks if c.status == "FAIL"]  # warnings: the pipeline itself runs


def test_the_reference_is_written_as_the_prompt_asks():
    from covey.verify.stages import written_answer

    assert written_answer("72", "Answer in <answer></answer> tags.", False) == "<answer>72</answer>"
    assert written_answer("so 72 #### 72", "Put the result in \\boxed{}.", False) == "The answer is \\boxed{72}."
    assert written_answer("2.5", "Think in <think></think>, then answer after ####", False) == \
        "<think>Working it out.</think>\n#### 2.5"
    assert written_answer(" x^2 + 1 ", "plain", True) == "x^2 + 1"  # not a number: as it is


def test_a_constant_reward_of_completions_cut_at_the_length_limit_is_said_so(tokenizer):
    def tagged(completions, **kwargs):
        return [float("</answer>" in c[0]["content"]) for c in completions]

    report = verify(GRPOConfig(num_generations=4, max_completion_length=2, seed=3), num_prompts=2,
                    model=make_model(len(tokenizer), seed=5), processing_class=tokenizer, train_dataset=ROWS,
                    reward_funcs=[tagged, mentions_answer])
    check = next(c for c in report.checks if c.name == "tagged varies over the batch")
    assert check.status == "WARN" and "were cut at max_completion_length=2 before they could finish" in check.hint


def test_an_error_raised_inside_a_stage_is_a_failure_of_that_stage_not_a_traceback(tokenizer, monkeypatch):
    """An unexpected error in a stage's checks (here the loss formula's) ends as a FAIL of that stage naming
    the error and its place; the stages after it still run."""
    import covey.verify.step_stages as step_stages

    def broken(*args, **kwargs):
        raise KeyError("a loss type with no formula")

    monkeypatch.setattr(step_stages, "formula_loss", broken)
    args = GRPOConfig(num_generations=4, max_completion_length=10, temperature=0.7, seed=3, beta=0.0,
                      per_device_train_batch_size=8, learning_rate=1e-6, max_steps=1)
    report = verify(args, num_prompts=2, model=make_model(len(tokenizer), seed=5), processing_class=tokenizer,
                    train_dataset=ROWS, reward_funcs=[variety])
    failed = [c for c in report.checks if c.status == "FAIL"]
    # both of the loss stage's checks run the formula, and each ends in its own failure
    assert [(c.stage, c.name) for c in failed] == [("loss", "the loss checks run to the end")] * 2
    assert report.first_failure == "loss"
    assert all(c.value.startswith("KeyError: 'a loss type with no formula' (at ") and "in broken" in c.value
               for c in failed)
    assert any(c.stage == "engine" for c in report.checks)  # the stages after it ran
