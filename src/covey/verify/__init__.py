"""covey verify: run every stage of a pipeline on one small real batch and check its invariant.

A GRPO run that does not learn usually has several independent defects, each of which silently
zeroes or inverts the signal. Each stage below is checked against an independent computation
written here (not by calling the code under test twice), in the order of the loop, so the first
FAIL names the broken stage:

    setup       the config, the model and its tokenizer load together
    data        prompts, columns that rewards need, alignment of columns with completions
    decode      the text rewards receive: plain, complete and unterminated reasoning, no special tokens
    rewards     one value per completion, lined up with its completion, not constant, weights applied
    probes      (probes=True, as covey verify runs) no reward scores a completion built to cheat it as high
                as a correct answer, nor rises with length alone
    advantages  group sums ~0, order follows reward, eps small, constant groups zero
    logprobs    <= 0, equal to a plain log_softmax gather, padding out, EOS in
    loss        value equal to the formula on the first pass (ratio 1) and away from it (clipping
                active), KL >= 0 and 0 at the reference, one step raises the best completion and
                lowers the worst
    engine      the sampler samples a batch, and its log-probs agree with the trainer's forward; the fast
                engine's decode steps run in covey's kernel where the CPU can run it
    async       (async_generation) a batch sampled by an older policy carries its log-probs, and the
                step's correction equals pi_current / pi_sampling written out
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Sequence

from covey.config import GRPOConfig
from covey.errors import DataError, RewardError
from covey.rewards import reward_name
from covey.train.setup import build_engine, one_batch_settings
from covey.train.parts import Rewards
from covey.train.rounds import score_prompts
from covey.train.update import fixed_logprobs
from covey.train.trainer import GRPOTrainer
from covey.verify import stages, step_stages
from covey.verify.images import check_images
from covey.verify.probe_stage import check_probes
from covey.verify.report import STAGES, Check, Report, error_text, print_report

__all__ = ["STAGES", "Check", "Report", "print_report", "verify"]
SETUP = "the model, its tokenizer and the settings load"


def verify(args: GRPOConfig, num_prompts: int = 2, model=None, processing_class=None, train_dataset=None,
           reward_funcs=None, tools=None, environment_factory=None, tool_call_format=None,
           reward_processing_classes=None, probes: bool = False, accepted_probes: Sequence[str] = ()) -> Report:
    """Check the pipeline ``args`` describes (or the given objects, as ``GRPOTrainer`` takes them) stage
    by stage, on one batch that the step's own functions sample, score and train on. ``probes``: also
    probe the reward functions (covey.rewards.probes), ``accepted_probes`` naming the known findings
    (``FUNCTION`` or ``FUNCTION:PROBE``) that only warn."""
    report = Report()
    settings = one_batch_settings(args, num_prompts, max_steps=1, log_completions=False, num_iterations=1,
                                  dynamic_sampling=False, reward_probes=False)  # probed in a stage of their own
    try:
        trainer = GRPOTrainer(model=copy.deepcopy(model) if model is not None else None, reward_funcs=reward_funcs,
                              args=settings, train_dataset=train_dataset, processing_class=processing_class, quiet=True,
                              tools=tools, environment_factory=environment_factory, tool_call_format=tool_call_format,
                              reward_processing_classes=reward_processing_classes)
    except Exception as e:
        return _failed(report, e, ((DataError, "data", "dataset loads"),
                                   (RewardError, "rewards", "reward functions load"),
                                   (Exception, "setup", SETUP)))
    parts = trainer.parts
    parameters = sum(p.numel() for p in parts.policy.model.parameters())
    report.add("setup", SETUP, True,
               f"{trainer.run.model_name}: {parameters / 1e6:.1f}M parameters")
    eos_ids = parts.sampler.eos_ids
    report.run("data", stages.check_data, report, parts)
    report.run("decode", stages.check_decode, report, parts, eos_ids)
    indices = list(range(min(num_prompts, len(parts.prompts.rows))))
    rewards, calls = _recording_calls(parts.rewards)
    engine = _Recording(parts.sampler.engine)
    parts = dataclasses.replace(parts.sampling_with(engine), rewards=rewards)
    try:
        batch = score_prompts(parts, indices)
        fixed = fixed_logprobs(parts, batch)
    except Exception as e:
        return _failed(report, e, ((RewardError, "rewards", "reward functions run on a sampled batch"),
                                   (DataError, "data", "the prompts of a batch are sampled"),
                                   (Exception, "engine", f"the {settings.rollout_engine} engine samples a batch")))
    report.run("data", stages.check_columns, report, parts, indices, calls)
    report.run("decode", stages.check_rewarded_text, report, parts, batch, calls, engine.turns)
    report.run("episodes", stages.check_episodes, report, parts, batch, eos_ids, engine.turns)
    report.run("rewards", stages.check_rewards, report, parts, batch, calls)
    report.run("rewards", stages.check_reward_probes, report, trainer.parts, calls)  # the functions as given (their columns)
    if probes:
        report.run("probes", check_probes, report, trainer.parts, indices, calls, accepted_probes)
    report.run("advantages", step_stages.check_advantages, report, parts, batch)
    if fixed.ref_BT is not None:  # the reference moved away from the policy, so that its place in the loss shows
        fixed = dataclasses.replace(fixed, ref_BT=fixed.ref_BT - 0.1)
    logp_BT = report.run("logprobs", step_stages.check_logprobs, report, parts, batch, eos_ids, engine.turns)
    report.run("images", check_images, report, parts, batch, indices)
    if logp_BT is not None:  # else the logprobs stage failed, and the stages on the log-probs cannot run
        report.run("loss", step_stages.check_loss, report, parts, batch, fixed, logp_BT)
        report.run("loss", step_stages.check_loss_away_from_ratio_one, report, parts, batch, fixed, logp_BT)
        report.run("engine", step_stages.check_engine, report, parts, batch, logp_BT, engine.rollout)
    report.run("engine", _check_decode_kernel, report, engine.engine)
    if settings.async_generation:
        report.run("async", step_stages.check_async_correction, report, parts.sampling_with(engine.engine), indices,
                   lambda model: build_engine(settings, model, parts.sampler.tokenizer, eos_ids))
    return report


def _check_decode_kernel(report: Report, engine) -> None:
    """How the fast engine ran its decode steps; a warning where covey's decode kernel would run on this CPU
    but could not be built (sampling is then slower), saying why."""
    way = getattr(engine, "decoded_with", None)
    if way is None:  # another engine, or none of its batches sampled yet
        return
    from covey.rollout.fast import decode_kernel

    missing = not decode_kernel.available() and decode_kernel.could_run_here()
    report.add("engine", "decode steps run in covey's kernel where this CPU can run it", not missing, way,
               f"covey's decode kernel {decode_kernel.describe()}", warn_only=True)


def _failed(report: Report, error: Exception, stages: tuple) -> Report:
    """``report`` with ``error`` as the failure of the first stage whose kinds of error it is one of
    (``stages``: (kinds, stage, check) in order, the last of them for any error); an error that is not
    covey's own says its kind and where it was raised."""
    kinds, stage, check = next(entry for entry in stages if isinstance(error, entry[0]))
    report.add(stage, check, False, "error", error_text(error))
    return report


def _recording_calls(rewards: Rewards) -> tuple[Rewards, list[dict]]:
    """The rewards with each function wrapped so that its calls' arguments are recorded (in the list
    returned beside them); an async function stays async, so that score_completions awaits it as it
    would the function itself."""
    calls: list[dict] = []

    def failed(func, e: Exception) -> RewardError:  # a user function's own bug: report it as the rewards stage
        return RewardError(f"reward function {reward_name(func)!r} raised {type(e).__name__}: {e}")

    def recording(func):
        if inspect.iscoroutinefunction(func):
            async def wrapper(**kwargs):
                calls.append(kwargs)
                try:
                    return await func(**kwargs)
                except Exception as e:
                    raise failed(func, e) from e
        else:
            def wrapper(**kwargs):
                calls.append(kwargs)
                try:
                    return func(**kwargs)
                except Exception as e:
                    raise failed(func, e) from e
        wrapper.__name__ = reward_name(func)
        return wrapper

    return dataclasses.replace(rewards, funcs=[recording(f) for f in rewards.funcs]), calls


class _Recording:
    """The run's engine as verify watches it: the rollout it returned, and each episode's turns as it
    handed them to the environment (the ids the model sampled, then what was appended, None where the
    episode ended)."""

    def __init__(self, engine) -> None:
        self.engine, self.rollout, self.turns = engine, None, {}

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, *args, **kwargs):
        self.rollout = self.engine.generate(*args, **kwargs)
        return self.rollout

    def generate_episodes(self, prompt_ids, num_generations, params, seed, respond):
        def recorded(row: int, ids: list[int], room: int):
            appended = respond(row, ids, room)
            self.turns.setdefault(row, []).append((list(ids), None if appended is None else list(appended)))
            return appended

        self.rollout = self.engine.generate_episodes(prompt_ids, num_generations, params, seed, recorded)
        return self.rollout
