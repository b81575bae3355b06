"""Asynchronous generation: a worker thread samples and scores the next generation rounds while the
trainer trains on earlier ones.

The worker has a copy of the policy of its own. An engine that samples with a policy module (fast, hf)
is built again over that copy; one that holds its own copy of the weights (vLLM in this process, a vLLM
or covey server) is the trainer's, and the worker pushes the weights it loads into it, between its
rounds: no request is in flight then, so nothing is drained or paused midway. After each round of optimizer
steps the trainer publishes the trained weights (a snapshot, numbered by the rounds trained); the
worker loads a snapshot before it samples a round. With ``a = max_staleness // optimizer steps per
round`` rounds ahead, round r is sampled with snapshot ``r - a`` (``async_schedule: fixed``, so that a
seeded run is reproducible) or with the newest snapshot there is, never older than ``r - a``
(``latest``). Each row carries the optimizer step of the policy that sampled it and its sampling
log-probs; the step corrects every row for that policy (``covey.core.engine_importance_weights``, the
engine/trainer correction) and drops rounds staler than max_staleness, counting them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from covey.config import GRPOConfig
from covey.data import PromptSampler
from covey.errors import ConfigError
from covey.rollout import OwnWeights, RolloutEngine
from covey.train.batch import Generated, Progress
from covey.train.parts import StepParts
from covey.train.sharding import whole


STALE_ROUNDS_IN_A_ROW = 4  # rounds dropped one after another before the run stops: the worker is stuck


@dataclass(frozen=True)
class AsyncSchedule:
    """How far the worker runs ahead of the trainer."""

    rounds_ahead: int  # generation rounds sampled before the trainer reaches them
    max_staleness: int  # optimizer steps a round's policy may lag the trainer's at the round's first step
    fixed: bool  # round r sampled with exactly the weights after r - rounds_ahead rounds of training

    @classmethod
    def from_args(cls, args: GRPOConfig) -> "AsyncSchedule":
        return cls(args.max_staleness // args.optimizer_steps_per_generation, args.max_staleness,
                   args.async_schedule == "fixed")

    def snapshot_for(self, round_index: int) -> int:
        """The oldest snapshot (rounds trained) round ``round_index`` may be sampled with."""
        return max(0, round_index - self.rounds_ahead)


def check_async_run(args: GRPOConfig, processes: int, engine: RolloutEngine | None, own_rollouts: bool,
                    server: bool) -> None:
    """What asynchronous generation cannot do yet, refused before anything is loaded. ``server``: the
    run samples from a vLLM or covey server."""
    if not args.async_generation:
        return
    problems = [
        (processes > 1 and server, f"{processes} processes sampling from one server: each process's worker would "
                                   "push its own snapshots to it; train asynchronously against a server in one process"),
        (processes > 1 and args.dynamic_sampling, f"dynamic_sampling with {processes} processes: the worker's refill "
                                                  "agrees with the other processes' workers, which the trainers' own "
                                                  "exchanges would interleave with; turn dynamic_sampling off or "
                                                  "train in one process"),
        (own_rollouts, "rollout_func samples the completions itself, with whatever weights it reaches, so no round "
                       "would be sampled with the weights its schedule names; train a rollout_func synchronously"),
        (engine is not None and not isinstance(engine, OwnWeights),
         f"rollout_engine {type(engine).__name__}: the worker builds its own engine over its copy of the "
         "policy (rollout_engine: fast or hf), or pushes that copy into an engine with its own weights "
         "(a covey.rollout.OwnWeights: vLLM's)"),
    ]
    for refused, why in problems:
        if refused:
            raise ConfigError(f"async_generation: {why}")


@dataclass(frozen=True)
class InFlight:
    """A round the worker sampled: what generate_and_score gave, and the policy it sampled with."""

    version: int  # the optimizer step of the policy that sampled it
    generated: Generated
    waited_for_weights: float  # seconds the worker waited for the snapshot it sampled with


class AsyncGeneration:
    """The worker thread, its queue of sampled rounds (at most rounds_ahead), and the published weights.

    ``generate(parts, prompt_sampler, progress)`` is steps 1-2 of a step (``covey.train.rounds.generate_and_score``)
    run by the worker on its own parts: the trainer's, with the worker's engine (over the worker's model). An engine with
    its own copy of the weights (``OwnWeights``) is shared with the trainer (``shares_engine``): the
    trainer samples with it only while the worker is held (``engine_lent``)."""

    def __init__(self, parts: StepParts, prompt_sampler: PromptSampler, schedule: AsyncSchedule,
                 build_engine: Callable[[torch.nn.Module], RolloutEngine],
                 generate: Callable[[StepParts, PromptSampler, Progress], Generated], progress: Progress,
                 restored: dict | None = None):
        self.schedule = schedule
        sampler = parts.sampler
        model = copy.deepcopy(sampler.whole_policy(parts.policy)).eval()
        if sampler.policy_copy is not None:  # the worker's copy is whole; the engine's is freed until it samples
            sampler.policy_copy.release()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model, self.trainer_model = model, parts.policy.model
        self.shares_engine = isinstance(sampler.engine, OwnWeights)  # one vLLM (or server) for both
        self.engine = sampler.engine if self.shares_engine else build_engine(model)
        self.parts = parts.sampling_with(self.engine)
        self.prompt_sampler, self.generate = prompt_sampler, generate
        self.trained = [name for name, p in self.trainer_model.named_parameters() if p.requires_grad]
        self.rounds_trained = 0  # snapshots published after the first: rounds the trainer finished
        self.snapshots: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # rounds trained -> (step, weights)
        self.loaded: int | None = None  # the snapshot the worker's model holds
        self.next_round, self.rounds_sampled = 0, progress.rounds_sampled
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, schedule.rounds_ahead))
        self.changed = threading.Condition()  # guards the snapshots and the worker's state
        self.stopping = threading.Event()
        self.holding = False  # a checkpoint asks the worker to stop at the next round it would sample
        self.idle = False  # the worker waits (for weights, for room in the queue, or held)
        self.pending: InFlight | None = None  # a round sampled, waiting for room in the queue
        self.thread: threading.Thread | None = None
        self.threads_before = torch.get_num_threads()
        # the trainer and a worker that samples in this process share the cores, half each; a server samples
        # in its own process
        self.threads = self.threads_before if self.engine.shared_by_processes else max(1, self.threads_before // 2)
        self.dropped_rows = self.trained_rows = 0  # rows of the rounds taken: dropped as stale, and trained
        queued = self._requeue(restored) if restored is not None else 0
        # the worker samples no round the trainer will not train: up to the rounds taken (trained or dropped)
        # and those max_steps still needs, counted again after each round
        self.rounds_taken = self.next_round - queued
        self.round_limit = self.rounds_taken
        self.publish(self.trainer_model, progress.global_step, first=True)

    def _requeue(self, restored: dict) -> int:
        """The worker's state and the rounds in flight a checkpoint captured (``held``), queued again; how many."""
        self.next_round, self.rounds_sampled = restored["next_round"], restored["rounds_sampled"]
        self.rounds_trained, self.dropped_rows = restored["rounds_trained"], restored["dropped_rows"]
        self.trained_rows = restored["trained_rows"]
        rounds = list(restored["rounds"])
        for item in rounds[:self.queue.maxsize]:
            self.queue.put_nowait(item)
        self.pending = rounds[self.queue.maxsize] if len(rounds) > self.queue.maxsize else None
        return len(rounds)

    # ---- trainer side -------------------------------------------------------------------------

    def start(self) -> "AsyncGeneration":
        torch.set_num_threads(self.threads)
        self.thread = threading.Thread(target=self._work, name="covey-async-generation", daemon=True)
        self.thread.start()
        return self

    def publish(self, model: torch.nn.Module, global_step: int, first: bool = False) -> None:
        """The weights after a round of training (``first``: before any), for the rounds that wait for them."""
        named = dict(model.named_parameters())
        weights = {name: whole(named[name]).detach().to("cpu", copy=True) for name in self.trained}
        with self.changed:
            if not first:
                self.rounds_trained += 1
            self.snapshots[self.rounds_trained] = (global_step, weights)
            args = self.parts.args
            self.round_limit = self.rounds_taken + math.ceil(max(0, args.max_steps - global_step)
                                                             / args.optimizer_steps_per_generation)
            self.changed.notify_all()

    def take(self, global_step: int) -> Generated:
        """The next sampled round fresh enough to train at ``global_step`` (what generate_and_score gave),
        its timings joined by the async metrics: staleness, queue depth, the seconds the trainer waited for
        it, those the worker waited for weights, and the rows dropped as staler than max_staleness so far."""
        started = time.perf_counter()
        for _ in range(STALE_ROUNDS_IN_A_ROW + 1):
            item = self._get()
            with self.changed:  # room in the queue for a worker that waits
                self.rounds_taken += 1
                self.changed.notify_all()
            staleness = global_step - item.version
            # every process drops the round if one does: they train the same rounds, in step
            if not self.parts.world.any(staleness > self.schedule.max_staleness):
                self.trained_rows += item.generated.samples.size
                break
            self.dropped_rows += item.generated.samples.size  # a round's rows share its policy
            with self.changed:  # and one more round to sample in its place
                self.round_limit += 1
                self.changed.notify_all()
        else:
            raise RuntimeError(f"asynchronous generation: {STALE_ROUNDS_IN_A_ROW + 1} rounds in a row were staler than "
                               f"max_staleness={self.schedule.max_staleness} (the last sampled at step {item.version}, "
                               f"trained at {global_step}): the worker does not sample with the weights published")
        waited = time.perf_counter() - started
        metrics = {"async/staleness": float(staleness), "async/queue_depth": float(self.queue.qsize()),
                   "async/dropped_rows": float(self.dropped_rows),
                   "async/dropped_fraction": self.dropped_rows / (self.dropped_rows + self.trained_rows),
                   "time/wait_for_data": waited,
                   "time/wait_for_weights": item.waited_for_weights}
        return dataclasses.replace(item.generated, timings={**item.generated.timings, **metrics})

    @contextlib.contextmanager
    def held(self):
        """The worker held at a round boundary, where every round it has not sampled yet needs weights from
        now on; gives what a checkpoint captures: the rounds in flight, sampled but not trained (the
        prompt sampler, shared with the worker, is at the worker's position meanwhile)."""
        with self.changed:
            self.holding = True
            self.changed.notify_all()
            while not self.idle and self.thread is not None and self.thread.is_alive():
                self.changed.wait(timeout=0.5)
            rounds = list(self.queue.queue) + ([self.pending] if self.pending is not None else [])
            try:
                yield {"rounds": rounds, "next_round": self.next_round, "rounds_sampled": self.rounds_sampled,
                       "rounds_trained": self.rounds_trained, "dropped_rows": self.dropped_rows,
                       "trained_rows": self.trained_rows}
            finally:
                self.holding = False
                self.changed.notify_all()

    @contextlib.contextmanager
    def engine_lent(self):
        """The engine the trainer samples with (to evaluate) holding the trained policy meanwhile: a shared
        one is taken from the worker, held at a round boundary, and given back with the worker's own
        weights pushed again before its next round."""
        if not self.shares_engine:
            yield
            return
        with self.held():
            self.engine.policy_changed(self.trainer_model)
            try:
                yield
            finally:
                self.loaded = None  # reloaded (and pushed) before the worker samples again

    def close(self) -> None:
        self.stopping.set()
        with self.changed:
            self.changed.notify_all()
        if self.thread is not None:  # it stops at its next wait, or once the round it samples is done
            self.thread.join()
        torch.set_num_threads(self.threads_before)
        if self.shares_engine:  # the trainer samples with it from now on: the trained policy, pushed
            self.engine.policy_changed(self.trainer_model)

    def __enter__(self) -> "AsyncGeneration":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _get(self) -> InFlight:
        while True:
            try:
                item = self.queue.get(timeout=1.0)
            except queue.Empty:
                if self.thread is None or not self.thread.is_alive():
                    raise RuntimeError("the asynchronous generation worker stopped without a word") from None
                continue
            if isinstance(item, BaseException):  # the worker's error, as a synchronous run would raise it
                raise item
            return item

    # ---- worker side --------------------------------------------------------------------------

    def _work(self) -> None:
        torch.set_num_threads(self.threads)
        try:
            if self.pending is not None:  # a round in flight a checkpoint held: queued first
                self._put(self.pending)
            while not self.stopping.is_set():
                round_index = self.next_round
                with self.changed:
                    while round_index >= self.round_limit and not self.stopping.is_set():
                        self._wait_idle()  # every round max_steps needs is sampled
                t0 = time.perf_counter()
                version = self._load_weights(self.schedule.snapshot_for(round_index))
                if version is None:
                    return
                waited = time.perf_counter() - t0
                with self.changed:  # a checkpoint in progress: the sampler stays where it is, once the worker
                    # has caught up with the rounds that need older weights than the checkpoint's
                    while (self.holding and self.schedule.snapshot_for(round_index) >= self.rounds_trained
                           and not self.stopping.is_set()):
                        self._wait_idle()
                progress = Progress(global_step=version, rounds_sampled=self.rounds_sampled)
                generated = self.generate(self.parts, self.prompt_sampler, progress)
                self.rounds_sampled += generated.rounds
                self.next_round += 1
                self._put(InFlight(version, generated, waited))
        except BaseException as e:  # handed to the trainer, which raises it
            self._put(e)

    def _load_weights(self, oldest: int) -> int | None:
        """Load the snapshot round ``oldest`` is sampled with (waiting for it to be published); its step."""
        with self.changed:
            while oldest not in self.snapshots and not self.stopping.is_set():
                if self.snapshots and max(self.snapshots) > oldest and not self.schedule.fixed:
                    break
                self._wait_idle()
            if self.stopping.is_set():
                return None
            index = oldest if self.schedule.fixed else max(self.snapshots)
            version, weights = self.snapshots[index]
            for stale in [i for i in self.snapshots if i < oldest]:  # no later round takes an older one
                del self.snapshots[stale]
        if index != self.loaded:
            named = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in weights.items():
                    named[name].copy_(value)
            self.engine.policy_changed(self.model)
            self.loaded = index
        return version

    def _wait_idle(self) -> None:
        """Wait for a change, idle meanwhile (the caller holds ``changed``)."""
        self.idle = True
        self.changed.notify_all()
        self.changed.wait(timeout=0.5)
        self.idle = False

    def _put(self, item: InFlight | BaseException) -> None:
        with self.changed:
            self.pending = item if isinstance(item, InFlight) else None
        while not self.stopping.is_set():
            with self.changed:
                try:
                    self.queue.put_nowait(item)
                    self.pending = None
                    return
                except queue.Full:
                    self._wait_idle()
