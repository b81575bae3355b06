"""Reward probes: each reward function scored on completions built to collect reward without doing the
task (``covey.rewards.probe_set``), beside a yardstick, before any training.

Where the rows have a reference answer (``answer``, ``solution``, ...), the yardstick is that answer
written correctly, in the format the function scores highest (the prompt's own format first). Where they
have none, it is the caller's ``samples`` (the model's own completions). A finding is a probe that
scores as high as the yardstick, or a score that rises with length alone:

    from covey import probe_rewards
    report = probe_rewards([my_reward], rows, max_completion_length=256)
    for finding in report.findings:
        print(finding.text())

Each function is called as the trainer calls it (TRL's convention, every dataset column of the row,
``trainer_state``, async functions awaited, ``timeout`` as reward_timeout), twice: once on the yardstick
in every format, once on the probes. What counts as a finding:

- a probe scoring above the yardstick (any reward);
- for a reward that checks answers (it takes a reference column, or scores a wrong answer below the right
  one), a probe without the right final answer scoring as high as the yardstick and above the function's
  lowest score;
- a reward that gives nothing positive and does not check answers (a penalty: brevity, overlong) is
  judged on length alone: its purpose is to prefer some completions to others, never to pay;
- where the rows have a reference, the functions together (their weighted sum, as the run pays it): a probe
  without the right final answer whose total is as high as the yardstick's and above the lowest total. A
  format reward is no finding beside a reward that checks the answer, but is one alone; a reward per tool
  call is judged this way only (``tools``: an episode that calls one and never answers), so that a small
  tool bonus beside the answer's reward passes.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from covey.data.text import answer_after_reasoning
from covey.errors import CoveyError
from covey.rewards import probe_set
from covey.rewards.answers import completion_text
from covey.rewards.convention import (RewardFunc, TrainerState, reward_context, reward_name, required_columns,
                                      without_logging)
from covey.rewards.probe_set import FILLER, LENGTH_PROBE, PROBES, AnswerFormat, ProbeRow
from covey.rewards.scoring import call_reward, checked_values, reward_value

TOLERANCE = 1e-6  # scores this close (relative to the yardstick's size) are equal
EXAMPLE_CHARS = 240  # of a probe's completion shown with a finding


@dataclass(frozen=True)
class ProbeFinding:
    """A probe a reward function scores as high as the yardstick (or above it), with the evidence."""

    reward: str  # the function's name
    probe: str  # the probe's name (probe_set.PROBES, or "length")
    what: str  # the hack it stands for
    score: float  # the function's mean score on the probe
    yardstick: float  # its mean score on the yardstick (for "length": on the answer without filler)
    example: str  # one probe completion (cut to EXAMPLE_CHARS)
    advice: str  # what to change in the function

    def text(self) -> str:
        return (f"reward {self.reward!r} is fooled by {self.what} ({self.probe}): it scores {self.score:.3g}, against "
                f"{self.yardstick:.3g} for the yardstick; e.g. {self.example!r}. To fix: {self.advice}")


@dataclass
class ProbeReport:
    """What the probes found: the findings, every function's mean score per probe, and what was not probed."""

    yardstick: str  # what the probes were compared with
    rows: int  # rows probed
    findings: list[ProbeFinding] = field(default_factory=list)
    scores: dict[str, dict[str, float | None]] = field(default_factory=dict)  # function -> probe -> mean score
    notes: list[str] = field(default_factory=list)  # functions not probed, or not fully, and why

    @property
    def ok(self) -> bool:
        return not self.findings

    def text(self) -> str:
        lines = [f"reward probes on {self.rows} row(s), against {self.yardstick}: "
                 f"{len(self.findings) or 'no'} finding(s)"]
        lines += [f"- {finding.text()}" for finding in self.findings]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"yardstick": self.yardstick, "rows": self.rows, "findings": [asdict(f) for f in self.findings],
                "scores": self.scores, "notes": self.notes}


def probe_rewards(reward_funcs: Sequence[RewardFunc | str] | RewardFunc | str, rows: Iterable[dict], *,
                  samples: Sequence[Sequence[Any]] | None = None, tokenizer: Any = None,
                  max_completion_length: int = 256, num_rows: int = 8, timeout: float | None = None,
                  strip_reasoning: bool = False, probes: Sequence[str] | None = None,
                  weights: Sequence[float] | None = None, tools: Sequence[str] = ()) -> ProbeReport:
    """Probe each reward function on ``num_rows`` of ``rows`` (dicts with a ``prompt`` and the dataset's
    columns, as the trainer loads them; a ``datasets.Dataset`` works), and report what fools it.

    ``samples``: for data without a reference answer, the model's own completions, one list per row probed
    (the rows ``probe_rows(rows, num_rows)`` picks, spread over the data); they are the yardstick.
    ``tokenizer``: the model's, for ``completion_ids`` and the lengths (without one, one id per word).
    ``timeout``: seconds a call may take (reward_timeout). ``strip_reasoning``: the functions see what follows
    the reasoning block, as under that setting. ``probes``: the names to run (default: all, and ``length``).
    ``weights``: the functions' reward_weights (default: 1 each), for the functions judged together.
    ``tools``: the names of the run's tools, for the tool probe (chat rows only).
    """
    funcs = _loaded([reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs))
    chosen = probe_rows(rows if hasattr(rows, "__len__") and hasattr(rows, "__getitem__") else list(rows), num_rows)
    if not chosen:
        raise CoveyError("probe_rewards: no rows given; pass the dataset's rows (dicts with a 'prompt')")
    if samples is not None and len(samples) != len(chosen):
        raise CoveyError(f"probe_rewards: {len(samples)} lists of samples for {len(chosen)} rows probed; give one "
                         "list of completions per row (the rows probe_rows picks)")
    column = _reference_column(chosen[0])
    batch = _Batch(chosen, tokenizer, max_completion_length, strip_reasoning)
    yardstick = ("a correct answer from the rows' " + repr(column) if column else
                 "the model's own samples" if samples is not None else "nothing (no reference answer, no samples)")
    report = ProbeReport(yardstick, len(chosen))
    if weights is not None and len(weights) != len(funcs):
        raise CoveyError(f"probe_rewards: {len(weights)} weights for {len(funcs)} reward functions; give one weight "
                         "per function (reward_weights), or none")
    known = {p.name for p in PROBES} | {LENGTH_PROBE, probe_set.TOOL_PROBE.name}
    wanted = set(probes) if probes is not None else known
    if wanted - known:
        raise CoveyError(f"probe_rewards: no probe named {', '.join(sorted(wanted - known))}; the probes are "
                         f"{', '.join(sorted(known))}")
    for func in funcs:
        try:
            _probe_one(report, func, batch, column, samples, wanted, timeout)
        except Exception as e:  # the user's function: anything it raises means "not probed", never a crash
            report.notes.append(f"{reward_name(func)} was not probed: it raised {type(e).__name__}: {str(e)[:200]}")
    if column is not None and len(report.scores) == len(funcs):  # a yardstick for each: judge them together
        _probe_together(report, funcs, list(weights) if weights is not None else [1.0] * len(funcs), batch, column,
                        [t for t in tools if batch.chat and probe_set.TOOL_PROBE.name in wanted], timeout)
    return report


def probe_rows(rows: Sequence[dict], count: int) -> list[dict]:
    """``count`` rows spread evenly over ``rows`` (all of them where there are fewer), in order."""
    rows = [dict(row) for row in rows] if count >= len(rows) else [dict(rows[i * len(rows) // count])
                                                                   for i in range(count)]
    for i, row in enumerate(rows):
        if "prompt" not in row:
            raise CoveyError(f"probe_rewards: row {i} has no 'prompt' (columns: {', '.join(row)}); give rows as the "
                             "trainer loads them")
    return rows


def _loaded(funcs: list) -> list[RewardFunc]:
    from covey.rewards.loading import load_reward_func

    return [load_reward_func(f) if isinstance(f, str) else f for f in funcs]


def _reference_column(row: dict) -> str | None:
    return next((c for c in probe_set.REFERENCE_COLUMNS if row.get(c) not in (None, "")), None)


def _function_reference(func: RewardFunc, row: dict) -> str | None:
    """The reference column ``func`` reads: one it requires by name, else the data's first."""
    needed = required_columns(func)
    return next((c for c in probe_set.REFERENCE_COLUMNS if c in needed and row.get(c) not in (None, "")),
                _reference_column(row))


class _Batch:
    """The rows probed, and how a list of texts (one per row, or per row and variant) becomes the
    trainer's call."""

    def __init__(self, rows: list[dict], tokenizer: Any, max_completion_length: int, strip_reasoning: bool):
        self.rows, self.tokenizer, self.limit, self.strip = rows, tokenizer, max_completion_length, strip_reasoning
        self.chat = isinstance(rows[0]["prompt"], list)

    def ids(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(range(len(text.split())))
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def padding(self, text: str) -> str:
        """Filler that brings ``text`` to max_completion_length tokens."""
        words = FILLER.split()
        per_word = max(1, len(self.ids(FILLER))) / len(words)
        room = self.limit - len(self.ids(text))
        count = max(0, math.floor(room / per_word) - 1)
        return " ".join(words[k % len(words)] for k in range(count))

    def call(self, func: RewardFunc, texts: list[str], row_of: list[int], timeout: float | None,
             episodes: list[list[dict]] | None = None) -> list[float]:
        """``func``'s scores of ``texts`` (completion k answering row ``row_of[k]``), or of ``episodes`` (chat
        rows: each a completion's messages, ``texts`` their text); NaN for None."""
        texts = [answer_after_reasoning(t) if self.strip else t for t in texts]
        rows = [self.rows[r] for r in row_of]
        completions = episodes or [[{"role": "assistant", "content": t}] if self.chat else t for t in texts]
        columns = {key: [row.get(key) for row in rows] for key in self.rows[0] if key != "prompt"}
        kwargs = dict(prompts=[row["prompt"] for row in rows], completions=completions,
                      completion_ids=[self.ids(t) for t in texts], **columns,
                      **without_logging(reward_context(TrainerState(global_step=0, max_steps=1, epoch=0.0))))
        name = reward_name(func)
        values = checked_values(call_reward(func, kwargs, timeout), name, len(texts))
        return [math.nan if v is None else reward_value(v, name, i) for i, v in enumerate(values)]


def _prompt_text(prompt: Any, whole: bool) -> str:
    """A prompt's text: every message joined (``whole``: the system prompt says how to answer), else the last
    user message, which is what a completion would echo."""
    if isinstance(prompt, str):
        return prompt
    messages = [m for m in prompt if isinstance(m, dict)]
    if whole:
        return "\n".join(str(m.get("content", "")) for m in messages)
    users = [m for m in messages if m.get("role") == "user"] or messages
    return str(users[-1].get("content", "")) if users else ""


def _mean(values: list[float]) -> float | None:
    defined = [v for v in values if not math.isnan(v)]
    return statistics.fmean(defined) if defined else None


def _probe_rows(batch: _Batch, column: str | None, form: AnswerFormat) -> list[ProbeRow]:
    answers = [probe_set.reference_text(row[column]) if column else None for row in batch.rows]
    others = answers[1:] + answers[:1]  # each row's neighbour, so every reference is written once
    return [ProbeRow(_prompt_text(row["prompt"], whole=False), answer, other if other != answer else None,
                     probe_set.wrong_answers(answer, answers, 4) if answer is not None else [],
                     form, batch.padding) for row, answer, other in zip(batch.rows, answers, others)]


def _best_format(func: RewardFunc, batch: _Batch, column: str, timeout: float | None) -> tuple[AnswerFormat, float]:
    """The format in which ``func`` scores the correct answers highest (the prompt's own first on a tie), and
    that mean score: the yardstick."""
    forms = probe_set.answer_formats(_prompt_text(batch.rows[0]["prompt"], whole=True))
    rows = _probe_rows(batch, column, forms[0])
    texts = [form.write(row.answer) for form in forms for row in rows]
    scores = batch.call(func, texts, [r for _ in forms for r in range(len(rows))], timeout)
    means = [_mean(scores[k * len(rows):(k + 1) * len(rows)]) for k in range(len(forms))]
    best = max(range(len(forms)), key=lambda k: (-math.inf if means[k] is None else means[k], -k))
    return forms[best], means[best]


def _probe_one(report: ProbeReport, func: RewardFunc, batch: _Batch, column: str | None,
               samples: Sequence[Sequence[Any]] | None, wanted: set[str], timeout: float | None) -> None:
    name = reward_name(func)
    column = _function_reference(func, batch.rows[0]) if column else None
    if column is not None:
        form, yardstick = _best_format(func, batch, column, timeout)
    else:
        form = probe_set.answer_formats(_prompt_text(batch.rows[0]["prompt"], whole=True))[0]
        yardstick = None
        if samples is not None:
            texts = [completion_text(s) for row in samples for s in row]
            row_of = [r for r, row in enumerate(samples) for _ in row]
            yardstick = _mean(batch.call(func, texts, row_of, timeout))
    if column is not None and yardstick is None:
        report.notes.append(f"{name} was not probed: it returned None for every correct answer (it cannot read "
                            f"the {column!r} column?)")
        return
    rows = _probe_rows(batch, column, form)
    chosen = [p for p in PROBES if p.name in wanted and (column is not None or p.name not in probe_set.NEEDS_REFERENCE)]
    texts = [p.write(row) for p in chosen for row in rows]
    lengths = [t for row in rows for t in probe_set.length_texts(row)] if LENGTH_PROBE in wanted else []
    n = len(rows)
    scores = batch.call(func, texts + lengths, [r for _ in chosen for r in range(n)]
                        + [r for r in range(n) for _ in probe_set.LENGTH_SHARES], timeout)
    means = {p.name: _mean(scores[k * n:(k + 1) * n]) for k, p in enumerate(chosen)}
    shares = len(probe_set.LENGTH_SHARES)
    by_length = [_mean(scores[len(texts) + s::shares]) for s in range(shares)] if lengths else []
    report.scores[name] = {"yardstick": yardstick, **means, **{f"length_{s:g}": m for s, m in
                                                              zip(probe_set.LENGTH_SHARES, by_length)}}
    defined = [m for m in [yardstick, *means.values(), *by_length] if m is not None]
    if not defined:
        report.notes.append(f"{name} was not probed: it returned None for every probe")
        return
    checks_answers = column is not None and (column in required_columns(func) or (
        means.get("format_wrong_answer") is not None and means["format_wrong_answer"] < yardstick - _tol(yardstick)))
    penalty = not checks_answers and max(defined) <= 0
    if yardstick is not None and not penalty:
        low = min(defined)
        for k, probe in enumerate(chosen):
            score = means[probe.name]
            if score is None:
                continue
            above = score > yardstick + _tol(yardstick)
            as_high = ((checks_answers or column is None) and not probe.solves and score >= yardstick - _tol(yardstick)
                       and score > low + _tol(low))
            if above or as_high:
                report.findings.append(ProbeFinding(name, probe.name, probe.what, score, yardstick,
                                                    texts[k * n][:EXAMPLE_CHARS], probe.advice))
    if len(by_length) == shares and None not in by_length:
        short, middle, long = by_length
        if long > short + _tol(short) and middle >= short - _tol(short):
            report.findings.append(ProbeFinding(
                name, LENGTH_PROBE, f"filler before the answer (scores {short:.3g} -> {middle:.3g} -> {long:.3g} "
                "from no filler to max_completion_length)", long, short, lengths[shares - 1][:EXAMPLE_CHARS],
                probe_set.LENGTH_ADVICE))
    if yardstick is None and column is None:
        report.notes.append(f"{name}: no reference answer and no samples to compare with, so only its response to "
                            "length was probed")


def _probe_together(report: ProbeReport, funcs: list[RewardFunc], weights: list[float], batch: _Batch, column: str,
                    tools: list[str], timeout: float | None) -> None:
    """The functions' weighted total on each probe against their total on the yardstick (every function's own,
    in its best format): a probe without the right final answer whose total is as high and above the lowest
    total is a finding under the functions' names joined by '+', unless a function alone was already found
    fooled by it. With ``tools``, the tool probe (an episode calling the first) is scored first."""
    names = [reward_name(f) for f in funcs]
    scores = [report.scores[name] for name in names]
    n, text = len(batch.rows), ""
    if tools:
        episode = probe_set.tool_episode(tools[0])
        text = completion_text(episode)
        for func, own in zip(funcs, scores):
            own[probe_set.TOOL_PROBE.name] = _mean(batch.call(func, [text] * n, list(range(n)), timeout, [episode] * n))

    def total(key: str) -> float | None:
        values = [own.get(key) for own in scores]
        return None if None in values else sum(w * v for w, v in zip(weights, values))

    totals = {key: total(key) for key in scores[0]}
    defined = [t for t in totals.values() if t is not None]
    yardstick = totals.get("yardstick")
    if yardstick is None or not defined or max(defined) <= 0:  # no yardstick, or a set of penalties
        return
    low, found = min(defined), {f.probe for f in report.findings if f.reward in names}
    rows = _probe_rows(batch, column, probe_set.answer_formats(_prompt_text(batch.rows[0]["prompt"], whole=True))[0])
    for probe in [*PROBES, probe_set.TOOL_PROBE]:
        score = totals.get(probe.name)
        if probe.solves or score is None or probe.name in found:
            continue
        if score >= yardstick - _tol(yardstick) and score > low + _tol(low):
            example = text if probe is probe_set.TOOL_PROBE else probe.write(rows[0])
            report.findings.append(ProbeFinding("+".join(names), probe.name, probe.what, score, yardstick,
                                                example[:EXAMPLE_CHARS], probe.advice))


def _tol(value: float | None) -> float:
    return TOLERANCE * max(1.0, abs(value or 0.0))
