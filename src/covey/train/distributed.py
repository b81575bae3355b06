"""Data-parallel training over several processes, through torch.distributed.

Started by a launcher that sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` and ``MASTER_ADDR``
(``torchrun --nproc_per_node 4 -m covey train my.yaml``, or ``accelerate launch``), every process
holds the whole model and samples, scores and trains on whole groups of prompts of its own:

- the prompts of a round are drawn once, with the same seed everywhere, and each process takes its
  share (a prompt repeats within a round only where a pass over the data ends, as in one process);
- rewards are gathered before the advantage, so advantages are those of the whole batch (which
  matters where they are normalised over the batch, ``scale_rewards: batch``);
- the loss of each process is normalised by the counts of the whole optimizer step, and the
  gradients are summed over the processes: with one optimizer step per round (the default) the
  update is the one a single process would make on the whole batch (with several, step k takes
  the k-th part of each process's batch);
- the first process writes the run folder, the logs and the checkpoints, from metrics over the
  whole batch.

``World`` is the one place that calls torch.distributed; with one process every call is a no-op.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from covey.errors import ConfigError, CoveyError

T = TypeVar("T")

# how far apart the seeds of the processes are, so that none repeats another's in a run
RANK_SEED_STRIDE = 2 ** 32


@dataclass(frozen=True)
class World:
    """This process's place among the data-parallel processes: ``rank`` of ``size``."""

    rank: int = 0
    size: int = 1

    @staticmethod
    def launched_size() -> int:
        """The number of processes the launcher started (WORLD_SIZE; 1 without a launcher)."""
        return int(os.environ.get("WORLD_SIZE", "1") or 1)

    @staticmethod
    def from_environment(timeout_s: float = 3600) -> World:
        """One process unless a launcher set WORLD_SIZE > 1; then joins (or starts) the process group:
        NCCL with one GPU per process where CUDA is available, gloo on CPUs; a process waits for the others
        at most ``timeout_s`` seconds at a collective."""
        size = World.launched_size()
        if size <= 1:
            return World()
        if not dist.is_available():
            raise CoveyError(f"WORLD_SIZE={size} asks for {size} processes, but this torch build has no "
                             "torch.distributed; run a single process or install a build with it")
        if not dist.is_initialized():
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
            World.joined = True
        return World(dist.get_rank(), dist.get_world_size())

    joined = False  # whether this process started the process group (and so closes it)

    @staticmethod
    def leave() -> None:
        """Close the process group this process started, if any (NCCL warns at exit about one left open);
        one that another library started (colocated vLLM's) is that library's to close."""
        if World.joined and dist.is_initialized():
            dist.destroy_process_group()
        World.joined = False

    def check_device(self, device: torch.device) -> None:
        """Under NCCL, the model must sit on this process's own GPU (where covey puts the models it loads)."""
        if self.size > 1 and dist.get_backend() == "nccl" and device != torch.device("cuda", torch.cuda.current_device()):
            raise ConfigError(f"process {self.rank} holds the model on {device}, but its GPU is "
                              f"cuda:{torch.cuda.current_device()} (LOCAL_RANK); pass the model by name, or move it "
                              "to torch.device('cuda', int(os.environ['LOCAL_RANK'])) before handing it over")

    @property
    def is_main(self) -> bool:
        """The process that writes the run folder and prints."""
        return self.rank == 0

    def seed(self, seed: int) -> int:
        """This process's own seed for a random stream seeded ``seed`` (sampling, dropout): ``seed``
        itself in the first process, so that one process runs as without a launcher."""
        return seed + self.rank * RANK_SEED_STRIDE

    def share(self, items: list[T]) -> list[T]:
        """This process's contiguous share of ``items``, the first ones an item longer when they do not
        divide evenly; concatenated in rank order, the shares give back ``items``."""
        n, extra = divmod(len(items), self.size)
        start = self.rank * n + min(self.rank, extra)
        return items[start:start + n + (self.rank < extra)]

    def gather(self, value: T) -> list[T]:
        """``value`` of every process, in rank order (any picklable object)."""
        if self.size == 1:
            return [value]
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def gather_on_main(self, value: T) -> list[T] | None:
        """``value`` of every process, in rank order, in the first process; None in the others."""
        if self.size == 1:
            return [value]
        values: list[Any] | None = [None] * self.size if self.is_main else None
        dist.gather_object(value, values, dst=0)
        return values

    def on_main(self, compute: Callable[[], T]) -> T:
        """``compute()`` run by the first process only, its result (or the error it raised) handed to
        every process: for what must happen once, such as claiming the run folder."""
        if self.size == 1:
            return compute()
        outcome: list[Any] = [None]
        error: Exception | None = None
        if self.is_main:
            try:
                outcome = [(True, compute())]
            except Exception as e:
                error = e
                outcome = [(False, e if _picklable(e) else CoveyError(f"the first process failed: {type(e).__name__}: {e}"))]
        dist.broadcast_object_list(outcome, src=0)
        ok, value = outcome[0]
        if not ok:
            raise error or value  # the first process raises its own error, with its traceback
        return value

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the processes (keys missing in some count as 0)."""
        if self.size == 1:
            return values
        totals: dict[str, float] = {}
        for part in self.gather(values):
            for key, value in part.items():
                totals[key] = totals.get(key, 0.0) + value
        return totals

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds in any process."""
        return flag if self.size == 1 else any(self.gather(bool(flag)))

    def max(self, value: int) -> int:
        """The largest ``value`` of the processes."""
        return value if self.size == 1 else max(self.gather(int(value)))

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """The first process's parameters and buffers everywhere, so every process starts from the same
        weights whatever its own random state (a LoRA adapter's initialisation, a model built in place)."""
        if self.size == 1:
            return
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)

    def data_parallel(self, forward: torch.nn.Module, static_graph: bool = False) -> torch.nn.Module:
        """``forward`` (the training pass) under torch's DistributedDataParallel with several processes:
        the gradients are summed while the backward runs, bucket by bucket, on the micro-batch where the
        process asks for it (``sync_gradients``). The weights are the same everywhere already
        (``broadcast_parameters``). ``static_graph``: for checkpointed layers, which recompute their part
        of the graph in the backward. One process: ``forward`` itself."""
        if self.size == 1:
            return forward
        from torch.nn.parallel import DistributedDataParallel

        device = next(forward.parameters()).device
        return DistributedDataParallel(forward, device_ids=[device.index] if device.type == "cuda" else None,
                                       forward_sync_buffers=False, init_sync=False, static_graph=static_graph,
                                       gradient_as_bucket_view=True)

    def gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The whole ``state_dict()`` of an optimizer whose state is sharded over the processes (torch's
        ZeroRedundancyOptimizer), in the first process (None in the others), which receives the others'
        parts onto its CPU tensor by tensor: torch's own consolidation pickles every part whole, which
        costs several times its size in memory and about a minute per 500 MB on a CPU."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        share = sharded_part(optimizer).state  # this process's part: parameter -> its state
        held = {i: {key: _TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
                    for key, v in share[p].items()} for i, p in enumerate(params) if p in share}
        # parameter tensors go over NCCL from the GPU; gloo takes them where they are, on the CPU
        device = params[0].device if dist.get_backend() == "nccl" else torch.device("cpu")
        state: dict[int, dict] = {}
        for rank, owned in enumerate(self.gather(held)):  # what each holds (shapes, not values)
            for index, entries in owned.items():
                if rank == self.rank == 0:
                    state[index] = dict(share[params[index]])
                elif rank == self.rank:
                    for value in share[params[index]].values():
                        if isinstance(value, torch.Tensor):
                            dist.send(value.detach().to(device).contiguous(), dst=0)
                elif self.is_main:
                    state[index] = {}
                    for key, entry in entries.items():
                        if isinstance(entry, _TensorSpec):
                            received = torch.empty(entry.shape, dtype=entry.dtype, device=device)
                            dist.recv(received, src=rank)
                            entry = received.cpu()
                        state[index][key] = entry
        if not self.is_main:
            return None
        # the settings of every group, and its parameters as indices, as a state_dict() gives them
        return {"state": dict(sorted(state.items())),
                "param_groups": torch.optim.Optimizer.state_dict(optimizer)["param_groups"]}


@dataclass(frozen=True)
class _TensorSpec:
    """A tensor of optimizer state that is about to be sent: what to receive it into."""

    shape: tuple[int, ...]
    dtype: torch.dtype


# what `accelerate launch` passes its processes from an accelerate config, and what covey says of it: covey
# runs DDP or FSDP2 (an FSDP config is read by covey.train.sharding), so a config that asks for another
# engine is refused, not ignored
ACCELERATE_ENGINES = {
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "a parallelism config (tensor, context or sequence parallel)",
}


def check_launcher_settings(bf16: bool, environ: dict[str, str] | None = None) -> None:
    """Refuse what an accelerate config asks for that covey would not do: another distributed engine, a
    compiler, or a mixed precision that the run's own bf16 setting does not give. (covey runs plain data
    parallelism, or FSDP2 under an FSDP config or fsdp: full_shard; see docs/distributed.md.)"""
    environ = os.environ if environ is None else environ
    asked = [engine for key, engine in ACCELERATE_ENGINES.items() if environ.get(key, "").lower() == "true"]
    problems = [f"the accelerate config asks for {engine}, which covey does not run: it runs plain data parallelism "
                "(DDP) or shards the model with FSDP2; launch with an accelerate config of distributed_type "
                "MULTI_GPU, MULTI_CPU or FSDP (fsdp_version: 2), or with torchrun" for engine in asked]
    if environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() not in ("no", ""):
        problems.append(f"the accelerate config compiles with dynamo_backend {environ['ACCELERATE_DYNAMO_BACKEND']}, "
                        "which covey does not do; set dynamo_backend: 'no' in it")
    precision = environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if precision not in ("no", "") and not (precision == "bf16" and bf16):
        problems.append(f"the accelerate config asks for mixed_precision: {precision}, and covey takes its precision "
                        "from its own config only: " + ("set bf16: true there (and keep the accelerate config's)"
                                                        if precision == "bf16" else
                                                        "covey trains in float32 or under bf16 autocast (bf16: true); "
                                                        "set mixed_precision: 'no' or bf16 in the accelerate config"))
    if problems:
        raise ConfigError("; ".join(problems))


def sharded_part(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The part of an optimizer sharded over the processes (torch's ZeroRedundancyOptimizer, under
    shard_optimizer_state) that this process holds and steps; None for an optimizer that is whole."""
    return getattr(optimizer, "optim", None)


def _picklable(value: Any) -> bool:
    """Whether ``value`` survives the trip to another process (an exception whose constructor takes
    more than its message pickles, but does not unpickle)."""
    try:
        pickle.loads(pickle.dumps(value))
        return True
    except Exception:
        return False
