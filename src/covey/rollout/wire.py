"""What a ``covey server`` and its clients share: the HTTP endpoints' JSON forms of sampling settings and
rollouts, weights in safetensors chunks, the address and the shared secret.

    GET  /health        -> {"backend", "exact_logprobs", "weight_dtype", "instance"}
    POST /generate      {"prompt_ids", "num_generations", "params", "seed"}
                        -> {"completion_ids", "lengths", "sampling_logp", "finish_reasons", "exact_logprobs",
                            "instance"}
    POST /weights       safetensors bytes -> {"tensors": count loaded, "sha256": of the bytes received}
    POST /weights/done  -> {"tensors": count loaded since the last done, "instance"} (the end of one push)

``instance`` is drawn when the server starts: a client that sees it change knows the server was
restarted, with its start-up weights, and pushes the policy again.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from typing import Any, Iterable, Iterator

import torch

from covey.core import length_mask
from covey.errors import ConfigError
from covey.rollout.engine import Rollout, SamplingParams

CHUNK_BYTES = 256 * 2**20  # weights per /weights request
# one request may take a while (a long rollout, a large weight chunk), but never forever: a stalled
# server is reported instead of hanging the trainer
REQUEST_TIMEOUT = 1800.0
TOKEN_VARIABLE = "COVEY_SERVER_TOKEN"  # the shared secret of a server and its trainers, from the environment
MAX_REQUEST_BYTES = 2**34  # a request body beyond this is refused unread (one weight tensor may be large)
READ_TIMEOUT = 120.0  # seconds a request's connection may stay silent before the server drops it


def server_token() -> str | None:
    """This process's ``COVEY_SERVER_TOKEN`` (None when unset or empty); it travels in an HTTP header,
    so it must be printable ASCII."""
    token = os.environ.get(TOKEN_VARIABLE) or None
    if token is not None and not (token.isascii() and token.isprintable()):
        raise ConfigError(f"{TOKEN_VARIABLE} must be printable ASCII (it travels in an HTTP header); choose "
                          "another secret, e.g. the output of: python -c 'import secrets; print(secrets.token_hex())'")
    return token


def http_url(host: str, port: int) -> str:
    """http://host:port, with an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    return {**dataclasses.asdict(params), "stop": list(params.stop)}


def params_from_json(values: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**{**values, "stop": tuple(values.get("stop", ()))})
    except TypeError as e:
        raise ConfigError(f"unreadable sampling settings ({e}); are the trainer and the server the same covey "
                          "version?") from None


def rollout_to_json(rollout: Rollout, exact_logprobs: bool) -> dict[str, Any]:
    return {"completion_ids": rollout.completion_ids_BT.tolist(), "lengths": rollout.lengths_B.tolist(),
            "sampling_logp": rollout.sampling_logp_BT.tolist(), "finish_reasons": rollout.finish_reasons,
            "exact_logprobs": exact_logprobs}


def rollout_from_json(reply: dict[str, Any], pad_token_id: int) -> Rollout:
    """The ``Rollout`` the server's engine returned, padded with the client's pad id. float32 values
    survive JSON exactly (each is written as the shortest decimal that reads back to it)."""
    ids_BT = torch.tensor(reply["completion_ids"], dtype=torch.long)
    mask_BT = length_mask(torch.tensor(reply["lengths"], dtype=torch.long), ids_BT.shape[1])
    return Rollout(ids_BT.masked_fill(mask_BT == 0, pad_token_id), mask_BT,
                   torch.tensor(reply["sampling_logp"], dtype=torch.float32), list(reply["finish_reasons"]))


def weight_chunks(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                  max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive groups of CPU tensors (floating ones cast to ``dtype``) of at most ``max_bytes``
    each (a single larger tensor goes alone)."""
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in weights:
        tensor = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = tensor
        size += nbytes
    if chunk:
        yield chunk
