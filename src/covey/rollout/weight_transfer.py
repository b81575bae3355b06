"""Weights from the trainer to a rollout server over a weight-transfer group, vLLM's protocol: the
trainer's end of covey's own backend (``covey_gloo``, gloo: any machine) and of vLLM's ``nccl`` (GPUs).

The trainer is rank 0 of a group it opens with the server's workers (ranks ``rank_offset`` ..),
announced by ``/init_weight_transfer_engine``; each update lists the tensors' names, dtypes and
shapes (``/update_weights``) and the trainer then broadcasts them one by one, in that order.
``covey_gloo`` does what vLLM's ``nccl`` does, on any machine, so the trainer's path is tested where
there is no GPU. vLLM's workers find it through covey's plugin (``covey.rollout.vllm_plugin``);
``covey server`` receives with the same functions. Its two ends need only torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch
import torch.distributed as dist

BACKEND = "covey_gloo"
# how long one broadcast may wait for the other side. A push that fails midway leaves the server's
# workers waiting this long for the rest (vLLM answers nothing else meanwhile, its health check included)
GROUP_TIMEOUT_S = 600.0


@dataclass
class GlooInitInfo:
    """What the server's workers need to join the trainer's group (``/init_weight_transfer_engine``)."""

    master_address: str  # where the trainer (rank 0) listens
    master_port: int
    rank_offset: int  # the rank of the server's first worker
    world_size: int  # the trainer and every worker
    timeout_s: float = GROUP_TIMEOUT_S  # how long a collective may wait for the other side


@dataclass
class GlooUpdateInfo:
    """The tensors of one update, in the order they are broadcast (``/update_weights``); the fields
    of vLLM's ``nccl`` backend."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"an update lists {len(self.names)} names, {len(self.dtype_names)} dtypes and "
                             f"{len(self.shapes)} shapes; each tensor needs all three")

    @classmethod
    def of(cls, weights: list[tuple[str, torch.Tensor]]) -> "GlooUpdateInfo":
        return cls([name for name, _ in weights], [str(t.dtype).removeprefix("torch.") for _, t in weights],
                   [list(t.shape) for _, t in weights])

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def open_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of its own (the process's default group, if any, is left alone); rank 0 hosts its store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def send(group: dist.ProcessGroup, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Broadcast the tensors from rank 0, in order (each made contiguous, on the CPU)."""
    for _, tensor in weights:
        group.broadcast(tensor.detach().to("cpu").contiguous(), 0).wait()


def receive(group: dist.ProcessGroup, update: GlooUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``update`` as rank 0 broadcasts them, as (name, tensor) pairs."""
    for name, dtype_name, shape in zip(update.names, update.dtype_names, update.shapes):
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight {name!r} has the dtype {dtype_name!r}, which is not a torch dtype")
        tensor = torch.empty(shape, dtype=dtype)
        group.broadcast(tensor, 0).wait()
        yield name, tensor


# ---- the trainer's side ----------------------------------------------------------------------------------------


class WeightSyncClient(Protocol):
    """The server's weight-transfer endpoints (``covey.rollout.client.ServerAPI``; vLLM's trainer-side
    engines drive the same four)."""

    def init_weight_transfer_engine(self, init_info: dict) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class Sender(Protocol):
    """The trainer's end of a weight-transfer group: opened once, then one ``send`` per push."""

    @classmethod
    def open(cls, client: WeightSyncClient, address: str, port: int, world_size: int) -> "Sender": ...

    def send(self, weights: list[tuple[str, torch.Tensor]]) -> None: ...


def _at_once(request: Callable[[], None], local: Callable[[], Any]) -> Any:
    """Run the HTTP ``request`` (which returns once the server's side of a collective is done) and this
    side of it (``local``) together; returns what ``local`` returns. An error of either is raised at
    once: the other side then never joins, and waiting for it would hang until the group's timeout
    (its thread is left behind, a daemon)."""
    outcome: dict[str, Any] = {}

    def run(name: str, function: Callable[[], Any]) -> None:
        try:
            outcome[name] = function()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome[f"{name} error"] = e

    threads = [threading.Thread(target=run, args=(name, function), daemon=True)
               for name, function in (("request", request), ("local", local))]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        for name in ("request error", "local error"):
            if name in outcome:
                raise outcome[name]
        threads[0].join(0.05)
    for name in ("request error", "local error"):
        if name in outcome:
            raise outcome[name]
    return outcome["local"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class GlooSender:
    """covey's ``covey_gloo`` backend: tensors broadcast over gloo (any machine)."""

    def __init__(self, client: WeightSyncClient, group: dist.ProcessGroup):
        self.client, self.group = client, group

    @classmethod
    def open(cls, client: WeightSyncClient, address: str, port: int, world_size: int) -> "GlooSender":
        port = port or free_port()
        info = GlooInitInfo(address, port, rank_offset=1, world_size=world_size, timeout_s=GROUP_TIMEOUT_S)
        group = _at_once(lambda: client.init_weight_transfer_engine(dataclasses.asdict(info)),
                         lambda: open_group(address, port, 0, world_size, info.timeout_s))
        return cls(client, group)

    def send(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.client.start_weight_update()
        _at_once(lambda: self.client.update_weights(GlooUpdateInfo.of(weights).to_json()),
                 lambda: send(self.group, weights))
        self.client.finish_weight_update()


class NcclSender:
    """vLLM's own ``nccl`` backend (CUDA GPUs): its trainer-side engine, over the policy's weights."""

    def __init__(self, engine: Any, source: Any):
        self.engine, self.source = engine, source

    @classmethod
    def open(cls, client: WeightSyncClient, address: str, port: int, world_size: int) -> "NcclSender":
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        class Pushed(WeightSource):
            """The weights of the push under way, on the trainer's GPU."""

            weights: list[tuple[str, torch.Tensor]] = []

            def metadata(self) -> list:
                return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.weights]

            def __iter__(self):
                return iter(self.weights)

        source = Pushed()
        info = NCCLTrainerInitInfo(address, port or free_port(), world_size, rank=0)
        return cls(NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source), source)

    def send(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.source.weights = [(name, t.cuda().contiguous()) for name, t in weights]
        try:
            self.engine.send_weights()
        finally:
            self.source.weights = []


# weight-transfer backend (as the server was started with) -> the trainer's end of it
SENDERS: dict[str, type] = {BACKEND: GlooSender, "nccl": NcclSender}
