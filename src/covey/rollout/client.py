"""``ServerEngine``: the rollout engine of ``vllm_mode: server``. It samples from ``vllm serve`` (or
``covey server``) through vLLM's HTTP API and pushes the policy's weights over the server's
weight-transfer backend (``covey.rollout.wire`` lists the endpoints)."""

from __future__ import annotations

import importlib.util
import json
import secrets
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import torch

from covey.errors import ConfigError, CoveyError, ModelError, warn
from covey.models import policy_weights
from covey.rollout.engine import EngineSettings, OwnWeights, Rollout, SamplingParams, greedy_once
from covey.rollout.vllm_engine import request_seeds, version_problem
from covey.rollout.weight_transfer import SENDERS, Sender
from covey.rollout.wire import (GENERATE, PROCESSED, REQUEST_TIMEOUT, TOKEN_VARIABLE, ServerInfo, completion_request,
                                PictureURLs, generate_request, generated_choices, http_url, is_loopback,
                                rollout_from_choices, server_token)
from covey.vision import images_of


class SampleRequest(NamedTuple):
    """One prompt's request to the server: where it goes, what it says, and what reads the reply's choices."""
    path: str
    body: dict[str, Any]
    read_choices: Callable[[dict], list]


START_HINT = ("start it with `covey server CONFIG --backend vllm` (vllm serve with the flags covey needs) or as "
              "docs/vllm.md shows")


class ServerLost(ModelError):
    """The server did not answer a request: it stopped, or the connection to it broke."""


class ServerAPI:
    """vLLM's HTTP API at ``url``, the endpoints the trainer uses; also what vLLM's trainer-side
    weight-transfer engines drive (``init_weight_transfer_engine`` ... ``finish_weight_update``)."""

    def __init__(self, url: str, token: str | None = None):
        self.url = url
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        # the server is reached directly, never through an HTTP proxy from the environment
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get(self, path: str, timeout: float = REQUEST_TIMEOUT) -> Any:
        return self._call(urllib.request.Request(self.url + path, headers=self.auth), path, timeout)

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT) -> Any:
        request = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                         headers={"Content-Type": "application/json", **self.auth})
        return self._call(request, path, timeout)

    def _call(self, request: urllib.request.Request, path: str, timeout: float) -> Any:
        try:
            with self.opener.open(request, timeout=timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as e:
            raise _http_error(self.url, path, e) from None
        except (urllib.error.URLError, OSError) as e:
            raise ServerLost(f"lost the server at {self.url} on {path} ({getattr(e, 'reason', e)}); is it still "
                             "running? Its own output says why it stopped") from None
        try:
            return json.loads(body) if body else None
        except ValueError:
            raise ConfigError(f"{self.url}{path} answered with something other than JSON ({body[:80]!r}): is it a "
                              "vLLM or covey server?") from None

    # the trainer-side control plane of vLLM's weight transfer (its VLLMWeightSyncClient)
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.post("/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("/finish_weight_update", {"weight_version": weight_version})


def _http_error(url: str, path: str, e: urllib.error.HTTPError) -> CoveyError:
    try:
        payload = json.loads(e.read())
    except ValueError:
        payload = {}
    detail = payload.get("error") or payload.get("message") or payload.get("detail") or f"{e.code} {e.reason}"
    if isinstance(detail, dict):
        detail = detail.get("message", detail)
    if e.code == 401:
        return ConfigError(f"the server at {url} refused this trainer (HTTP 401): set {TOKEN_VARIABLE} in the "
                           "trainer's environment to the server's token (covey server's, or vllm serve's --api-key)")
    if e.code in (403, 404) and path == GENERATE:
        return ConfigError(f"the server at {url} does not sample prompts with pictures ({detail}): start vLLM's "
                           f"server with --enable-scale-out (`covey server CONFIG --backend vllm` does)")
    if e.code == 404 and path in ("/server_info?config_format=json", "/weight_info"):
        return ConfigError(f"the server at {url} has no {path.split('?')[0]} endpoint: vLLM serves its RL endpoints "
                           "only when started with VLLM_SERVER_DEV_MODE=1; " + START_HINT)
    kind = ConfigError if 400 <= e.code < 500 else ModelError
    return kind(f"the server at {url}{path} answered HTTP {e.code}: {detail}")


def reachable_address(host: str, port: int) -> str:
    """This machine's address as seen from ``host``: where the server's workers reach the trainer's
    weight-transfer group (the interface the route to ``host`` leaves by)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # a datagram socket sends nothing: this only picks the route
            return probe.getsockname()[0]
    except OSError:
        if is_loopback(host):
            return "127.0.0.1"
        raise ModelError(f"no route from this machine to the server's host {host}: its workers could not reach the "
                         "trainer's weight-transfer group; check vllm_server_host") from None


# the weight_version of a server that has taken no push (covey server's, vLLM's)
STARTUP_VERSIONS = (None, "default")


class ServerEngine(OwnWeights):
    """A rollout engine that samples from a vLLM server (``vllm serve``, or ``covey server``).

    ``policy``: the training model; its weights are pushed before the first ``generate``, so the
    server samples from exactly the trainer's policy whatever it loaded at start. Each push is named
    (the server's ``weight_version``): before sampling, the engine checks that the server still holds
    the push it made, and a server that restarted gets the policy again. Several training processes
    share one server (``shared_by_processes``): the first pushes, the others are told the version it
    pushed (``follow_pushes``) and check for it. A server lost during a generation (killed, restarted)
    is waited for, up to ``timeout`` seconds; once it answers again it is given the policy again and
    the round is sampled again, with the same seeds."""

    LOSSES_PER_GENERATION = 3  # a server lost more often in one generation is crashing: the run stops

    shared_by_processes = True

    def __init__(self, host: str, port: int, pad_token_id: int, eos_token_ids: list[int], timeout: float = 240.0,
                 policy: torch.nn.Module | None = None, group_port: int = 0, token: str | None = None):
        self.url = http_url(host, port)
        self.host, self.port, self.group_port = host, port, group_port
        self.api = ServerAPI(self.url, token or server_token())
        self.pad_token_id, self.eos_token_ids = pad_token_id, eos_token_ids
        self.timeout = timeout
        self._wait_for_health(timeout)
        self.info = self._server_info()
        self.exact_logprobs = self.info.exact_logprobs
        self.model_name = self.api.get("/v1/models")["data"][0]["id"]
        self.sender: Sender | None = None  # the weight-transfer group, opened at the first push
        self.run_tag = secrets.token_hex(4)  # names this trainer's pushes
        self.pushes_made = 0
        self.pushed_version: str | None = None  # the version the server must hold (None: nothing pushed yet)
        self.unsynced_policy = policy
        self.policy = policy  # the weights the server must hold, pushed again if it restarts
        self.pushes = True
        self.encoded_pictures = PictureURLs()  # each prompt's pictures, encoded once for the run

    @classmethod
    def build(cls, settings: EngineSettings, policy: torch.nn.Module, tokenizer, eos_token_ids: list[int]) -> "ServerEngine":
        return cls(settings.server_host, settings.server_port, tokenizer.pad_token_id, eos_token_ids,
                   settings.server_timeout, policy, settings.group_port)

    # ---- sampling ------------------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout:
        losses = 0
        while True:
            try:
                return self._generate(prompt_ids, num_generations, params, seed)
            except ServerLost as lost:
                losses += 1
                if losses == self.LOSSES_PER_GENERATION:
                    raise ModelError(f"{lost}. It was lost {losses} times during one generation: is it crashing? "
                                     "Restart it, then resume the run from its last checkpoint "
                                     "(--resume-from-checkpoint auto)") from None
                self._wait_for_return(lost)

    def _wait_for_return(self, lost: ServerLost) -> None:
        """Wait up to ``timeout`` seconds for a lost server to answer again; it has lost the transfer group."""
        warn(f"{lost}; waiting up to {self.timeout:g} s (vllm_server_timeout) for it to answer again, "
                      "then the policy is pushed to it again and the round sampled again", RuntimeWarning, stacklevel=3)
        self.sender = None
        try:
            self._wait_for_health(self.timeout)
        except ConfigError:
            raise ModelError(f"{lost}, and it did not answer again within {self.timeout:g} s (vllm_server_timeout). "
                             "Restart it, then resume the run from its last checkpoint (--resume-from-checkpoint "
                             "auto)") from None

    def _generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                  seed: int | None) -> Rollout:
        if self.pushes:
            self._push_if_stale()
        self._check_weights()
        urls = self._picture_urls(prompt_ids)

        def sample(n: int) -> Rollout:
            requests = [self._request(ids, urls, n, params, s)
                        for ids, s in zip(prompt_ids, request_seeds(seed, len(prompt_ids)))]
            # one request per prompt, each with its own seed (as the in-process vLLM engine samples); the
            # server batches the requests in flight together
            with ThreadPoolExecutor(max_workers=min(len(requests), 64)) as pool:
                choices = list(pool.map(lambda r: r.read_choices(self.api.post(r.path, r.body)), requests))
            return rollout_from_choices(choices, n, self.pad_token_id)

        rollout = greedy_once(sample, num_generations, params)
        if self._check_weights():  # it restarted meanwhile, sampling with its start-up weights: sampled again
            rollout = greedy_once(sample, num_generations, params)
            if self._check_weights():
                raise ModelError(f"the server at {self.url} restarted twice during one generation; is it crashing? "
                                 "Its own output says why")
        return rollout

    @property
    def takes_images(self) -> bool:
        """Whether prompts with pictures can be sampled: vLLM's server reads them, covey server text only."""
        return not self.info.covey_server

    def _picture_urls(self, prompt_ids: list[list[int]]) -> dict[int, list[str]]:
        """Each distinct prompt's pictures (by the identity of its ``PromptImages``) as the data URLs sent, encoded
        at the prompt's first round only."""
        urls: dict[int, list[str]] = {}
        for ids in prompt_ids:
            images = images_of(ids)
            if images is None or id(images) in urls:
                continue
            if not self.takes_images:
                raise ConfigError(f"the prompts show pictures, and the server at {self.url} is covey server, whose "
                                  "fast engine reads token ids only: start the server with --backend vllm")
            urls[id(images)] = self.encoded_pictures(images)
        return urls

    def _request(self, ids: list[int], urls: dict[int, list[str]], n: int, params: SamplingParams,
                 seed: int | None) -> "SampleRequest":
        """The request of one prompt's samples: its token ids to
        /v1/completions, or with its pictures (the chat template's ids, each picture one placeholder that the
        server's processor expands) to /inference/v1/generate."""
        images = images_of(ids)
        if images is None:
            return SampleRequest("/v1/completions",
                                 completion_request(self.model_name, ids, n, params, self.eos_token_ids, seed),
                                 lambda reply: reply["choices"])
        body = generate_request(self.model_name, images.unexpanded(list(ids)), urls[id(images)], n, params,
                                self.eos_token_ids, seed)
        return SampleRequest(GENERATE, body, generated_choices)

    def _check_weights(self) -> bool:
        """The server holds the last push, or is given it again when it restarted (by the pushing process:
        then True); a server a push left half-updated is never sampled from."""
        held = self.api.get("/weight_info").get("weight_version")
        if held is not None and str(held).endswith("-incomplete"):
            raise ModelError(f"the server at {self.url} holds a partly updated model (weight_version {held!r}): a "
                             "push to it failed midway. Restart the server, then resume the run from its last "
                             "checkpoint (--resume-from-checkpoint auto)")
        if self.pushed_version is None or held == self.pushed_version:
            return False
        if not self.pushes:
            raise ModelError(f"the server at {self.url} holds weight_version {held!r}, not {self.pushed_version!r} "
                             "that the first training process pushed: it restarted, or another trainer pushes to "
                             "it. The run stops here: resume it from its last checkpoint (--resume-from-checkpoint auto)")
        if held not in STARTUP_VERSIONS:
            raise ModelError(f"the server at {self.url} holds weight_version {held!r}, not this run's "
                             f"{self.pushed_version!r}: is another trainer pushing to it? Give each run its own server")
        # restarted with its start-up weights: a new transfer group, and the policy again
        self.sender = None
        self.push_policy(self.policy)
        return True

    # ---- pushing the policy ----------------------------------------------------------------------------------

    def policy_changed(self, model: torch.nn.Module) -> None:
        super().policy_changed(model)
        self.policy = model

    def push_policy(self, model: torch.nn.Module) -> str | None:
        super().push_policy(model)
        return self.pushed_version

    def follow_pushes(self, holder: str | None) -> None:
        super().follow_pushes(holder)
        self.pushes, self.pushed_version = False, holder

    def _push_weights(self, model: torch.nn.Module) -> None:
        """Pause the server, name the push as incomplete, send every weight, name it done, resume.
        A push that fails midway leaves the server paused and its version saying so."""
        weights = [(name, tensor.detach().to(self.info.dtype) if tensor.is_floating_point() else tensor.detach())
                   for name, tensor in policy_weights(model, tied_copy=True)]
        if self.sender is None:
            self.sender = self._open_sender()
        version = f"covey-{self.run_tag}-{self.pushes_made + 1}"
        self.api.post("/pause?mode=wait")
        self.api.post("/update_weight_version", {"new_version": f"{version}-incomplete"})
        try:
            self.sender.send(weights)
        except Exception as e:
            self.sender = None
            if not self._answers():  # it died under the push: waited for like any server lost
                raise ServerLost(f"lost the server at {self.url} while pushing the policy to it ({e})") from e
            raise ModelError(f"pushing the policy to the server at {self.url} failed midway ({e}). The server is "
                             f"left paused, holding a partly updated model named {version}-incomplete, so nothing "
                             "samples from it unknowingly: restart it, then resume the run from its last checkpoint "
                             "(--resume-from-checkpoint auto)") from e
        self.api.post("/update_weight_version", {"new_version": version})
        self.api.post("/resume")
        self.policy, self.pushed_version, self.pushes_made = model, version, self.pushes_made + 1

    def _answers(self) -> bool:
        try:
            self.api.get("/health", timeout=5.0)
        except ModelError:
            return False
        return True

    def _open_sender(self) -> Sender:
        backend = self.info.weight_transfer
        if backend not in SENDERS:
            raise ConfigError(f"the server at {self.url} was started with the weight-transfer backend {backend!r}; "
                              f"covey pushes weights with {' or '.join(SENDERS)}: start vllm serve with "
                              "--weight-transfer-config '{\"backend\": \"nccl\"}' on GPUs, or '{\"backend\": "
                              "\"covey_gloo\"}' elsewhere")
        address = reachable_address(self.host, self.port)
        return SENDERS[backend].open(self.api, address, self.group_port, 1 + self.info.workers)

    # ---- connecting ---------------------------------------------------------------------------------------------

    def _wait_for_health(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.api.get("/health", timeout=max(1.0, min(10.0, timeout)))
                return
            except ModelError as e:
                if "HTTP" in str(e):
                    raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConfigError(
                    f"no server answered at {self.url} within {timeout:g} s (vllm_mode: server): {START_HINT}; raise "
                    "vllm_server_timeout if it is still loading, check vllm_server_host and vllm_server_port, or use "
                    "vllm_mode: colocate / rollout_engine: fast")
            time.sleep(min(1.0, remaining))

    def _server_info(self) -> ServerInfo:
        info = ServerInfo.from_json(self.api.get("/server_info?config_format=json"))
        if not info.covey_server:
            version = (self.api.get("/version") or {}).get("version", "unknown")
            if problem := version_problem(str(version)):
                raise ConfigError(f"the server at {self.url}: {problem}")
        if info.weight_transfer == "nccl" and not (torch.cuda.is_available() and importlib.util.find_spec("vllm")):
            raise ConfigError(f"the server at {self.url} takes weights over NCCL, which needs a CUDA GPU and vLLM in "
                              "the trainer's environment too; install vLLM here, or start the server with "
                              "--weight-transfer-config '{\"backend\": \"covey_gloo\"}' (covey installed beside it)")
        if info.logprobs_mode != PROCESSED:
            raise ConfigError(f"the server at {self.url} returns {info.logprobs_mode} log-probs; covey's importance "
                              f"correction needs those of the distribution it sampled from: start it with "
                              f"--logprobs-mode {PROCESSED}")
        return info
