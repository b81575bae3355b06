"""``covey server``: a rollout engine in its own process, reached over HTTP (``vllm_mode: server``).

The server hosts one backend: vLLM (on the GPU it was started on) or covey's ``fast`` engine over
a model it loaded (any machine; what the tests use). The trainer talks to it through
``ServerEngine``, a rollout engine like any other, and pushes the policy's weights after every
optimizer step. Plain HTTP and JSON from the standard library; weights travel as safetensors bytes.
When ``COVEY_SERVER_TOKEN`` is set in the server's environment, every request must carry the same
value (``Authorization: Bearer <token>``; the client sends its own environment's), or is refused
with HTTP 401 before its body is read.

The endpoints and what travels over them: ``covey.rollout.wire``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Protocol

import torch

from covey.errors import ConfigError, CoveyError, ModelError
from covey.rollout.engine import Rollout, SamplingParams
from covey.rollout.fast import FastEngine
from covey.rollout.wire import (MAX_REQUEST_BYTES, READ_TIMEOUT, TOKEN_VARIABLE, http_url, is_loopback, params_from_json,
                                rollout_to_json, server_token)


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


def run_server(load_backend: Callable[[], Backend], serving: str, host: str, port: int, insecure: bool = False) -> int:
    """``covey server``: serve the backend ``load_backend`` gives (``serving`` says what it is) until
    interrupted. Beyond this machine only with a token, or ``insecure``."""
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
    server.backend = load_backend()
    print(f"covey server: {serving} at {server.url} "
          f"(vllm_mode: server trainers connect here{'; token required' if token else ''}; Ctrl-C stops it)",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
