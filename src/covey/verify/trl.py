"""covey verify for a TRL pipeline: the stage checks run on a ``trl.GRPOTrainer`` the user built.

``verify_trl(trainer)`` drives the trainer's own code paths (whatever TRL is installed, patched copies
included) on completions whose token ids it chooses, and checks each stage against a computation
written here:

    data        the columns the reward functions read are in the dataset, and reach them row by row
    decode      the text a reward function receives for a plain answer, a closed <think> block and an
                unterminated one, against the tokenizer's own decode of those ids (the answer alone where
                TRL parses the reasoning apart)
    rewards     one value per completion, each the function's value for that completion alone; able to
                tell the row's reference answer from an empty completion; the weights TRL applies
    advantages  TRL's against a recomputation from its rewards: mean zero per group, order follows
                reward, a small epsilon, constant groups zero
    logprobs    TRL's per-token log-probs against log_softmax gathered at the token, all <= 0, the loss
                mask without padding and with the EOS token
    loss        TRL's loss at ratio 1 and away from it against the formula of its loss_type; KL >= 0 and
                0 at the reference
    direction   one small step (then undone) raises each group's best completion against its worst

``run_until_train(script, argv)`` runs a user's script unchanged up to its ``trainer.train()`` and
returns that trainer instead of training. Nothing is written to the output folder or pushed.
Where the installed TRL lacks an internal a stage needs, that stage says it cannot check this version.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import runpy
import sys
import traceback
import types
from pathlib import Path
from typing import Any, Callable

import torch

from covey.verify.report import Report
from covey.data.text import THINK_CLOSE, answer_after_reasoning
from covey.verify.stages import whole_prompt_text, written_answer

# what TRL passes every reward function besides the dataset's columns
TRL_REWARD_ARGUMENTS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                        "environments", "kwargs"}
REFERENCE_COLUMNS = ("answer", "solution", "ground_truth", "reference", "target", "label")
LOSS_TYPES_CHECKED = ("grpo", "bnpo", "dr_grpo", "dapo")
REASONING_FIELDS = {"reasoning_content", "thinking"}  # where a parsed message keeps the reasoning
# where an error in TRL's scoring path shows which stage broke (a reward function's own error: rewards)
FAILING_FUNCTION_STAGES = {"parse_response": "decode", "batch_decode": "decode", "recorded": "rewards",
                           "_calculate_rewards": "rewards", "_get_per_token_logps_and_entropies": "logprobs"}
STAGES = ("setup", "data", "decode", "rewards", "advantages", "logprobs", "loss", "direction")


class _Stop(BaseException):
    """Raised in place of ``GRPOTrainer.train`` to hand the trainer back."""

    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer


def run_until_train(script: str | Path, argv: list[str]) -> Any:
    """Run ``script`` with ``argv`` as its arguments, as ``python script argv...`` would, until it calls
    ``train()`` on a ``trl.GRPOTrainer``; that trainer (the script stops there). An error names the script."""
    import trl

    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"covey verify --trl: {script} is not a file; give the path of your TRL training "
                                "script, then its own arguments")
    original = trl.GRPOTrainer.train

    def stop(self, *args, **kwargs):
        raise _Stop(self)

    saved_argv, saved_path = sys.argv, list(sys.path)
    trl.GRPOTrainer.train = stop
    sys.argv, sys.path[0:0] = [str(script), *argv], [str(script.parent.resolve())]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except _Stop as stopped:
        return stopped.trainer
    finally:
        trl.GRPOTrainer.train = original
        sys.argv, sys.path[:] = saved_argv, saved_path
    raise RuntimeError(f"{script} ended without calling train() on a trl.GRPOTrainer: covey verify --trl checks the "
                       "trainer a script is about to train")


def verify_trl(trainer: Any, num_prompts: int = 2) -> Report:
    """The stage checks on a ``trl.GRPOTrainer`` (not trained, not saved); the report."""
    report = Report(STAGES)
    check = _Checks(trainer, report, num_prompts)
    with check.trainer_left_as_it_was():
        check.setup()
        if check.ready:
            check.data()
            batch = check.score()
            if batch is not None:
                check.guarded("decode", check.decode)
                check.guarded("rewards", check.rewards)
                check.guarded("advantages", check.advantages)
                logp = check.guarded("logprobs", check.logprobs)
                if logp is not None:
                    check.guarded("loss", check.loss, logp)
                    check.guarded("direction", check.direction)
    return report


class _Checks:
    """The checks on one trainer and the one batch they share."""

    def __init__(self, trainer, report: Report, num_prompts: int):
        self.trainer, self.report = trainer, report
        self.G = int(trainer.num_generations)
        self.rows = [trainer.train_dataset[i] for i in range(min(num_prompts, len(trainer.train_dataset)))]
        self.tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class
        self.ready = False
        self.calls: list[dict] = []  # each reward function's calls: completions, kwargs, values
        self.out: dict | None = None
        self.rewards_per_func: torch.Tensor | None = None
        self.score_alone: Callable[[int], torch.Tensor] | None = None  # TRL's rewards of one completion alone

    def guarded(self, stage: str | None, check: Callable, *args):
        """``check(*args)``; an error in TRL's code (or the script's) on the way is a FAIL of ``stage``
        (None: of the stage of TRL's function it passed through)."""
        try:
            return check(*args)
        except Exception as e:
            name = f"TRL's code runs through the {stage} check" if stage else "TRL scores a batch of chosen completions"
            self.report.add(stage or _failed_stage(e), name, False, f"{type(e).__name__}: {e} (in {_where(e)})",
                            "this part of TRL (or of the script) fails on a batch, so training would fail there too")
            return None

    # ---- setup --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def trainer_left_as_it_was(self):
        """The trainer's metrics, logs, token count, training mode and reward functions as they were."""
        t = self.trainer
        saved = {name: copy.deepcopy(getattr(t, name)) for name in ("_metrics", "_logs") if hasattr(t, name)}
        seen, training, funcs = t.state.num_input_tokens_seen, t.model.training, list(t.reward_funcs)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(t, name, value)
            t.state.num_input_tokens_seen = seen
            t.model.train(training)
            t.reward_funcs = funcs
            for name in ("_generate_single_turn", "_calculate_rewards"):
                t.__dict__.pop(name, None)

    def setup(self) -> None:
        t = self.trainer
        missing = [name for name in ("_generate_and_score_completions", "_calculate_rewards",
                                     "_get_per_token_logps_and_entropies", "_compute_loss", "_generate_single_turn")
                   if not hasattr(t, name)]
        import trl

        self.ready = self.report.add(
            "setup", f"TRL {trl.__version__} has the internals the checks drive", not missing,
            "all there" if not missing else f"missing: {', '.join(missing)}",
            "covey verify --trl checks TRL 1.x (tested: 1.16); this version cannot be checked", warn_only=True)
        if self.ready and not self.rows:
            self.ready = self.report.add("data", "the training dataset has rows", False, "empty",
                                         "give train_dataset rows")

    # ---- data ---------------------------------------------------------------------------------

    def data(self) -> None:
        columns = set(self.trainer.train_dataset.column_names)
        self.report.add("data", "the dataset has a prompt column", "prompt" in columns, f"columns: {sorted(columns)}",
                        "TRL reads the prompt from a column named prompt")
        for func in self._plain_functions():
            wanted = [name for name, p in inspect.signature(func).parameters.items()
                      if name not in TRL_REWARD_ARGUMENTS and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                      and p.default is p.empty]
            absent = [name for name in wanted if name not in columns]
            self.report.add("data", f"the columns {_name(func)} reads are in the dataset", not absent,
                            f"reads {wanted or 'none'}" + (f"; missing {absent}" if absent else ""),
                            f"add the columns {absent} to the dataset, or rename the function's parameters")

    # ---- one batch through TRL's path ----------------------------------------------------------

    def chosen_completions(self, row: dict) -> list[tuple[str, str, list[int]]]:
        """(kind, text, token ids) of the completions of one group: cycles of a plain answer, a closed
        think block, an unterminated one and an empty completion. The answer is the row's reference, written
        as its prompt asks (in <answer> tags, \\boxed{} or after ####)."""
        reference = _reference(row)
        answer = written_answer(reference if reference is not None else "4", whole_prompt_text(row.get("prompt")),
                                strip_reasoning=True)
        eos = self.tokenizer.eos_token_id
        kinds = [("plain", f"The answer is {answer}", True), ("closed think", f"<think>let me see</think>{answer}", True),
                 ("unterminated think", "<think>let me see, it is", False), ("empty", "", True)]
        chosen = []
        for j in range(self.G):
            kind, text, ends = kinds[j % len(kinds)]
            ids = self.tokenizer.encode(text, add_special_tokens=False) + ([eos] if ends else [])
            chosen.append((kind, text, ids))
        return chosen

    def score(self) -> dict | None:
        """TRL's _generate_and_score_completions on the chosen completions (sampling replaced by them)."""
        t = self.trainer
        self.groups = [self.chosen_completions(row) for row in self.rows]
        ids = [c[2] for group in self.groups for c in group]
        t._generate_single_turn = types.MethodType(lambda self, *a, **k: ([list(x) for x in ids], None), t)
        t.reward_funcs = [self._recording(i, f) for i, f in enumerate(t.reward_funcs)]
        original, checks = type(t)._calculate_rewards, self

        def calculate(trainer, *args, **kwargs):  # TRL's own, its result kept, and how to score one row alone
            rewards_per_func = original(trainer, *args, **kwargs)
            checks.rewards_per_func = rewards_per_func.detach().cpu().clone()
            n = len(rewards_per_func)

            def alone(j: int) -> torch.Tensor:
                row = [[a[j]] if isinstance(a, list) and len(a) == n else a for a in args]
                return original(trainer, *row, **kwargs).detach().cpu()[0]
            checks.score_alone = alone
            return rewards_per_func

        t._calculate_rewards = types.MethodType(calculate, t)
        t.model.train()
        inputs = [row for row in self.rows for _ in range(self.G)]
        self.inputs = inputs
        self.out = self.guarded(None, t._generate_and_score_completions, inputs)
        return self.out

    def _recording(self, index: int, func):
        if isinstance(func, torch.nn.Module) or not callable(func):
            return func
        calls = self.calls

        def recorded(*args, **kwargs):
            values = func(*args, **kwargs)
            calls.append({"index": index, "func": func, "kwargs": kwargs, "values": list(values)})
            return values

        recorded.__name__ = getattr(func, "__name__", f"reward_{index}")
        return recorded

    def _plain_functions(self) -> list[Callable]:
        return [f for f in self.trainer.reward_funcs if callable(f) and not isinstance(f, torch.nn.Module)]

    # ---- decode -------------------------------------------------------------------------------

    def decode(self) -> None:
        if not self.calls:
            self.report.add("decode", "the reward functions receive the completions", False, "no function was called",
                            "only reward models in this run: the decoded text is not checked", warn_only=True)
            return
        completions = self.calls[0]["kwargs"]["completions"]
        received = [_text(c) for c in completions]
        aware = self._reasoning_aware(completions)
        how = "parsed with the tokenizer's response template" if aware else "decoded"
        chosen = [c for group in self.groups for c in group]
        for kind in ("plain", "closed think", "unterminated think"):
            at = [j for j, c in enumerate(chosen) if c[0] == kind]
            if not at:
                continue
            j = at[0]
            decoded = self.tokenizer.decode(chosen[j][2], skip_special_tokens=True)
            expected = _expected_texts(kind, decoded, aware)
            self.report.add("decode", f"a {kind} answer reaches the rewards {how}", received[j] in expected,
                            f"received {received[j]!r}, expected {' or '.join(map(repr, expected))}",
                            f"TRL's decoding path hands the reward functions {received[j]!r} for the ids of "
                            f"{decoded!r}: check the decode step of your TRL install (trainer._generate"
                            + (", trl.chat_template_utils.parse_response)" if aware else ")"))

    def _reasoning_aware(self, completions: list) -> bool:
        """Whether TRL hands the rewards the answer apart from the reasoning: a conversational run whose
        messages carry the reasoning in a field of their own, or whose tokenizer splits it out (its response
        template, parsed by transformers) where the installed TRL parses completions with that template."""
        if not (completions and isinstance(completions[0], list)):
            return False
        if any(c and isinstance(c[-1], dict) and REASONING_FIELDS & set(c[-1]) for c in completions):
            return True
        import trl

        trl_source = inspect.getsource(sys.modules[trl.GRPOTrainer.__module__])
        attribute = next((a for a in ("response_template", "response_schema")
                          if getattr(self.tokenizer, a, None) is not None and a in trl_source), None)
        if attribute is None:
            return False
        ids = self.tokenizer.encode("<think>a</think>b", add_special_tokens=False)
        try:
            try:  # transformers >= 5.13 asks for the prompt before the completion; these ids need none
                parsed = self.tokenizer.parse_response(ids, prefix=[])
            except TypeError:
                parsed = self.tokenizer.parse_response(ids)
        except Exception:  # a template that cannot parse: TRL falls back to a plain decode
            return False
        return isinstance(parsed, dict) and bool(REASONING_FIELDS & set(parsed))

    # ---- rewards ------------------------------------------------------------------------------

    def rewards(self) -> None:
        t, rpf = self.trainer, self.rewards_per_func
        N = len(self.inputs)
        funcs = list(t.reward_funcs)
        self.report.add("rewards", "one value per completion and reward function", rpf is not None and
                        tuple(rpf.shape) == (N, len(funcs)), f"shape {None if rpf is None else tuple(rpf.shape)}",
                        f"expected ({N}, {len(funcs)})")
        calls = list(self.calls)  # scoring alone below calls the functions again
        models = [i for i, f in enumerate(funcs) if isinstance(f, torch.nn.Module)]
        if models and self.score_alone is not None:  # a reward model: each row scored alone through TRL
            alone_rows = torch.stack([self.score_alone(j) for j in range(N)])
            names = getattr(t, "reward_func_names", None) or [_name(f) for f in funcs]
            for i in models:
                lined_up = torch.allclose(alone_rows[:, i], rpf[:, i], rtol=1e-3, atol=1e-4)
                self.report.add("rewards", f"{names[i]}: each value is its own completion's", lined_up,
                                f"batch {_short(rpf[:, i].tolist())}, one by one {_short(alone_rows[:, i].tolist())}",
                                f"the reward model {names[i]} scores a completion differently in a batch than alone: "
                                "check the padding side of its tokenizer and that each row's logits[:, 0] is its own")
                spread = float(rpf[:, i].max() - rpf[:, i].min())
                self.report.add("rewards", f"{names[i]} is not constant", spread > 1e-6, f"spread {spread:.3g} over "
                                f"{N} different completions", f"the reward model {names[i]} gives every completion "
                                "the same score: is its head trained, and does it read the completion?")
            self.calls = calls
        for call in calls:
            func = funcs[call["index"]]
            name, values, kwargs = _name(func), call["values"], call["kwargs"]
            # each value against the function's value for its completion alone
            alone = [_first(call["func"](**{k: ([v[j]] if isinstance(v, list) and len(v) == len(values) else v)
                                            for k, v in kwargs.items()})) for j in range(len(values))]
            lined_up = all(_same(a, b) for a, b in zip(values, alone))
            self.report.add("rewards", f"{name}: each value is its own completion's", lined_up,
                            f"batch {_short(values)}, one by one {_short(alone)}",
                            f"{name} returns its values out of order (shifted, or computed for other rows): "
                            "return one value per completion, in the order of completions")
            distinct = {round(float(v), 6) for v in values if v is not None and not math.isnan(float(v))}
            self.report.add("rewards", f"{name} is not constant", len(distinct) > 1,
                            f"{len(distinct)} distinct value(s) over {len(values)} different completions",
                            f"{name} gives every completion the same reward, so its advantages are all zero: check "
                            "that it reads the completion (and the column it compares with)")
            declared = inspect.signature(call["func"]).parameters
            column = next((c for c in REFERENCE_COLUMNS if c in declared), None)
            if column is not None:
                chosen = [c for group in self.groups for c in group]
                with_answer = [v for v, c in zip(values, chosen) if c[0] == "plain"]
                empty = [v for v, c in zip(values, chosen) if c[0] == "empty"]
                if with_answer and empty:
                    better = float(with_answer[0]) > float(empty[0])
                    self.report.add("rewards", f"{name} tells the row's {column} from an empty completion", better,
                                    f"{with_answer[0]} for the answer written out, {empty[0]} for an empty one",
                                    f"{name} does not reward the reference answer over nothing: is it reading "
                                    f"{column}, and the completion's text?")
        weights = getattr(t, "reward_weights", None)
        expected = t.args.reward_weights or [1.0] * len(funcs)
        self.report.add("rewards", "the reward weights TRL applies are the config's", weights is not None and
                        torch.allclose(weights.float().cpu(), torch.tensor(expected, dtype=torch.float32)),
                        f"applied {None if weights is None else weights.tolist()}, configured {expected}",
                        "trainer.reward_weights differs from args.reward_weights")

    # ---- advantages ---------------------------------------------------------------------------

    def advantages(self) -> None:
        t, rpf, G = self.trainer, self.rewards_per_func, self.G
        got = self.out["advantages"].detach().float().cpu()
        weights = t.reward_weights.float().cpu()
        totals = (rpf * weights).nansum(1)
        groups = totals.view(-1, G)
        centred = groups - groups.nanmean(1, keepdim=True)
        got_G = got.view(-1, G)
        sums = got_G.sum(1).abs().max()
        self.report.add("advantages", "each group's advantages sum to ~0", bool(sums < 1e-3), f"max |sum| {sums:.2e}",
                        "the group mean is not taken off the rewards")
        moving = centred.abs() > 1e-6
        agree = bool(((got_G * centred)[moving] > 0).all()) if moving.any() else True
        self.report.add("advantages", "the order of advantages follows the rewards", agree,
                        f"rewards {_short(groups[0].tolist())} -> advantages {_short(got_G[0].tolist())}",
                        "advantages have the opposite sign of (reward - group mean): the update would unlearn")
        constant = ~moving.any(1)
        zero = bool((got_G[constant].abs() < 1e-6).all()) if constant.any() else True
        self.report.add("advantages", "a group whose rewards are all alike has zero advantages", zero,
                        f"{int(constant.sum())} such group(s)", "constant groups must carry no signal")
        scale = str(getattr(t, "scale_rewards", getattr(t.args, "scale_rewards", "group")))
        if scale in ("group", "True", "true") and moving.any():
            std = groups.std(1, keepdim=True)  # as TRL: Bessel's correction
            rows = moving.any(1)
            eps = (centred / got_G.where(got_G.abs() > 1e-12, torch.full_like(got_G, float("nan"))) - std)[moving]
            eps_value = float(eps.nanmedian()) if rows.any() else 0.0
            self.report.add("advantages", "the epsilon under the group std is small", abs(eps_value) < 1e-2,
                            f"epsilon ~ {eps_value:.2g}", "advantages are divided by (std + epsilon) with a large "
                            "epsilon, which shrinks them towards zero: TRL's is 1e-4")

    # ---- log-probs ----------------------------------------------------------------------------

    def logprobs(self) -> torch.Tensor | None:
        t, out = self.trainer, self.out
        prompt, completion = out["prompt_ids"], out["completion_ids"]
        mask = out["completion_mask"].float()
        ids = torch.cat([prompt, completion], 1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        K = completion.shape[1]
        # the loss mask, written out from the chosen ids: each completion's tokens, its EOS included
        lengths = torch.tensor([len(c[2]) for group in self.groups for c in group])
        expected_mask = (torch.arange(K).unsqueeze(0) < lengths.unsqueeze(1)).float()
        self.report.add("logprobs", "the loss mask holds the completion up to its EOS, and no padding",
                        torch.equal(mask.cpu(), expected_mask), f"{int(mask.sum())} tokens masked in, "
                        f"{int(expected_mask.sum())} written out", "the completion mask lets padding (or the prompt) "
                        "into the loss, or leaves the EOS token out")
        with torch.no_grad():
            got = t._get_per_token_logps_and_entropies(t.model, ids, attention, K)
            got = (got[0] if isinstance(got, tuple) else got).float()
            logits = t.model(input_ids=ids, attention_mask=attention).logits[:, -K - 1:-1].float() / t.temperature
            expected = torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        on = expected_mask.bool().to(got.device)
        diff = float((got - expected)[on].abs().max()) if on.any() else 0.0
        half = bool(getattr(t.args, "bf16", False) or getattr(t.args, "fp16", False))  # TRL's pass in 16 bits
        tolerance = 0.1 if half else 1e-3
        self.report.add("logprobs", "TRL's log-probs equal log_softmax gathered at the token", diff < tolerance,
                        f"max |difference| {diff:.2e} (tolerance {tolerance:g})",
                        "the per-token log-probs are not log p(token): check the "
                        "log-softmax (its operands), the temperature and the shift by one")
        positive = float(got[on].max()) if on.any() else 0.0
        self.report.add("logprobs", "every log-prob is <= 0", positive <= 1e-6, f"max {positive:.3g}",
                        "a log-probability above 0 is no probability: log_softmax's operands are reversed?")
        return got

    # ---- loss ---------------------------------------------------------------------------------

    def loss(self, logp: torch.Tensor) -> None:
        t, out = self.trainer, self.out
        loss_type = getattr(t, "loss_type", t.args.loss_type)
        if loss_type not in LOSS_TYPES_CHECKED:
            self.report.add("loss", f"loss_type {loss_type} against its formula", False, "not checked",
                            f"covey checks TRL's {', '.join(LOSS_TYPES_CHECKED)}", warn_only=True)
            return
        t.current_gradient_accumulation_steps = 1
        mask = out["completion_mask"].float()
        generator = torch.Generator().manual_seed(0)
        old = logp + 0.3 * torch.randn(logp.shape, generator=generator)
        beta = float(getattr(t, "beta", 0.0))
        ref = logp + 0.2 * torch.randn(logp.shape, generator=generator)
        for label, old_logp in (("at ratio 1", None), ("away from ratio 1 (clipping)", old)):
            inputs = dict(out)
            if old_logp is None:
                inputs.pop("old_per_token_logps", None)
            else:
                inputs["old_per_token_logps"] = old_logp
            if beta:
                inputs["ref_per_token_logps"] = ref
            with torch.no_grad():
                got = float(t._compute_loss(t.model, inputs))
            expected = float(_formula(t, loss_type, logp, logp if old_logp is None else old_logp,
                                      ref if beta else None, out["advantages"].float(), mask, out, beta))
            self.report.add("loss", f"TRL's {loss_type} loss {label} equals its formula",
                            math.isclose(got, expected, rel_tol=1e-3, abs_tol=2e-4), f"{got:.6g} against {expected:.6g}",
                            "the loss differs from the formula of loss_type (clipping, aggregation, the KL term's "
                            "sign or the mask)")
        if beta:
            kl = _k3(ref, logp)
            self.report.add("loss", "KL >= 0, and 0 at the reference", bool((kl >= -1e-6).all()) and
                            float(_k3(logp, logp).abs().max()) < 1e-6, f"min {float(kl.min()):.3g}",
                            "the k3 estimator exp(ref - logp) - (ref - logp) - 1 is never negative")

    # ---- direction ----------------------------------------------------------------------------

    def direction(self) -> None:
        t, out = self.trainer, self.out
        model = t.model  # stepped and put back (TRL patches its forward in place, so a copy would not run alone)
        model.train()
        adv = out["advantages"].float().view(-1, self.G)
        spread = (adv.max(1).values - adv.min(1).values) > 1e-6
        if not spread.any():
            self.report.add("direction", "one step raises the best completion", False, "all advantages equal",
                            "no completion stands out, so the direction is not checked", warn_only=True)
            return
        offset = torch.arange(adv.shape[0]) * self.G  # each group's best and worst, as rows of the batch
        best, worst = (adv.argmax(1) + offset)[spread], (adv.argmin(1) + offset)[spread]
        before = self._sequence_logp(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        saved = [(p.detach().clone(), p.grad) for p in trainable]
        t.current_gradient_accumulation_steps = 1
        try:
            for p in trainable:
                p.grad = None
            t._compute_loss(model, dict(out)).backward()
            with torch.no_grad():
                for p in trainable:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-0.05)  # one plain gradient step
            moved = self._sequence_logp(model) - before
        finally:
            with torch.no_grad():
                for p, (value, grad) in zip(trainable, saved):
                    p.copy_(value)
                    p.grad = grad
        # Each completion moves by its own advantage and by what it shares with the others (the EOS token,
        # a common opening), so the worst may rise a little too; against the best of its group it must fall.
        gap = moved[best] - moved[worst]
        self.report.add("direction", "one small step raises the best completion of each group against its worst",
                        bool((gap > 0).all()), f"best {_short(moved[best].tolist())}, worst "
                        f"{_short(moved[worst].tolist())} (change of the sequence log-prob)",
                        "the update moves the wrong way: a sign in the advantages or the loss")

    def _sequence_logp(self, model) -> torch.Tensor:
        out = self.out
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        K = out["completion_ids"].shape[1]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention).logits[:, -K - 1:-1].float() / self.trainer.temperature
            logp = torch.log_softmax(logits, -1).gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)
        return (logp * out["completion_mask"].float()).sum(1)


def _formula(t, loss_type: str, logp, old, ref, adv, mask, out, beta: float) -> torch.Tensor:
    """The clipped surrogate of TRL's loss types, written out (token-level importance sampling)."""
    eps_low = float(getattr(t, "epsilon_low", t.args.epsilon))
    eps_high = float(getattr(t, "epsilon_high", t.args.epsilon_high or t.args.epsilon))
    ratio = torch.exp(logp - old)
    A = adv.unsqueeze(1)
    per_token = -torch.min(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)
    if ref is not None:
        per_token = per_token + beta * _k3(ref, logp)
    if loss_type == "grpo":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (mask.shape[0] * t.max_completion_length)
    # dapo: over the generation batch's completion tokens, one accumulation window of them
    window = out["num_items_in_batch"].clamp(min=1) / t.accelerator.num_processes / t.args.steps_per_generation
    return (per_token * mask).sum() / window


def _expected_texts(kind: str, decoded: str, aware: bool) -> tuple[str, ...]:
    """The texts a reward function may receive for a completion decoded as ``decoded``. A reasoning-aware
    decoder hands over the answer after ``</think>`` alone, and no answer for an unterminated block (or, where
    its pattern does not match, the text as it is); a plain decoder hands over the text, or (a decoder of the
    user's own) the answer after a closed block."""
    if kind == "plain":
        return (decoded,)
    answer = answer_after_reasoning(decoded)  # "" for an unterminated block
    if kind == "unterminated think":
        return (answer, decoded) if aware else (decoded,)
    unstripped = decoded.rsplit(THINK_CLOSE, 1)[-1]
    return tuple(dict.fromkeys((answer, unstripped) if aware else (decoded, answer, unstripped)))


def _k3(ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    return torch.exp(ref - logp) - (ref - logp) - 1


def _reference(row: dict) -> str | None:
    value = next((row[c] for c in REFERENCE_COLUMNS if c in row), None)
    return None if value is None else str(value).split("####")[-1].strip()


def _failed_stage(error: BaseException) -> str:
    """The stage of the innermost of TRL's functions that an error passed through."""
    names = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    return next((FAILING_FUNCTION_STAGES[f] for f in reversed(names) if f in FAILING_FUNCTION_STAGES), "rewards")


def _where(error: BaseException) -> str:
    """The innermost frame of an error, as file:line in function (the file from its package folder on)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "an unknown place"
    path = Path(frames[-1].filename)
    parts = path.parts[path.parts.index("site-packages") + 1:] if "site-packages" in path.parts else path.parts[-2:]
    return f"{'/'.join(parts)}:{frames[-1].lineno} in {frames[-1].name}"


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


def _name(func) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def _first(values):
    return list(values)[0] if values is not None else None


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _short(values: list) -> str:
    shown = ", ".join("None" if v is None else f"{float(v):.3g}" for v in list(values)[:8])
    return f"[{shown}{', ...' if len(values) > 8 else ''}]"
