"""covey verify --trl, up to the scored batch: the trainer left as it was, its setup and dataset, one batch
of chosen completions through TRL's scoring path (sampling replaced by them), and the checks of what the
reward functions receive (decode) and return (rewards). See ``covey.verify.trl``."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import sys
import traceback
import types
from typing import Callable

import torch

from covey.data.text import THINK_CLOSE, answer_after_reasoning
from covey.verify.report import Report, error_place
from covey.verify.stages import whole_prompt_text, written_answer

# what TRL passes every reward function besides the dataset's columns
TRL_REWARD_ARGUMENTS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                        "environments", "kwargs"}
REFERENCE_COLUMNS = ("answer", "solution", "ground_truth", "reference", "target", "label")
REASONING_FIELDS = {"reasoning_content", "thinking"}  # where a parsed message keeps the reasoning
# where an error in TRL's scoring path shows which stage broke (a reward function's own error: rewards)
FAILING_FUNCTION_STAGES = {"parse_response": "decode", "batch_decode": "decode", "recorded": "rewards",
                           "_calculate_rewards": "rewards", "_get_per_token_logps_and_entropies": "logprobs"}
STAGES = ("setup", "data", "decode", "rewards", "advantages", "logprobs", "loss", "direction")


class BatchChecks:
    """The checks on one trainer and the one batch they share, up to its rewards."""

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
            self.report.add(stage or _failed_stage(e), name, False, f"{type(e).__name__}: {e} (in {error_place(e)})",
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



def _reference(row: dict) -> str | None:
    value = next((row[c] for c in REFERENCE_COLUMNS if c in row), None)
    return None if value is None else str(value).split("####")[-1].strip()


def _failed_stage(error: BaseException) -> str:
    """The stage of the innermost of TRL's functions that an error passed through."""
    names = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    return next((FAILING_FUNCTION_STAGES[f] for f in reversed(names) if f in FAILING_FUNCTION_STAGES), "rewards")


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
