"""``ServerEngine``: the rollout engine of ``vllm_mode: server``, which forwards to a ``covey server``
over HTTP and pushes the policy's weights to it (``covey.rollout.wire`` says what travels)."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from typing import Any

import torch

from covey import errors
from covey.errors import ConfigError, CoveyError, ModelError
from covey.models import policy_weights
from covey.rollout.engine import EngineSettings, OwnWeights, Rollout, SamplingParams
from covey.rollout.wire import (CHUNK_BYTES, REQUEST_TIMEOUT, TOKEN_VARIABLE, http_url, params_to_json,
                                rollout_from_json, server_token, weight_chunks)


class ServerEngine(OwnWeights):
    """A rollout engine that forwards to a ``covey server``.

    ``policy``: the training model; its weights are pushed before the first ``generate`` so the
    server samples from exactly the trainer's policy, whatever it loaded at start. ``token``: the
    server's (default: ``COVEY_SERVER_TOKEN`` from the environment). Several training processes share
    one server (``shared_by_processes``): the first pushes the policy to it, and the others, told
    which server instance holds it (``follow_pushes``), never push."""

    shared_by_processes = True

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
    def build(cls, settings: EngineSettings, policy: torch.nn.Module, tokenizer, eos_token_ids: list[int]) -> "ServerEngine":
        return cls(settings.server_host, settings.server_port, tokenizer.pad_token_id, settings.server_timeout, policy)

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
            self.push_policy(self.policy)
            reply = self._post("/generate", request.encode(), "application/json")
            if reply.get("instance") != self.pushed_to:
                raise ModelError(f"the covey server at {self.url} restarted again while the policy was pushed to it; "
                                 "is something restarting it? Its own output says why it stopped")
        self.exact_logprobs = bool(reply["exact_logprobs"])
        return rollout_from_json(reply, self.pad_token_id)

    def policy_changed(self, model: torch.nn.Module) -> None:
        super().policy_changed(model)
        self.policy = model

    def push_policy(self, model: torch.nn.Module) -> str | None:
        super().push_policy(model)
        return self.pushed_to

    def follow_pushes(self, holder: str | None) -> None:
        super().follow_pushes(holder)
        self.pushes, self.pushed_to = False, holder

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
