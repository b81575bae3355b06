"""`covey server` (the fast engine behind vLLM's API) and the trainer's client of vLLM servers:
rollouts over HTTP equal the in-process engine's, pushed weights arrive over covey_gloo, a
restarted or half-updated server is caught. The same client against `vllm serve`: tests/vllm."""

import copy
import importlib.util
import json
import socket
import time
import urllib.error
import urllib.request

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.cli import main
from covey.errors import ConfigError, ModelError
from covey.models import add_lora
from covey.rollout import SamplesWithPolicy, SamplingParams, ServerEngine
from covey.rollout.engine import greedy_once, padded_rollout
from covey.rollout.fast.engine import FastEngine
from covey.rollout.server import FastBackend, RolloutServer, vllm_serve_command
from covey.rollout.vllm_engine import request_seeds
from covey.rollout.wire import ServerInfo, completion_request, read_completion_request
from covey.train.setup import server_backend, vllm_serve
from tests.conftest import make_model
from tests.test_rollout_and_logprobs import _prompts

ROWS = [{"prompt": [{"role": "user", "content": f"say {c}"}], "answer": str(i)} for i, c in enumerate("abcdefgh")]


def distinct_chars(completions, **kwargs):
    return [len(set(c[0]["content"])) / 8 for c in completions]


def serve(model, tokenizer, token=None, host="127.0.0.1", port=0) -> RolloutServer:
    """A server on a free port over its own copy of ``model``."""
    backend = FastBackend(copy.deepcopy(model).eval(), tokenizer, [tokenizer.eos_token_id])
    return RolloutServer(backend, host, port, token).start()


def connect(server: RolloutServer, tokenizer, **options) -> ServerEngine:
    host, port = server.server_address[:2]
    return ServerEngine(host, port, tokenizer.pad_token_id, [tokenizer.eos_token_id], timeout=5.0, **options)


class PerPrompt(SamplesWithPolicy):
    """The fast engine sampling as a client of a server does: one call per prompt, each with its own seed, and a
    greedy completion sampled once and repeated (the rows of a batch may round a matrix product's sums apart
    on some CPUs, so the same request is made here)."""

    def __init__(self, model, tokenizer):
        self.engine = FastEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer)
        self.pad, self.exact_logprobs = tokenizer.pad_token_id, True

    def generate(self, prompt_ids, num_generations, params, seed=None):
        ids, logps, reasons = [], [], []
        for prompt, s in zip(prompt_ids, request_seeds(seed, len(prompt_ids))):
            one = greedy_once(lambda n: self.engine.generate([prompt], n, params, s), num_generations, params)
            for row in range(num_generations):
                n = int(one.lengths_B[row])
                ids.append(one.completion_ids_BT[row, :n].tolist())
                logps.append(one.sampling_logp_BT[row, :n].tolist())
            reasons += one.finish_reasons
        return padded_rollout(ids, [[1] * len(r) for r in ids], logps, reasons, self.pad)


@pytest.fixture
def model(tokenizer):
    return make_model(len(tokenizer), seed=3)


@pytest.fixture
def server(model, tokenizer):
    server = serve(model, tokenizer)
    yield server
    server.close()


def assert_same_rollout(a, b):
    assert torch.equal(a.completion_ids_BT, b.completion_ids_BT)
    assert torch.equal(a.completion_mask_BT, b.completion_mask_BT)
    assert torch.equal(a.sampling_logp_BT, b.sampling_logp_BT)
    assert a.finish_reasons == b.finish_reasons


@pytest.mark.parametrize("params, seed", [
    (SamplingParams(max_new_tokens=16, greedy=True), None),
    (SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9), 7),
    (SamplingParams(max_new_tokens=16, temperature=1.3, stop=("e",)), 11),
])
def test_rollouts_over_http_equal_the_in_process_engine(server, model, tokenizer, params, seed):
    client = connect(server, tokenizer)
    prompts = _prompts(tokenizer)
    remote, here = client.generate(prompts, 3, params, seed=seed), PerPrompt(model, tokenizer).generate(prompts, 3, params, seed)
    assert_same_rollout(remote, here)
    assert client.exact_logprobs is True and here.completion_mask_BT.sum() > 0
    if params.stop:
        assert "stop" in remote.finish_reasons


def test_completion_requests_say_what_vllm_needs_and_read_back():
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
                            repetition_penalty=1.1, stop=("</answer>",))
    body = completion_request("m", [5, 6], 4, params, [3, 7], seed=11)
    assert body == dict(model="m", prompt=[5, 6], n=4, max_tokens=12, repetition_penalty=1.1, stop=["</answer>"],
                        include_stop_str_in_output=True, stop_token_ids=[3, 7], logprobs=0, return_token_ids=True,
                        seed=11, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05)
    assert read_completion_request(body) == ([[5, 6]], 4, params, [3, 7], 11)
    greedy = completion_request("m", [5], 1, SamplingParams(3, temperature=0.7, greedy=True), [3], None)
    assert greedy["temperature"] == 0.0 and read_completion_request(greedy)[2].greedy
    for change, message in (({"logprobs": 5}, "logprobs: 0"), ({"echo": True}, "does not take echo"),
                            ({"prompt": []}, "non-empty list of token ids"), ({"n": 0}, "int >= 1"),
                            ({"top_p": 0}, "top_p must be in"), ({"prompt": "5 6"}, "takes no text"),
                            ({"temperature": -1}, "temperature=-1.0 is negative"),
                            ({"temperature": "warm"}, "unreadable sampling settings")):
        with pytest.raises(ConfigError, match=message):
            read_completion_request({**body, **change})
    assert read_completion_request({**body, "stop": "###"})[2].stop == ("###",)  # one string, as OpenAI's API takes


def test_push_policy_makes_the_server_follow_the_trainer(server, model, tokenizer):
    client = connect(server, tokenizer)
    local = PerPrompt(model, tokenizer)
    prompts, params = _prompts(tokenizer), SamplingParams(max_new_tokens=16)
    before = local.generate(prompts, 2, params, seed=3)
    model.load_state_dict(make_model(len(tokenizer), seed=9).state_dict())  # the trainer's policy moves
    after = local.generate(prompts, 2, params, seed=3)
    assert not torch.equal(before.completion_ids_BT, after.completion_ids_BT)
    assert_same_rollout(client.generate(prompts, 2, params, seed=3), before)  # the server still has the old weights

    version = client.push_policy(model)
    assert server.weight_version == version and version.startswith("covey-") and server.running.is_set()
    assert_same_rollout(client.generate(prompts, 2, params, seed=3), after)
    server_params = dict(server.backend.model.named_parameters())
    assert all(torch.equal(p, server_params[n]) for n, p in model.named_parameters())
    with torch.no_grad():  # a second push over the same group
        next(model.parameters()).mul_(0.5)
    assert client.push_policy(model) != version
    assert torch.equal(next(model.parameters()), next(server.backend.model.parameters()))


def test_lora_policy_is_pushed_merged_and_left_untouched(server, model, tokenizer):
    policy = add_lora(copy.deepcopy(model), r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # B starts at zero: give the adapter an effect
                p.normal_(0.0, 0.3)
    snapshot = {n: p.detach().clone() for n, p in policy.state_dict().items()}
    client = connect(server, tokenizer)
    client.push_policy(policy)

    assert {n: p for n, p in policy.state_dict().items()}.keys() == snapshot.keys()
    assert all(torch.equal(p, snapshot[n]) for n, p in policy.state_dict().items())  # bitwise unchanged
    assert not any(getattr(m, "merged", False) for m in policy.modules())
    merged = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    pushed = dict(server.backend.model.named_parameters())
    assert pushed.keys() == merged.keys()
    assert all(torch.allclose(pushed[n], merged[n], atol=1e-6, rtol=0) for n in merged)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(pushed[q], dict(model.named_parameters())[q], atol=1e-3)  # the delta arrived


def test_a_training_run_through_the_server_equals_the_in_process_run(tmp_path, tokenizer):
    def run(name, rollout_engine, engine=None, **fields):
        args = GRPOConfig(output_dir=str(tmp_path / name), max_steps=3, num_generations=4, per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, max_completion_length=8, learning_rate=3e-3,
                          eval_max_samples=0, log_completions=False, rollout_engine=rollout_engine, **fields)
        model = make_model(len(tokenizer), seed=5)
        trainer = GRPOTrainer(model=model, reward_funcs=[distinct_chars], args=args, train_dataset=ROWS,
                              processing_class=tokenizer, quiet=True,
                              rollout_engine=engine(model) if engine else None)
        trainer.train()
        return trainer

    # the server starts from other weights: the first generation must already use the trainer's policy
    server = serve(make_model(len(tokenizer), seed=6), tokenizer)
    try:
        trainer = run("server", "vllm", vllm_mode="server", vllm_server_port=server.server_address[1],
                      vllm_server_timeout=5.0)
        remote = dict(trainer.model.named_parameters())
        trainer.engine.generate([[5, 6, 7]], 2, SamplingParams(4, greedy=True))  # the last step's push is due here
        server_params = dict(server.backend.model.named_parameters())
    finally:
        server.close()
    local = dict(run("here", "fast", engine=lambda m: PerPrompt(m, tokenizer)).model.named_parameters())
    start = dict(make_model(len(tokenizer), seed=5).named_parameters())
    assert any(not torch.equal(local[n], start[n]) for n in local)
    for name in local:
        assert torch.equal(remote[name], local[name]), name
        assert torch.equal(server_params[name], remote[name]), name  # pushed before the next generation


def test_no_server_is_a_clear_error_after_the_timeout(tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"no server answered at http://127\.0\.0\.1:\d+ within 1\.5 s.*"
                                          r"covey server CONFIG --backend vllm"):
        ServerEngine("127.0.0.1", port, tokenizer.pad_token_id, [3], timeout=1.5)
    assert 1.5 <= time.monotonic() - start < 10


def test_a_push_the_server_cannot_take_leaves_it_paused_and_marked(server, model, tokenizer):
    client = connect(server, tokenizer)
    other = make_model(len(tokenizer), layers=3)
    with pytest.raises(ModelError, match=r"pushing the policy to the server at .* failed midway .*no weight "
                                         r"'model\.layers\.2\..* left paused, holding a partly updated model named "
                                         r"covey-\w+-1-incomplete"):
        client.push_policy(other)
    assert not server.running.is_set() and server.weight_version.endswith("-incomplete")
    # nothing was loaded (the server checks every tensor first), and nothing samples from it unknowingly
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), server.backend.model.parameters()))
    with pytest.raises(ModelError, match="holds a partly updated model .* Restart the server"):
        client.generate(_prompts(tokenizer), 1, SamplingParams(4))


def test_a_server_with_a_token_serves_only_trainers_that_carry_it(model, tokenizer, monkeypatch):
    server = serve(model, tokenizer, token="s3cret")
    try:
        prompts, greedy = _prompts(tokenizer), SamplingParams(max_new_tokens=8, greedy=True)
        monkeypatch.delenv("COVEY_SERVER_TOKEN", raising=False)
        for token in (None, "wrong"):  # refused at the first request, before any weights or prompts are sent
            with pytest.raises(ConfigError, match=r"refused this trainer \(HTTP 401\): set COVEY_SERVER_TOKEN"):
                connect(server, tokenizer, token=token)
        # a request without it changes nothing: its body is not even read
        host, port = server.server_address[:2]
        request = urllib.request.Request(f"http://{host}:{port}/update_weight_version", method="POST",
                                         data=json.dumps({"new_version": "x"}).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10)
        assert refused.value.code == 401 and "COVEY_SERVER_TOKEN" in json.loads(refused.value.read())["error"]
        assert server.weight_version is None
        # the token from the environment, as `covey server` and the trainer read it
        monkeypatch.setenv("COVEY_SERVER_TOKEN", "s3cret")
        client = connect(server, tokenizer)
        assert_same_rollout(client.generate(prompts, 2, greedy), PerPrompt(model, tokenizer).generate(prompts, 2, greedy))
        other = make_model(len(tokenizer), seed=5)
        client.push_policy(other)  # pushes carry it too
        assert_same_rollout(client.generate(prompts, 2, greedy), PerPrompt(other, tokenizer).generate(prompts, 2, greedy))
    finally:
        server.close()


def test_cli_server_beyond_this_machine_needs_a_token_or_insecure(tiny_model_dir, capsys, monkeypatch):
    served = []

    def serve_once(self):
        served.append(self)
        raise KeyboardInterrupt  # Ctrl-C right away

    monkeypatch.setattr(RolloutServer, "serve_forever", serve_once)
    monkeypatch.delenv("COVEY_SERVER_TOKEN", raising=False)
    assert main(["server", "--backend", "fast", "--model", str(tiny_model_dir), "--port", "0", "--host", "0.0.0.0"]) == 2
    assert "refuses to listen on 0.0.0.0 without COVEY_SERVER_TOKEN" in capsys.readouterr().err and not served
    assert main(["server", "--backend", "fast", "--model", str(tiny_model_dir), "--port", "0", "--host", "0.0.0.0",
                 "--insecure"]) == 0
    assert "listening on 0.0.0.0 without COVEY_SERVER_TOKEN (--insecure): anyone who can reach" in capsys.readouterr().err
    monkeypatch.setenv("COVEY_SERVER_TOKEN", "s3cret")
    assert main(["server", "--backend", "fast", "--model", str(tiny_model_dir), "--port", "0", "--host", "0.0.0.0"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "token required" in err and served[-1].token == "s3cret"


def test_a_restarted_server_gets_the_policy_again(model, tokenizer):
    first = serve(model, tokenizer)
    host, port = first.server_address[:2]
    policy = make_model(len(tokenizer), seed=9)  # the trainer's policy, not the server's start-up model
    client = connect(first, tokenizer, policy=policy)
    prompts, greedy = _prompts(tokenizer), SamplingParams(max_new_tokens=8, greedy=True)
    wanted = PerPrompt(policy, tokenizer).generate(prompts, 2, greedy)
    assert_same_rollout(client.generate(prompts, 2, greedy), wanted)
    first.close()
    second = serve(model, tokenizer, port=port)  # the same address, its start-up weights again
    try:
        assert_same_rollout(client.generate(prompts, 2, greedy), wanted)
        assert second.weight_version == client.pushed_version and client.pushes_made == 2
        client.follow_pushes("covey-elsewhere-1")  # a process that does not push finds another version: it stops
        with pytest.raises(ModelError, match="holds weight_version .* not 'covey-elsewhere-1' that the first "
                                             "training process pushed"):
            client.generate(prompts, 1, greedy)
    finally:
        second.close()


def test_a_server_lost_between_rounds_is_waited_for_and_given_the_policy_again(model, tokenizer):
    """Killed, then started again on its port a second later: the client waits for it, pushes the policy
    again and samples the round with the same seeds; one that does not come back stops the run, saying how to go on."""
    import threading

    first = serve(model, tokenizer)
    host, port = first.server_address[:2]
    policy = make_model(len(tokenizer), seed=9)
    client = connect(first, tokenizer, policy=policy)
    prompts, params = _prompts(tokenizer), SamplingParams(max_new_tokens=8)
    wanted = PerPrompt(policy, tokenizer).generate(prompts, 2, params, seed=5)
    assert_same_rollout(client.generate(prompts, 2, params, seed=5), wanted)
    first.close()
    second = []
    later = threading.Timer(1.0, lambda: second.append(serve(model, tokenizer, port=port)))
    later.start()
    try:
        with pytest.warns(RuntimeWarning, match="lost the server .* waiting up to 5 s .* pushed to it again"):
            assert_same_rollout(client.generate(prompts, 2, params, seed=5), wanted)
        later.join()
        assert second[0].weight_version == client.pushed_version and client.pushes_made == 2
    finally:
        later.join()
        for server in second:
            server.close()
    with pytest.warns(RuntimeWarning), pytest.raises(ModelError, match=r"lost the server .* did not answer again within "
                                                                       r"5 s \(vllm_server_timeout\).*--resume-from-checkpoint"):
        client.generate(prompts, 2, params, seed=5)


def test_a_server_that_restarts_during_a_generation_is_sampled_again_with_the_policy(model, tokenizer):
    """vLLM's server starts at weight_version "default"; one that restarted while the trainer sampled
    answered with its start-up weights: the policy is pushed again and the round sampled again."""
    server = serve(model, tokenizer)
    start_up = copy.deepcopy(model.state_dict())
    policy = make_model(len(tokenizer), seed=9)
    client = connect(server, tokenizer, policy=policy)
    prompts, greedy = _prompts(tokenizer), SamplingParams(max_new_tokens=8, greedy=True)
    complete, restarts = server.complete, []

    def restarting_complete(body):
        if not restarts:  # as a server restarted under the first request: its start-up weights, vLLM's version
            restarts.append(1)
            server.backend.model.load_state_dict(start_up)
            server.weight_version = "default"
        return complete(body)

    server.complete = restarting_complete
    try:
        rollout = client.generate(prompts, 1, greedy)
    finally:
        server.close()
    assert restarts and client.pushes_made == 2
    assert_same_rollout(rollout, PerPrompt(policy, tokenizer).generate(prompts, 1, greedy))


def test_what_is_not_a_vllm_server_or_request_is_a_clear_error(server, tokenizer, monkeypatch):
    import http.server
    import threading

    class Other(http.server.BaseHTTPRequestHandler):
        """Answers /health, as TRL's vllm-serve does, but has no RL endpoints."""

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}' if self.path == "/health" else b'{"detail": "Not Found"}')

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match="has no /server_info endpoint: vLLM serves its RL endpoints only "
                                              "when started with VLLM_SERVER_DEV_MODE=1"):
            ServerEngine("127.0.0.1", other.server_address[1], tokenizer.pad_token_id, [3], timeout=5.0)
    finally:
        other.shutdown()
        other.server_close()
    with pytest.raises(ConfigError, match="cannot listen on 127.0.0.1 port .*: Address already in use"):
        RolloutServer(None, "127.0.0.1", server.server_address[1])
    client = connect(server, tokenizer)
    with pytest.raises(ConfigError, match="HTTP 400: prompt must be a non-empty list"):
        client.api.post("/v1/completions", {"prompt": [], "max_tokens": 4, "logprobs": 0, "return_token_ids": True})
    with pytest.raises(ConfigError, match="HTTP 400: the trainer ends completions at token ids \\[9\\]"):
        client.api.post("/v1/completions", completion_request("m", [5], 1, SamplingParams(4), [9], None))
    with pytest.raises(ConfigError, match="HTTP 404: covey server has no endpoint POST /generate"):
        client.api.post("/generate", {})
    with socket.create_connection(server.server_address[:2], timeout=10) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
        assert raw.recv(200).startswith(b"HTTP/1.0 400")
    monkeypatch.setenv("COVEY_SERVER_TOKEN", "s3cret\u20ac")
    with pytest.raises(ConfigError, match="must be printable ASCII"):
        connect(server, tokenizer)


def test_server_info_is_read_as_vllm_writes_it():
    vllm_like = {"vllm_config": {"model_config": {"model": "/m", "dtype": "torch.bfloat16", "logprobs_mode": "raw_logprobs",
                                                  "max_model_len": 88},
                                 "parallel_config": {"world_size": 2, "data_parallel_size": 2},
                                 "weight_transfer_config": {"backend": "nccl"}}}
    info = ServerInfo.from_json(vllm_like)
    assert (info.model, info.dtype, info.logprobs_mode, info.weight_transfer, info.workers) == (
        "/m", torch.bfloat16, "raw_logprobs", "nccl", 4)
    assert not info.covey_server and not info.exact_logprobs
    with pytest.raises(ConfigError, match="lacks what covey reads"):
        ServerInfo.from_json({"vllm_config": {}})


def test_a_server_on_ipv6_loopback_serves(model, tokenizer):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    server = serve(model, tokenizer, host="::1")
    try:
        client = ServerEngine("::1", server.server_address[1], tokenizer.pad_token_id, [3], timeout=5.0)
        assert server.url.startswith("http://[::1]:") and client.generate(_prompts(tokenizer), 1, SamplingParams(4))
    finally:
        server.close()


def test_cli_server_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["server", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--backend {vllm,fast}", "--host", "--port", "--vllm-server-port", "--model"):
        assert option in out
    assert main(["--help"]) == 0 and "covey server [CONFIG] [--backend vllm|fast]" in capsys.readouterr().err


def test_cli_server_starts_the_fast_backend_on_the_config_model(tiny_model_dir, tokenizer, capsys, monkeypatch):
    served = []

    def serve_once(self):
        served.append(self)
        raise KeyboardInterrupt  # Ctrl-C right away

    monkeypatch.setattr(RolloutServer, "serve_forever", serve_once)
    assert main(["server", "--backend", "fast", "--model", str(tiny_model_dir), "--port", "0",
                 "--vllm-server-host", "127.0.0.1"]) == 0
    assert "the fast engine over" in capsys.readouterr().err
    assert isinstance(served[0].backend, FastBackend) and served[0].server_address[0] == "127.0.0.1"
    backend = server_backend(GRPOConfig(model=str(tiny_model_dir)))
    assert backend.weight_dtype == torch.float32 and backend.exact_logprobs


def test_vllm_serve_is_started_with_what_covey_needs(tiny_model_dir, monkeypatch):
    serve = vllm_serve_command("/m", "127.0.0.1", 8011, "bfloat16", 3, 96, 0.4, False, "tok", "covey_gloo")
    argv = serve.argv
    assert argv[1:5] == ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model", "/m"] and serve.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": "tok"}
    for flag, value in (("--port", "8011"), ("--dtype", "bfloat16"), ("--seed", "3"), ("--max-model-len", "96"),
                        ("--logprobs-mode", "processed_logprobs"),
                        ("--weight-transfer-config", '{"backend": "covey_gloo"}')):
        assert argv[argv.index(flag) + 1] == value
    assert "--enable-scale-out" in argv  # /inference/v1/generate, which samples prompts with pictures
    if importlib.util.find_spec("vllm") is None:  # the checks before vllm serve starts
        with pytest.raises(ConfigError, match="needs vLLM, which is not installed"):
            vllm_serve(GRPOConfig(model=str(tiny_model_dir)), "127.0.0.1", 8011)


def test_cli_server_vllm_backend_without_vllm_says_how_to_install(tiny_model_dir, capsys):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: this checks the message shown without it")
    assert main(["server", "--model", str(tiny_model_dir)]) == 2
    assert "needs vLLM, which is not installed; install it with pip install 'covey[vllm]'" in capsys.readouterr().err


def test_fast_backend_holds_a_saved_adapter_merged(tmp_path, tiny_model_dir, tokenizer):
    from covey.models import is_peft_model, load_policy
    from tests.conftest import trained_lora

    policy = trained_lora(load_policy(str(tiny_model_dir)), ["all-linear"], r=2)
    policy.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    backend = server_backend(GRPOConfig(model=str(tmp_path / "adapter")))
    assert not is_peft_model(backend.model)
    ids = torch.tensor([[5, 17, 30, 41]])
    with torch.no_grad():
        assert torch.allclose(backend.model(ids).logits, policy(ids).logits, atol=1e-5, rtol=0)
