"""`covey server` and its client: rollouts over HTTP equal the in-process engine's, weights follow the trainer."""

import copy
import importlib.util
import json
import socket
import time
import urllib.error
import urllib.request

import pytest
import safetensors.torch
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.cli import main
from covey.errors import ConfigError, ModelError
from covey.rollout.fast.engine import FastEngine
from covey.models import add_lora
from covey.rollout import SamplingParams
from covey.rollout import ServerEngine
from covey.rollout.server import FastBackend, RolloutServer
from covey.rollout.wire import weight_chunks
from covey.train.setup import server_backend
from tests.conftest import make_model
from tests.test_rollout_and_logprobs import _prompts

ROWS = [{"prompt": [{"role": "user", "content": f"say {c}"}], "answer": str(i)} for i, c in enumerate("abcdefgh")]


def distinct_chars(completions, **kwargs):
    return [len(set(c[0]["content"])) / 8 for c in completions]


def serve(model, tokenizer, token=None) -> RolloutServer:
    """A server on a free port over its own copy of ``model``."""
    backend = FastBackend(copy.deepcopy(model).eval(), tokenizer, [tokenizer.eos_token_id])
    return RolloutServer(backend, "127.0.0.1", 0, token).start()


def connect(server: RolloutServer, tokenizer, **options) -> ServerEngine:
    host, port = server.server_address[:2]
    return ServerEngine(host, port, tokenizer.pad_token_id, timeout=5.0, **options)


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
    local = FastEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer)
    prompts = _prompts(tokenizer)
    remote, here = client.generate(prompts, 3, params, seed=seed), local.generate(prompts, 3, params, seed=seed)
    assert_same_rollout(remote, here)
    assert client.exact_logprobs is True and here.completion_mask_BT.sum() > 0


def test_push_policy_makes_the_server_follow_the_trainer(server, model, tokenizer):
    client = connect(server, tokenizer, chunk_bytes=20_000)  # several /weights requests
    local = FastEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer)
    prompts, params = _prompts(tokenizer), SamplingParams(max_new_tokens=16)
    before = local.generate(prompts, 2, params, seed=3)
    model.load_state_dict(make_model(len(tokenizer), seed=9).state_dict())  # the trainer's policy moves
    after = local.generate(prompts, 2, params, seed=3)
    assert not torch.equal(before.completion_ids_BT, after.completion_ids_BT)
    assert_same_rollout(client.generate(prompts, 2, params, seed=3), before)  # the server still has the old weights

    assert len(list(weight_chunks(model.named_parameters(), torch.float32, 20_000))) > 2
    client.push_policy(model)
    assert_same_rollout(client.generate(prompts, 2, params, seed=3), after)
    server_params = dict(server.backend.model.named_parameters())
    assert all(torch.equal(p, server_params[n]) for n, p in model.named_parameters())


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
    def run(name, rollout_engine, **fields):
        args = GRPOConfig(output_dir=str(tmp_path / name), max_steps=3, num_generations=4, per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, max_completion_length=8, learning_rate=3e-3,
                          eval_max_samples=0, log_completions=False, rollout_engine=rollout_engine, **fields)
        trainer = GRPOTrainer(model=make_model(len(tokenizer), seed=5), reward_funcs=[distinct_chars], args=args,
                              train_dataset=ROWS, processing_class=tokenizer, quiet=True)
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
    local = dict(run("fast", "fast").model.named_parameters())
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
    with pytest.raises(ConfigError, match=r"no covey server answered at http://127\.0\.0\.1:\d+ within 1\.5 s.*"
                                          r"covey server CONFIG"):
        ServerEngine("127.0.0.1", port, tokenizer.pad_token_id, timeout=1.5)
    assert 1.5 <= time.monotonic() - start < 10


def test_server_errors_come_back_as_covey_errors(server, model, tokenizer):
    client = connect(server, tokenizer)
    other = make_model(len(tokenizer), layers=3)
    with pytest.raises(ModelError, match=r"covey server at .*/weights: the server's model has no weight "
                                         r"'model\.layers\.2\."):
        client.push_policy(other)
    request = {"prompt_ids": [[5, 6]], "num_generations": 1, "params": {"max_new_tokens": 4, "temperature": 0}}
    with pytest.raises(ConfigError, match=r"covey server at .*/generate: sampling settings .* temperature must be positive"):
        client._post("/generate", json.dumps(request).encode(), "application/json")
    # nothing was loaded: the server still samples with its own weights
    prompts, greedy = _prompts(tokenizer), SamplingParams(max_new_tokens=8, greedy=True)
    local = FastEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer)
    assert_same_rollout(client.generate(prompts, 1, greedy), local.generate(prompts, 1, greedy))


def test_a_server_with_a_token_serves_only_trainers_that_carry_it(model, tokenizer, monkeypatch):
    server = serve(model, tokenizer, token="s3cret")
    try:
        prompts, greedy = _prompts(tokenizer), SamplingParams(max_new_tokens=8, greedy=True)
        monkeypatch.delenv("COVEY_SERVER_TOKEN", raising=False)
        for token in (None, "wrong"):  # refused at the health check, before any weights or prompts are sent
            with pytest.raises(ConfigError, match=r"refused this trainer \(HTTP 401\): set the same COVEY_SERVER_TOKEN"):
                connect(server, tokenizer, token=token)
        # a request without it changes nothing: its weights are not even read
        host, port = server.server_address[:2]
        other = make_model(len(tokenizer), seed=5)
        request = urllib.request.Request(f"http://{host}:{port}/weights", method="POST",
                                         data=safetensors.torch.save({k: v.clone() for k, v in other.state_dict().items()}))
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10)
        assert refused.value.code == 401 and "COVEY_SERVER_TOKEN" in json.loads(refused.value.read())["error"]
        # the token from the environment, as `covey server` and the trainer read it
        monkeypatch.setenv("COVEY_SERVER_TOKEN", "s3cret")
        client = connect(server, tokenizer)
        local = FastEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer)
        assert_same_rollout(client.generate(prompts, 2, greedy), local.generate(prompts, 2, greedy))
        client.push_policy(other)  # pushes carry it too
        moved = FastEngine(other, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer)
        assert_same_rollout(client.generate(prompts, 2, greedy), moved.generate(prompts, 2, greedy))
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
    wanted = FastEngine(policy, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer).generate(prompts, 2, greedy)
    assert_same_rollout(client.generate(prompts, 2, greedy), wanted)
    first.close()
    backend = FastBackend(copy.deepcopy(model).eval(), tokenizer, [tokenizer.eos_token_id])
    second = RolloutServer(backend, host, port).start()  # the same address, its start-up weights again
    try:
        assert_same_rollout(client.generate(prompts, 2, greedy), wanted)
    finally:
        second.close()


def test_what_is_not_a_covey_server_or_request_is_a_clear_error(server, tokenizer, monkeypatch):
    import http.server
    import threading

    class TrlLike(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TrlLike)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match="not as a covey server does .* TRL's vllm-serve"):
            ServerEngine("127.0.0.1", other.server_address[1], tokenizer.pad_token_id, timeout=5.0)
    finally:
        other.shutdown()
        other.server_close()
    with pytest.raises(ConfigError, match="cannot listen on 127.0.0.1 port .*: Address already in use"):
        RolloutServer(None, "127.0.0.1", server.server_address[1])
    client = connect(server, tokenizer)
    for body, message in ((b"{not json", "not JSON"), (b'{"prompt_ids": []}', "prompt_ids, num_generations and params"),
                          (b'{"prompt_ids": [], "num_generations": 1, "params": {}}', "non-empty list"),
                          (b'{"prompt_ids": [[5]], "num_generations": 0, "params": {}}', "int >= 1")):
        with pytest.raises(ConfigError, match=message):
            client._post("/generate", body, "application/json")
    with socket.create_connection(server.server_address[:2], timeout=10) as raw:
        raw.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
        assert raw.recv(200).startswith(b"HTTP/1.0 400")
    monkeypatch.setenv("COVEY_SERVER_TOKEN", "s3cret\u20ac")
    with pytest.raises(ConfigError, match="must be printable ASCII"):
        connect(server, tokenizer)


def test_a_server_on_ipv6_loopback_serves(model, tokenizer):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    backend = FastBackend(copy.deepcopy(model).eval(), tokenizer, [tokenizer.eos_token_id])
    server = RolloutServer(backend, "::1", 0).start()
    try:
        client = ServerEngine("::1", server.server_address[1], tokenizer.pad_token_id, timeout=5.0)
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
    assert "fast backend for" in capsys.readouterr().err
    assert isinstance(served[0].backend, FastBackend) and served[0].server_address[0] == "127.0.0.1"

    backend = server_backend(GRPOConfig(model=str(tiny_model_dir)), "fast")
    assert backend.weight_dtype == "float32" and backend.exact_logprobs
    with pytest.raises(ConfigError, match="not one of vllm, fast"):
        server_backend(GRPOConfig(model=str(tiny_model_dir)), "hf")


def test_cli_server_vllm_backend_without_vllm_says_how_to_install(tiny_model_dir, capsys):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: this checks the message shown without it")
    assert main(["server", "--model", str(tiny_model_dir)]) == 2
    assert "needs vLLM, which is not installed; install it with pip install 'covey[vllm]'" in capsys.readouterr().err


def test_vllm_backend_refuses_a_seed_vllm_cannot_take(tiny_model_dir):
    with pytest.raises(ConfigError, match="vLLM takes seeds from 0 to 2\\*\\*32 - 1"):
        server_backend(GRPOConfig(model=str(tiny_model_dir), seed=-1), "vllm")


def test_vllm_backend_refuses_a_saved_adapter_as_its_model(tmp_path, tiny_model_dir, tokenizer):
    from covey.models import load_policy

    adapter = tmp_path / "adapter"
    add_lora(load_policy(str(tiny_model_dir)), 2, 4, 0.0, ["all-linear"]).save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    with pytest.raises(ConfigError, match="is a LoRA adapter, which vLLM cannot load as a model"):
        server_backend(GRPOConfig(model=str(adapter)), "vllm")


def test_fast_backend_holds_a_saved_adapter_merged(tmp_path, tiny_model_dir, tokenizer):
    from covey.models import is_peft_model, load_policy
    from tests.conftest import trained_lora

    policy = trained_lora(load_policy(str(tiny_model_dir)), ["all-linear"], r=2)
    policy.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    backend = server_backend(GRPOConfig(model=str(tmp_path / "adapter")), "fast")
    assert not is_peft_model(backend.model)
    ids = torch.tensor([[5, 17, 30, 41]])
    with torch.no_grad():
        assert torch.allclose(backend.model(ids).logits, policy(ids).logits, atol=1e-5, rtol=0)
