"""What a rollout server and its trainers share: vLLM's own HTTP API, which ``vllm serve`` offers
(its RL endpoints with ``VLLM_SERVER_DEV_MODE=1``) and ``covey server`` offers too, over covey's
fast engine. The endpoints the trainer uses:

    GET  /health                       200 once the server is up
    GET  /version                      {"version"}
    GET  /server_info?config_format=json  {"vllm_config": {"model_config", "parallel_config",
                                       "weight_transfer_config", ...}}: what the server samples with
    GET  /v1/models                    {"data": [{"id"}]}: the name requests give as "model"
    POST /v1/completions               one prompt's token ids, sampling settings, ``logprobs: 0`` and
                                       ``return_token_ids: true`` -> {"choices": [{"index", "token_ids",
                                       "logprobs": {"token_logprobs"}, "finish_reason", "stop_reason"}]}
    POST /inference/v1/generate        a prompt that shows pictures (vLLM's server only, started with
                                       ``--enable-scale-out``): {"token_ids", "content_parts": [{"type":
                                       "image_url", "url": "data:image/png;base64,..."}], "sampling_params"}
                                       -> {"choices": [{"index", "token_ids", "logprobs": {"content":
                                       [{"token_id", "logprob"}]}, "finish_reason", "stop_reason"}]}
    GET  /weight_info                  {"weight_version"}: the weights it holds, as the last push named them
    POST /pause?mode=wait, /resume     around a push
    POST /init_weight_transfer_engine  {"init_info"}: join the trainer's weight-transfer group
    POST /start_weight_update, /update_weights {"update_info"}, /finish_weight_update: one push
    POST /update_weight_version        {"new_version"}

Weights travel over the weight-transfer group, not HTTP (``covey.rollout.weight_transfer``).
"""

from __future__ import annotations

import base64
import io
import ipaddress
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from covey.errors import ConfigError, ModelError
from covey.rollout.engine import Rollout, SamplingParams, padded_rollout

# one request may take a while (a long rollout, a large weight update), but never forever: a stalled
# server is reported instead of hanging the trainer
REQUEST_TIMEOUT = 1800.0
TOKEN_VARIABLE = "COVEY_SERVER_TOKEN"  # the shared secret of a server and its trainers, from the environment
MAX_REQUEST_BYTES = 2**26  # a request body beyond this is refused unread (weights never travel over HTTP)
READ_TIMEOUT = 120.0  # seconds a request's connection may stay silent before the server drops it
PROCESSED = "processed_logprobs"  # the log-probs of the distribution sampled from, after temperature and filters


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


# ---- what the server samples with ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerInfo:
    """The parts of a server's ``/server_info`` the trainer relies on."""

    model: str  # the folder or hub id it loaded
    dtype: torch.dtype  # of its weights: pushed weights are sent in it
    logprobs_mode: str
    weight_transfer: str | None  # the weight-transfer backend it was started with
    workers: int  # the processes holding its weights (tensor x pipeline x data parallel)
    covey_server: bool = False  # covey server rather than vLLM's
    exact_logprobs: bool = False  # covey server in float32: the same log-probs as the trainer's forward

    @classmethod
    def from_json(cls, info: Any) -> "ServerInfo":
        try:
            config = info["vllm_config"]
            model, parallel = config["model_config"], config["parallel_config"]
            transfer = config.get("weight_transfer_config") or {}
            dtype = getattr(torch, str(model["dtype"]).removeprefix("torch."))
            workers = int(parallel["world_size"]) * int(parallel.get("data_parallel_size", 1))
            covey = info.get("covey")
            return cls(str(model["model"]), dtype, str(model["logprobs_mode"]), transfer.get("backend"), workers,
                       covey is not None, bool((covey or {}).get("exact_logprobs", False)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"the server's /server_info lacks what covey reads ({type(e).__name__}: {e}); is it "
                              "vLLM's server (a release covey is tested with) or covey server?") from None


def server_info_json(model: str, dtype: torch.dtype, weight_transfer: str, exact_logprobs: bool) -> dict[str, Any]:
    """``/server_info`` as covey server answers it: the fields ``ServerInfo`` reads, in vLLM's layout."""
    return {"vllm_config": {"model_config": {"model": model, "dtype": str(dtype), "logprobs_mode": PROCESSED},
                            "parallel_config": {"world_size": 1, "data_parallel_size": 1},
                            "weight_transfer_config": {"backend": weight_transfer}},
            "covey": {"exact_logprobs": exact_logprobs}}


# ---- completions -----------------------------------------------------------------------------------------------


def sampling_fields(params: SamplingParams, num_generations: int, eos_token_ids: list[int]) -> dict[str, Any]:
    """vLLM's sampling settings for covey's ``params`` (the fields of ``vllm.SamplingParams`` and of a
    ``/v1/completions`` body alike; seed excluded). ``logprobs=0`` returns the log-prob of the sampled
    token only; the EOS ids are stop tokens, so every id covey treats as the end also ends vLLM's
    sampling; stop strings stay in the completion, as with the fast engine; greedy is temperature 0
    (the filters would not change the argmax)."""
    fields: dict[str, Any] = dict(
        n=num_generations, max_tokens=params.max_new_tokens, repetition_penalty=params.repetition_penalty,
        stop=list(params.stop), include_stop_str_in_output=True, stop_token_ids=[int(t) for t in eos_token_ids],
        logprobs=0)
    if params.greedy:
        fields.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    else:
        fields.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p)
    return fields | dict(params.extra)


def completion_request(model: str, prompt_ids: list[int], num_generations: int, params: SamplingParams,
                       eos_token_ids: list[int], seed: int | None) -> dict[str, Any]:
    """The ``/v1/completions`` body for ``num_generations`` samples of one prompt: token ids in, token
    ids and the log-prob of each sampled token out."""
    return dict(model=model, prompt=[int(t) for t in prompt_ids], **sampling_fields(params, num_generations, eos_token_ids),
                return_token_ids=True, seed=seed, **suppressed(params))


def suppressed(params: SamplingParams) -> dict[str, Any]:
    """The tokens never sampled (a vision-language model's image tokens) as vLLM's strongest negative bias."""
    return {"logit_bias": {str(token): -100.0 for token in params.suppress}} if params.suppress else {}


GENERATE = "/inference/v1/generate"  # where a prompt with pictures is sampled


def picture_url(picture: Any) -> str:
    """A picture as a data URL of its PNG encoding: lossless, so the server's processor reads the very pixels
    the trainer's did."""
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class PictureURLs:
    """Each prompt's pictures as the data URLs sent (``picture_url``'s), encoded the first time the prompt is
    sent and kept while its ``PromptImages`` lives, which is the run: a prompt's pictures are encoded once per
    run, not once per round."""

    def __init__(self) -> None:
        self._urls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, images: Any) -> list[str]:
        """The data URLs of ``images`` (a prompt's ``PromptImages``), in order."""
        urls = self._urls.get(images)
        if urls is None:
            urls = self._urls[images] = [picture_url(picture) for picture in images.pictures]
        return urls


def generate_request(model: str, prompt_ids: list[int], picture_urls: list[str], num_generations: int,
                     params: SamplingParams, eos_token_ids: list[int], seed: int | None) -> dict[str, Any]:
    """The ``/inference/v1/generate`` body for ``num_generations`` samples of a prompt that shows pictures:
    its ids as the chat template wrote them (one placeholder per picture, which the server's processor
    expands) and its pictures in order (``picture_url``'s), in vLLM's sampling settings (those of
    ``/v1/completions``, and the tokens never sampled as the strongest negative bias)."""
    sampling = sampling_fields(params, num_generations, eos_token_ids) | {"seed": seed} | suppressed(params)
    return {"model": model, "token_ids": [int(t) for t in prompt_ids],
            "content_parts": [{"type": "image_url", "url": url} for url in picture_urls],
            "sampling_params": sampling, "output_mode": "tokens"}


def generated_choices(reply: Any) -> list[dict[str, Any]]:
    """``/inference/v1/generate``'s choices in the form of ``/v1/completions``' (what ``rollout_from_choices``
    reads): each sampled token's log-prob taken from its ``logprobs.content`` entry."""
    choices = []
    for choice in reply["choices"]:
        content = (choice.get("logprobs") or {}).get("content") or []
        ids = list(choice.get("token_ids") or [])
        if [entry["token_id"] for entry in content] != ids:
            raise ModelError("the server's log-probs do not follow its sampled tokens; it must be asked for "
                             "logprobs: 0")
        logprobs = [entry["logprob"] for entry in content]
        choices.append({**choice, "token_ids": ids, "logprobs": {"token_logprobs": logprobs}})
    return choices


def read_completion_request(body: Any) -> tuple[list[list[int]], int, SamplingParams, list[int], int | None]:
    """(prompts, n, params, stop token ids, seed) of a ``/v1/completions`` body as ``completion_request``
    writes it; anything covey server cannot honour is a ConfigError (HTTP 400) saying what."""
    if not isinstance(body, dict):
        raise ConfigError("a /v1/completions request is a JSON object")
    required = {"prompt", "max_tokens", "logprobs", "return_token_ids"}
    if missing := required - set(body):
        raise ConfigError(f"a /v1/completions request to covey server needs {', '.join(sorted(missing))}")
    known = required | {"model", "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
                        "stop_token_ids", "include_stop_str_in_output", "seed"}
    if unknown := set(body) - known:
        raise ConfigError(f"covey server does not take {', '.join(sorted(unknown))} in /v1/completions")
    if body["logprobs"] != 0 or body["return_token_ids"] is not True or body.get("include_stop_str_in_output") is False:
        raise ConfigError("covey server returns the sampled tokens' ids and log-probs, stop strings included: "
                          "send logprobs: 0, return_token_ids: true")
    prompt = body["prompt"]
    if not isinstance(prompt, list):
        raise ConfigError("prompt must be a list of token ids, or a list of them (covey server takes no text)")
    prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
    if not all(isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids) for ids in prompts):
        raise ConfigError("prompt must be a non-empty list of token ids (ints >= 0), or a list of them")
    n, seed, stop_ids = body.get("n", 1), body.get("seed"), body.get("stop_token_ids") or []
    if not (isinstance(n, int) and n >= 1) or not (seed is None or isinstance(seed, int)):
        raise ConfigError(f"n must be an int >= 1 (got {n!r}) and seed an int or null (got {seed!r})")
    if not (isinstance(stop_ids, list) and all(isinstance(t, int) for t in stop_ids)):
        raise ConfigError("stop_token_ids must be a list of token ids")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop  # one stop string, or a list of them (as OpenAI's API)
    try:
        temperature = float(body.get("temperature", 1.0))
        if temperature < 0:
            raise ValueError(f"temperature={temperature} is negative")
        params = SamplingParams(
            max_new_tokens=int(body["max_tokens"]), temperature=temperature if temperature > 0 else 1.0,
            top_p=float(body.get("top_p", 1.0)), top_k=max(int(body.get("top_k", 0)), 0),
            min_p=float(body.get("min_p", 0.0)), repetition_penalty=float(body.get("repetition_penalty", 1.0)),
            stop=tuple(str(s) for s in stop), greedy=temperature == 0)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"unreadable sampling settings ({e})") from None
    return prompts, n, params, stop_ids, seed


def finish_reason(reason: str | None, stop_reason: Any) -> str:
    """covey's finish reason for vLLM's: "stop" is an EOS token (``stop_reason`` None or its id) or a
    stop string (``stop_reason`` the string)."""
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"
    raise ModelError(f"the server ended a completion with finish_reason={reason!r} (stop_reason={stop_reason!r}); "
                     "only 'stop' and 'length' are expected")


def completion_choices(rollout: Rollout, stop: tuple[str, ...], eos_id: int, decode) -> list[dict[str, Any]]:
    """``rollout``'s rows as ``/v1/completions`` choices (index i * n + j for sample j of prompt i)."""
    choices = []
    for row, reason in enumerate(rollout.finish_reasons):
        n = int(rollout.lengths_B[row])
        ids = rollout.completion_ids_BT[row, :n].tolist()
        text = decode(ids)
        stop_reason = (next((s for s in stop if text.endswith(s)), stop[0] if stop else None) if reason == "stop"
                       else eos_id if reason == "eos" else None)
        choices.append({"index": row, "text": text, "token_ids": ids,
                        "logprobs": {"token_logprobs": rollout.sampling_logp_BT[row, :n].tolist()},
                        "finish_reason": "length" if reason == "length" else "stop", "stop_reason": stop_reason})
    return choices


def rollout_from_choices(per_prompt: list[list[dict[str, Any]]], num_generations: int, pad_token_id: int) -> Rollout:
    """A ``Rollout`` from each prompt's ``/v1/completions`` choices, in prompt then sample order, padded
    to the longest completion. float32 log-probs survive JSON exactly (each is written as the shortest
    decimal that reads back to it)."""
    rows = []
    for choices in per_prompt:
        if len(choices) != num_generations:
            raise ModelError(f"the server returned {len(choices)} completions for a prompt, expected "
                             f"num_generations={num_generations}")
        rows.extend(sorted(choices, key=lambda c: c["index"]))
    ids, logps = [list(c["token_ids"]) for c in rows], [(c.get("logprobs") or {}).get("token_logprobs") for c in rows]
    if any(lp is None or len(lp) != len(row) or None in lp for lp, row in zip(logps, ids)):
        raise ModelError("the server returned no log-prob for some sampled tokens; it must be asked for logprobs: 0")
    reasons = [finish_reason(c.get("finish_reason"), c.get("stop_reason")) for c in rows]
    return padded_rollout(ids, [[1] * len(row) for row in ids], logps, reasons, pad_token_id)
