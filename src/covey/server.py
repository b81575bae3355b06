"""``covey server``: a rollout engine in its own process, reached over HTTP (``vllm_mode: server``).

The server hosts one backend: vLLM (on the GPU it was started on) or covey's ``fast`` engine over
a model it loaded (any machine; what the tests use). The trainer talks to it through
``ServerEngine``, a rollout engine like any other, and pushes the policy's weights after every
optimizer step. Plain HTTP and JSON from the standard library; weights travel as safetensors bytes.
When ``COVEY_SERVER_TOKEN`` is set in the server's environment, every request must carry the same
value (``Authorization: Bearer <token>``; the client sends its own environment's), or is refused
with HTTP 401 before its body is read.

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
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Iterator, Protocol

import torch

from covey import errors
from covey.core import length_mask
from covey.config import GRPOConfig
from covey.errors import ConfigError, CoveyError, ModelError
from covey.rollout import OwnWeights, Rollout, SamplingParams
from covey.models import policy_weights

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


class Backend(Protocol):
    """What the server needs of the engine it hosts: sampling, and loading pushed weights."""

    name: str  # "vllm" or "fast"
    exact_logprobs: bool
    weight_dtype: str  # the dtype the client should send weights in

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def finish_weight_update(self) -> None: ...


class FastBackend:
    """covey's fast engine over a model held by the server."""

    name = "fast"

    def __init__(self, model: torch.nn.Module, tokenizer, eos_token_ids: list[int], bf16: bool = False):
        from covey.fast_rollout import FastEngine

        self.model = model
        self.engine = FastEngine(model, tokenizer.pad_token_id, eos_token_ids, tokenizer, bf16)
        self.exact_logprobs = self.engine.exact_logprobs
        self.weight_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout:
        return self.engine.generate(prompt_ids, num_generations, params, seed)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy the named tensors into the model; all are checked before any is copied."""
        params = dict(self.model.named_parameters())
        weights = list(weights)
        for name, tensor in weights:
            if name not in params:
                raise ModelError(f"the server's model has no weight {name!r}; start the server with the trainer's "
                                 "model (the same `model` in the config)")
            if params[name].shape != tensor.shape:
                raise ModelError(f"weight {name!r} has shape {tuple(tensor.shape)} but the server's model expects "
                                 f"{tuple(params[name].shape)}; start the server with the trainer's model")
        for name, tensor in weights:
            params[name].copy_(tensor)
        return len(weights)

    def finish_weight_update(self) -> None:
        """Nothing is cached across calls."""


# ---- wire format -----------------------------------------------------------------------------------


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


# ---- the server --------------------------------------------------------------------------------------


class RolloutServer(ThreadingHTTPServer):
    """HTTP front of one backend. Requests are served one at a time (a lock), so weights never
    change in the middle of a generation. ``token``: when given, requests without it are refused."""

    daemon_threads = True

    def __init__(self, backend: Backend | None, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        self.backend = backend  # None until set: the port can be taken before a slow backend loads
        self.token = token
        self.instance = secrets.token_hex(8)
        self.lock = threading.Lock()
        self.weights_loaded = 0  # since the last /weights/done
        if ":" in host:
            self.address_family = socket.AF_INET6
        try:
            super().__init__((host, port), _Handler)
        except OSError as e:
            raise ConfigError(f"covey server cannot listen on {host} port {port}: {e.strerror or e}; choose another "
                              "--port (or --host), or stop what is using it") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return http_url(host, port)

    def start(self) -> "RolloutServer":
        """Serve from a background thread (in-process use, e.g. tests); ``close`` stops it."""
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()

    def health(self) -> dict[str, Any]:
        return {"backend": self.backend.name, "exact_logprobs": self.backend.exact_logprobs,
                "weight_dtype": self.backend.weight_dtype, "instance": self.instance}

    def generate(self, request: Any) -> dict[str, Any]:
        prompt_ids, num_generations, params, seed = _generate_request(request)
        rollout = self.backend.generate(prompt_ids, num_generations, params, seed)
        return {**rollout_to_json(rollout, self.backend.exact_logprobs), "instance": self.instance}

    def load_weights(self, body: bytes) -> dict[str, Any]:
        from safetensors.torch import load

        count = self.backend.load_weights(load(body).items())
        self.weights_loaded += count
        return {"tensors": count, "sha256": hashlib.sha256(body).hexdigest()}

    def finish_weights(self) -> dict[str, Any]:
        self.backend.finish_weight_update()
        loaded, self.weights_loaded = self.weights_loaded, 0
        return {"tensors": loaded, "instance": self.instance}


def _generate_request(request: Any) -> tuple[list[list[int]], int, SamplingParams, int | None]:
    """The fields of a /generate request, checked: a ConfigError (HTTP 400) says what is wrong."""
    if not isinstance(request, dict) or not {"prompt_ids", "num_generations", "params"} <= set(request):
        raise ConfigError("a /generate request is a JSON object with prompt_ids, num_generations and params")
    prompt_ids, n, seed = request["prompt_ids"], request["num_generations"], request.get("seed")
    if not (isinstance(prompt_ids, list) and prompt_ids and all(
            isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids) for ids in prompt_ids)):
        raise ConfigError("prompt_ids must be a non-empty list of non-empty lists of token ids (ints >= 0)")
    if not (isinstance(n, int) and n >= 1) or not (seed is None or isinstance(seed, int)):
        raise ConfigError(f"num_generations must be an int >= 1 (got {n!r}) and seed an int or null (got {seed!r})")
    if not isinstance(request["params"], dict):
        raise ConfigError("params must be a JSON object of sampling settings")
    return prompt_ids, n, params_from_json(request["params"]), seed


class _Handler(BaseHTTPRequestHandler):
    server: RolloutServer
    timeout = READ_TIMEOUT  # a client that stops sending mid-request does not hold a thread forever

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/health":
            self._reply(200, self.server.health())
        else:
            self._reply(404, {"error": f"no endpoint GET {self.path}", "kind": "ConfigError"})

    def do_POST(self) -> None:
        if not self._authorized():
            return
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit() or int(length) > MAX_REQUEST_BYTES:
            self.close_connection = True
            self._reply(400 if not length.isdigit() else 413,
                        {"error": f"Content-Length {length!r} is not a size up to {MAX_REQUEST_BYTES} bytes",
                         "kind": "ConfigError"})
            return
        body = self.rfile.read(int(length))
        routes = {"/generate": lambda: self.server.generate(_json(body)),
                  "/weights": lambda: self.server.load_weights(body),
                  "/weights/done": self.server.finish_weights}
        if self.path not in routes:
            self._reply(404, {"error": f"no endpoint POST {self.path}", "kind": "ConfigError"})
            return
        try:
            with self.server.lock:
                reply = routes[self.path]()
        except CoveyError as e:
            self._reply(400, {"error": str(e), "kind": type(e).__name__})
        except Exception as e:  # reported to the client, and in full here
            traceback.print_exc()
            self._reply(500, {"error": f"{type(e).__name__}: {e}", "kind": "ModelError"})
        else:
            self._reply(200, reply)

    def _authorized(self) -> bool:
        """Whether the request carries the server's token (always, when it has none); if not, it is
        answered 401 and the connection closed, its body unread."""
        token = self.server.token
        if token is None or hmac.compare_digest(self.headers.get("Authorization", "").encode(),
                                                f"Bearer {token}".encode()):
            return True
        self.close_connection = True
        self._reply(401, {"error": f"the request does not carry this server's {TOKEN_VARIABLE}; set the same "
                                   f"{TOKEN_VARIABLE} in the trainer's environment as in the server's",
                          "kind": "ConfigError"})
        return False

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """One line per request would drown the server's own output."""


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as e:
        raise ConfigError(f"the request body is not JSON ({e})") from None


def build_backend(args: GRPOConfig, name: str) -> Backend:
    """The backend ``covey server`` hosts for a run's config."""
    from covey.export import merged_model
    from covey.models import eos_token_ids, load_policy, load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    if name == "vllm":
        from transformers import GenerationConfig

        from covey.vllm_engine import VLLMEngine

        path = resolve_model_path(args.model)
        args.check_vllm_seed()
        if (Path(path) / "adapter_config.json").is_file():
            raise ConfigError(f"{path} is a LoRA adapter, which vLLM cannot load as a model; start the server with "
                              "the adapter's base model as `model` (the trainer pushes the merged weights)")
        try:
            generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # a folder without generation_config.json: the tokenizer's EOS alone
            generation_config = None
        # no transformers model is loaded here: the EOS ids come from the folder's generation config
        eos = eos_token_ids(SimpleNamespace(generation_config=generation_config), tokenizer)
        return VLLMEngine(args, tokenizer.pad_token_id, eos, model_path=path)
    if name == "fast":
        # a saved adapter is merged: the server holds plain weights, as the trainer pushes them
        model = merged_model(load_policy(args.model, args.trust_remote_code))
        return FastBackend(model.eval(), tokenizer, eos_token_ids(model, tokenizer),
                           args.sample_in_bf16(next(model.parameters()).device))
    raise ConfigError(f"server backend {name!r} is not one of vllm, fast")


def run_server(args: GRPOConfig, backend_name: str, host: str, port: int, insecure: bool = False) -> int:
    """``covey server``: serve until interrupted. Beyond this machine only with a token, or ``insecure``."""
    token = server_token()
    if token is None and not is_loopback(host):
        if not insecure:
            raise ConfigError(f"covey server refuses to listen on {host} without {TOKEN_VARIABLE}: anyone who can "
                              f"reach the port could replace the model's weights. Set {TOKEN_VARIABLE} to a secret in "
                              "the environments of the server and of its trainers (or pass --insecure on a network "
                              "only you use)")
        print(f"covey server: warning: listening on {host} without {TOKEN_VARIABLE} (--insecure): anyone who can "
              "reach this port can replace the model's weights", file=sys.stderr, flush=True)
    server = RolloutServer(None, host, port, token)  # the port first: a taken one is known before the model loads
    server.backend = build_backend(args, backend_name)
    print(f"covey server: {backend_name} backend for {args.model} at {server.url} "
          f"(vllm_mode: server trainers connect here{'; token required' if token else ''}; Ctrl-C stops it)",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


# ---- the client ---------------------------------------------------------------------------------------


class ServerEngine(OwnWeights):
    """A rollout engine that forwards to a ``covey server``.

    ``policy``: the training model; its weights are pushed before the first ``generate`` so the
    server samples from exactly the trainer's policy, whatever it loaded at start. ``token``: the
    server's (default: ``COVEY_SERVER_TOKEN`` from the environment). ``pushes``: False in every
    process but the first of several sharing the server, which sample from what the first pushes
    (the trainer tells them which server instance holds it, ``pushed_to``)."""

    def __init__(self, host: str, port: int, pad_token_id: int, timeout: float = 240.0,
                 policy: torch.nn.Module | None = None, chunk_bytes: int = CHUNK_BYTES, token: str | None = None):
        self.url = http_url(host, port)
        token = token or server_token()
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.pad_token_id = pad_token_id
        self.chunk_bytes = chunk_bytes
        # the server is reached directly, never through an HTTP proxy from the environment
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        info = self._wait_for_health(timeout)
        self.exact_logprobs = bool(info["exact_logprobs"])
        self.weight_dtype = getattr(torch, info["weight_dtype"])
        self.unsynced_policy = policy
        self.policy = policy  # the weights the server must hold, pushed again if it restarts
        self.pushed_to: str | None = None  # the server instance that holds the last push
        self.pushes = True

    @classmethod
    def from_config(cls, args: GRPOConfig, pad_token_id: int, policy: torch.nn.Module | None = None) -> "ServerEngine":
        return cls(args.vllm_server_host, args.vllm_server_port, pad_token_id, args.vllm_server_timeout, policy)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout:
        if self.pushes:
            self._push_if_stale()
        request = json.dumps({"prompt_ids": [list(map(int, ids)) for ids in prompt_ids],
                              "num_generations": num_generations, "params": params_to_json(params), "seed": seed})
        reply = self._post("/generate", request.encode(), "application/json")
        if self.policy is not None and reply.get("instance") != self.pushed_to:
            # restarted since the last push: it sampled with its start-up weights, not the policy's
            if not self.pushes:
                raise ModelError(f"the covey server at {self.url} restarted during the run; with several training "
                                 "processes only the first pushes the policy to it, so the run stops here: resume "
                                 "it from its last checkpoint (--resume-from-checkpoint auto)")
            self.sync_weights(self.policy)
            reply = self._post("/generate", request.encode(), "application/json")
            if reply.get("instance") != self.pushed_to:
                raise ModelError(f"the covey server at {self.url} restarted again while the policy was pushed to it; "
                                 "is something restarting it? Its own output says why it stopped")
        self.exact_logprobs = bool(reply["exact_logprobs"])
        return rollout_from_json(reply, self.pad_token_id)

    def policy_changed(self, model: torch.nn.Module) -> None:
        super().policy_changed(model)
        self.policy = model

    def _push_weights(self, model: torch.nn.Module) -> None:
        """Send the weights in chunks, checking each request's tensor count and checksum."""
        from safetensors.torch import save

        sent = 0
        for chunk in weight_chunks(policy_weights(model, tied_copy=True), self.weight_dtype, self.chunk_bytes):
            data = save(chunk)
            reply = self._post("/weights", data, "application/octet-stream")
            if reply["tensors"] != len(chunk) or reply["sha256"] != hashlib.sha256(data).hexdigest():
                raise ModelError(f"the covey server at {self.url} loaded {reply['tensors']} of {len(chunk)} pushed "
                                 "tensors or received different bytes; restart it and the run")
            sent += len(chunk)
        reply = self._post("/weights/done", b"{}", "application/json")
        if reply["tensors"] != sent:
            raise ModelError(f"the covey server at {self.url} loaded {reply['tensors']} tensors of the {sent} pushed; "
                             "is another trainer pushing to the same server, or did it restart meanwhile?")
        self.policy, self.pushed_to = model, reply.get("instance")

    def _wait_for_health(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                request = urllib.request.Request(self.url + "/health", headers=self.auth)
                with self.opener.open(request, timeout=max(1.0, min(10.0, timeout))) as response:
                    body = response.read()
                try:
                    info = json.loads(body)
                except ValueError:
                    info = None
                if not (isinstance(info, dict) and {"exact_logprobs", "weight_dtype"} <= set(info)):
                    raise ConfigError(f"{self.url} answered /health, but not as a covey server does ({body[:80]!r}): "
                                      "is it TRL's vllm-serve or vLLM's own server? Start `covey server CONFIG` "
                                      "there, or check vllm_server_host and vllm_server_port")
                return info
            except urllib.error.HTTPError as e:
                if e.code == 401:
                    raise ConfigError(f"the covey server at {self.url} refused this trainer (HTTP 401): set the same "
                                      f"{TOKEN_VARIABLE} in the trainer's environment as in the server's") from None
                raise ConfigError(f"{self.url} answered /health with HTTP {e.code}: it is not a covey server; "
                                  "check vllm_server_host and vllm_server_port") from None
            except (urllib.error.URLError, OSError):
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConfigError(
                    f"no covey server answered at {self.url} within {timeout:g} s (vllm_mode: server). Start one "
                    "on the GPU machine with `covey server CONFIG` (the run's config file; it listens on "
                    "vllm_server_host:vllm_server_port), raise vllm_server_timeout if it is still loading, or use "
                    "vllm_mode: colocate / rollout_engine: fast")
            time.sleep(min(1.0, remaining))

    def _post(self, path: str, data: bytes, content_type: str) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=data, method="POST",
                                         headers={"Content-Type": content_type, **self.auth})
        try:
            with self.opener.open(request, timeout=REQUEST_TIMEOUT) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            try:
                payload = json.loads(e.read())
            except ValueError:
                payload = {"error": f"HTTP {e.code} {e.reason}"}
            kind = getattr(errors, str(payload.get("kind")), ModelError)
            kind = kind if isinstance(kind, type) and issubclass(kind, CoveyError) else ModelError
            raise kind(f"covey server at {self.url}{path}: {payload.get('error')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ModelError(f"lost the covey server at {self.url} on {path} ({getattr(e, 'reason', e)}); "
                             "is it still running? Its own output says why it stopped") from None
