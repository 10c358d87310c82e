"""The policy's completions API over real HTTP (the OpenAI-compatible protocol vLLM and SGLang speak) and the
rollout collector that builds Rollouts from it: response format, log-probs equal to the model's own (and to
the trainer's on the packed sample, multi-turn included, tool output loss-masked), n, seeds, errors as
OpenAI-style objects, vLLM's and SGLang's response shapes, timeouts and retries naming the URL, and the
policy server publishing what the collector built."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
import urllib3

from client.rollouts import (
    Completion,
    CompletionError,
    CompletionsClient,
    RolloutCollector,
    Transcript,
    _completion,
    _error_message,
)
from rtrl.errors import ConfigError, ServiceUnavailable
from simulator.openai_server import CompletionServer, detokenize, token_text
from simulator.tasks import EOS, VOCAB, sample_task

SEQ = 32


@pytest.fixture(scope="module")
def model():
    from rtrl.sections.trainer import ModelSettings
    from simulator.policy import warm_start
    from trainer.model import build_model, init_parallel

    cfg = ModelSettings.tiny(vocab_size=VOCAB, seq_length=SEQ)
    init_parallel(cfg)
    m = build_model(cfg)
    rng = random.Random(0)
    warm_start(m, [sample_task(rng, "o") for _ in range(32)], steps=15)  # a policy that is not uniform
    return m


@pytest.fixture(scope="module")
def server(model):
    with CompletionServer({"rtrl-policy": model}) as s:
        yield s


@pytest.fixture
def http():
    pool = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=5, read=30))
    yield pool
    pool.clear()


def _post(http, server, body, raw: bytes | None = None):
    r = http.request(
        "POST",
        f"{server.url}/completions",
        body=raw if raw is not None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    return r.status, json.loads(r.data) if r.data else None


def _prompts(k: int = 2, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [sample_task(rng, "o").prompt for _ in range(k)]


def _model_logprobs(model, seq: list[int]) -> list[float]:
    """log p(seq[s+1] | seq[:s+1]) for every position, from the trainer's own function."""
    from trainer.model import forward_logprobs

    t = torch.tensor([seq])
    with torch.no_grad():
        lp = forward_logprobs(model, t[:, :-1], torch.arange(len(seq) - 1)[None], t[:, 1:])
    return lp[0].tolist()


def test_models_health_and_unknown_routes(server, http):
    r = http.request("GET", f"{server.url}/models")
    body = json.loads(r.data)
    assert r.status == 200 and body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [("rtrl-policy", "model", SEQ)]
    health = http.request("GET", server.url.removesuffix("/v1") + "/health")
    assert health.status == 200 and health.data == b""
    r = http.request("GET", f"{server.url}/nothing")
    assert r.status == 404 and json.loads(r.data)["error"]["type"] == "NotFoundError"


def test_response_format_and_logprobs_are_the_models(server, http, model):
    """vLLM's response: prompt-major choices, ``token_id:N`` tokens equal to ``token_ids``, the sampled token
    first in ``top_logprobs``, text offsets, usage; every log-prob equals the model's own for that token."""
    prompts = _prompts(2)
    status, body = _post(
        http,
        server,
        {
            "model": "rtrl-policy",
            "prompt": prompts,
            "n": 3,
            "max_tokens": 4,
            "logprobs": 2,
            "prompt_logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )
    assert status == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "rtrl-policy"
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for i, c in enumerate(body["choices"]):
        ids, lp = c["token_ids"], c["logprobs"]
        assert c["prompt_token_ids"] == prompts[i // 3] and c["finish_reason"] == "length" and len(ids) == 4
        assert lp["tokens"] == [f"token_id:{t}" for t in ids]
        assert c["text"] == detokenize(ids)
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(4)]
        for k, top in enumerate(lp["top_logprobs"]):
            assert next(iter(top)) == lp["tokens"][k] and top[lp["tokens"][k]] == lp["token_logprobs"][k]
            assert 2 <= len(top) <= 3  # the sampled token plus the top 2
            assert max(top.values()) >= lp["token_logprobs"][k]
        seq = prompts[i // 3] + ids
        np.testing.assert_allclose(lp["token_logprobs"], _model_logprobs(model, seq)[-4:], atol=1e-5)
        plp = c["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(prompts[i // 3])
        want = _model_logprobs(model, prompts[i // 3])
        got = [plp[s + 1][str(prompts[i // 3][s + 1])]["logprob"] for s in range(len(want))]
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert all(min(e["rank"] for e in d.values()) == 1 for d in plp[1:])  # the top-1 is listed
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 24, "total_tokens": 36}

    # text tokens unless token ids are asked for; a text prompt is the same prompt
    text_prompt = detokenize(prompts[0], skip_special_tokens=False)
    status, body = _post(http, server, {"prompt": text_prompt, "max_tokens": 2, "logprobs": 0, "seed": 3})
    status2, body2 = _post(http, server, {"prompt": prompts[0], "max_tokens": 2, "logprobs": 0, "seed": 3})
    assert status == status2 == 200 and body["choices"][0]["text"] == body2["choices"][0]["text"]
    c = body["choices"][0]
    assert "token_ids" not in c and c["logprobs"]["tokens"][0] in {token_text(t) for t in range(VOCAB)}
    assert [len(t) for t in c["logprobs"]["top_logprobs"]] == [1, 1]  # logprobs=0: the sampled token only


def test_n_seeds_and_greedy(server, http, model):
    from simulator.policy import greedy
    from simulator.tasks import Task

    req = {"prompt": _prompts(3), "n": 8, "max_tokens": 2, "logprobs": 0, "return_token_ids": True, "ignore_eos": True}

    def ids(body):
        return [c["token_ids"] for c in body["choices"]]

    a, b, c = (_post(http, server, req | {"seed": s})[1] for s in (7, 7, 8))
    assert len(ids(a)) == 24 and ids(a) == ids(b) and ids(a) != ids(c)
    assert [x["logprobs"] for x in a["choices"]] == [x["logprobs"] for x in b["choices"]]
    assert len({tuple(x) for x in ids(a)}) > 1  # n samples, not one sample n times
    assert ids(_post(http, server, req)[1]) != ids(_post(http, server, req)[1])  # no seed: the server's generator
    tasks = [Task(f"t{i}", "o", "bugfix", "easy", i, 0) for i in range(3)]
    g = _post(
        http,
        server,
        {
            "prompt": [t.prompt for t in tasks],
            "max_tokens": 2,
            "temperature": 0,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )[1]
    assert ids(g) == greedy(model, tasks)


def test_eos_stops_the_completion_unless_ignored(model, http):
    first = _prompts(1)[0]
    with CompletionServer({"m": model}) as probe:
        greedy_tok = _post(http, probe, {"prompt": first, "max_tokens": 1, "temperature": 0, "return_token_ids": True})[
            1
        ]
    eos = greedy_tok["choices"][0]["token_ids"][0]  # make the greedy token the end of sequence
    with CompletionServer({"m": model}, eos_token_id=eos) as s:
        req = {"prompt": first, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
        stop = _post(http, s, req)[1]["choices"][0]
        assert stop["token_ids"] == [eos] and stop["finish_reason"] == "stop"
        full = _post(http, s, req | {"ignore_eos": True})[1]["choices"][0]
        assert len(full["token_ids"]) == 3 and full["finish_reason"] == "length"
    assert EOS == 3  # the simulator's vocabulary: the default end of sequence


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "gpt-4", "prompt": [1, 2]}, 404, "model"),
        ({"prompt": [1, 2], "top_p": 0.9}, 400, "top_p"),
        ({"prompt": [1, 2], "stream": True}, 400, "stream"),
        ({"prompt": [1, VOCAB]}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": "<bos> not-a-token"}, 400, "prompt"),
        ({"prompt": [1, 2], "max_tokens": SEQ}, 400, "max_tokens"),
        ({"prompt": [1, 2], "n": 0}, 400, "n"),
        ({"prompt": [[1, 2]] * 3, "n": 2000}, 400, "prompt"),
        ({"prompt": [1, 2], "logprobs": 21}, 400, "logprobs"),
        ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
        ({"prompt": [1, 2], "seed": "7"}, 400, "seed"),
        ([1, 2], 400, None),
    ],
)
def test_bad_requests_are_openai_error_objects(server, http, body, status, param):
    got, err = _post(http, server, body)
    assert got == status
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["code"] == status and err["error"]["param"] == param and err["error"]["message"]
    assert err["error"]["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


def test_bad_json_and_oversize_bodies(server, http):
    got, err = _post(http, server, None, raw=b'{"prompt": [1,')
    assert got == 400 and "not valid JSON" in err["error"]["message"]
    r = http.request("POST", f"{server.url}/completions", body=b"x" * (server.max_body_bytes + 1))
    assert r.status == 413 and json.loads(r.data)["error"]["code"] == 413
    assert http.request("GET", f"{server.url}/models").status == 200  # the server serves on


def test_collector_multi_turn_masks_tool_output_and_matches_the_trainer(server, model):
    """Agent turn, tool output (mask 0, log-prob 0.0), agent turn sampled on the whole history: the Rollout's
    behaviour log-probs equal what the trainer recomputes on the packed sample, on every trained token."""
    from flows.batching import Sample, pack
    from schemas.codec import JsonCodec, encode_batch
    from schemas.records import Rollout
    from trainer.batch import to_batch
    from trainer.model import forward_logprobs
    from trainer.train import prepare

    prompts = _prompts(2, seed=4)
    with CompletionsClient(server.url, "rtrl-policy") as client:
        collector = RolloutCollector(client)
        groups = collector.start(prompts, group_size=2, max_tokens=2, seed=11, ignore_eos=True)
        assert [len(g) for g in groups] == [2, 2] and all(t.prompt_ids == p for g, p in zip(groups, prompts) for t in g)
        flat = [t for g in groups for t in g]
        for i, t in enumerate(flat):
            t.tool([5 + i % 3, 11 + i, 2])  # the tool's output: context, not sampled
        collector.next_turn(flat, max_tokens=2, seed=12, ignore_eos=True)
    codec = JsonCodec(Rollout)
    rollouts = []
    for i, t in enumerate(flat):
        assert t.loss_mask == [1, 1, 0, 0, 0, 1, 1] and t.behaviour_logprobs[2:5] == [0.0] * 3
        assert len(t.turns) == 2 and t.history == t.prompt_ids + t.completion_ids
        ro = t.rollout(
            trajectory_id=f"t{i}",
            policy_version=3,
            group_id=f"g{i // 2}",
            group_size=2,
            org_id="o",
            task_kind="bugfix",
            created_at=1,
        )
        assert codec.decode(codec.encode(ro)) == ro  # a valid record on the wire
        rollouts.append(ro)
    p = prepare(to_batch(encode_batch(pack([Sample(r, 0.0, 0) for r in rollouts], SEQ, 0)), 0, 0), 3, 0)
    with torch.no_grad():
        again = forward_logprobs(model, p.tokens, p.positions, p.targets, p.attention_mask)
    m = p.loss_mask.bool()
    assert int(m.sum()) == 4 * len(rollouts)  # both agent turns, never the prompt or the tool output
    np.testing.assert_allclose(again[m].numpy(), p.behaviour[m].numpy(), atol=1e-5)


def test_collector_reads_vllm_and_sglang_shapes():
    where = "http://h:1/v1/completions"
    vllm = {
        "logprobs": {"tokens": ["token_id:5", "token_id:12"], "token_logprobs": [-0.5, -1.25]},
        "finish_reason": "length",
    }
    assert _completion(vllm, where) == Completion([5, 12], [-0.5, -1.25], "length")
    sglang = {"token_ids": [5, 12], "logprobs": {"tokens": [" read_file", " 1"], "token_logprobs": [-0.5, -1.25]}}
    assert _completion(sglang, where).ids == [5, 12]
    text_only = {"logprobs": {"tokens": [" read_file", " 1"], "token_logprobs": [-0.5, -1.25]}}
    with pytest.raises(CompletionError, match="--return-tokens-as-token-ids"):
        _completion(text_only, where)
    with pytest.raises(CompletionError, match="log-probs for 2 tokens"):
        _completion({"token_ids": [5, 12], "logprobs": {"token_logprobs": [-0.5, None]}}, where)
    with pytest.raises(CompletionError, match="without logprobs"):
        _completion({"token_ids": [5, 12], "logprobs": None}, where)
    with pytest.raises(CompletionError, match="differ"):
        _completion({"token_ids": [5, 13], "logprobs": vllm["logprobs"]}, where)
    vllm_error = {
        "error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
    }
    sglang_error = {
        "object": "error",
        "message": "Prompt cannot be empty",
        "type": "BadRequest",
        "param": None,
        "code": 400,
    }
    assert _error_message(json.dumps(vllm_error)) == "NotFoundError: The model `x` does not exist."
    assert _error_message(json.dumps(sglang_error)) == "BadRequest: Prompt cannot be empty"
    assert _error_message("<html>bad gateway</html>") == "<html>bad gateway</html>"
    t = Transcript([1, 2]).agent(Completion([5], [-0.1])).tool([7, 8]).agent(Completion([9], [-0.2]))
    assert (t.completion_ids, t.loss_mask, t.behaviour_logprobs) == ([5, 7, 8, 9], [1, 0, 0, 1], [-0.1, 0.0, 0.0, -0.2])


def test_collector_errors_name_the_url(server, caplog):
    with CompletionsClient(server.url, "gpt-4") as client:
        with pytest.raises(CompletionError, match=rf"{server.url}.*does not serve model 'gpt-4'.*'rtrl-policy'"):
            client.check()
        with pytest.raises(CompletionError, match=rf"{server.url}/completions answered 404: NotFoundError"):
            client.complete([[1, 2]], max_tokens=1)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    t0 = time.monotonic()
    with pytest.raises(
        ServiceUnavailable, match=rf"{url}/completions did not answer after 2 tries.*connection refused"
    ):
        CompletionsClient(url, "m", timeout_s=1, retries=1, backoff_s=0.01).complete([[1]], max_tokens=1)
    assert time.monotonic() - t0 < 5
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]  # the one error says it all
    with pytest.raises(ValueError, match="http"):
        CompletionsClient("ftp://x/v1", "m")


def test_a_server_that_never_answers_times_out_naming_the_url():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel does), never answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
    try:
        t0 = time.monotonic()
        with pytest.raises(
            ServiceUnavailable, match=rf"{url}/models did not answer after 2 tries \(0.5s each\): timed out"
        ):
            CompletionsClient(url, "m", timeout_s=0.5, retries=1, backoff_s=0.01).models()
        assert time.monotonic() - t0 < 4
    finally:
        silent.close()


def test_retries_with_backoff_then_succeeds():
    """429/5xx are retried (urllib3's Retry); the last error, when retries run out, names URL and message."""
    calls: list[float] = []
    answer = {"choices": [{"index": 0, "token_ids": [5], "logprobs": {"tokens": ["x"], "token_logprobs": [-1.0]}}]}

    class Flaky(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            calls.append(time.monotonic())
            ok = len(calls) > 2 and len(calls) != 4
            data = json.dumps(answer if ok else {"error": {"message": "overloaded", "type": "ServiceUnavailable"}})
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        client = CompletionsClient(url, "m", timeout_s=2, retries=3, backoff_s=0.05)
        assert client.complete([[1]], max_tokens=1) == [[Completion([5], [-1.0], None)]]
        assert len(calls) == 3 and calls[2] - calls[1] >= 0.05  # two 503s, then the answer, with backoff
        calls.clear()
        with pytest.raises(CompletionError, match=rf"{url}/completions answered 503: ServiceUnavailable: overloaded"):
            CompletionsClient(url, "m", timeout_s=2, retries=1, backoff_s=0.01).complete([[1]], max_tokens=1)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_serving_settings():
    from rtrl.settings import load_settings

    s = load_settings(env={"RTRL_SERVING__URL": "http://10.0.0.5:8000/v1", "RTRL_SERVING__MODEL": "qwen"})
    assert (s.serving.url, s.serving.model, load_settings(env={}).serving.url) == (
        "http://10.0.0.5:8000/v1",
        "qwen",
        "",
    )
    with pytest.raises(ConfigError, match=r"serving.url = 'ftp://x' must be http\(s\)://host:port/v1"):
        load_settings(env={"RTRL_SERVING__URL": "ftp://x"})
    with pytest.raises(ConfigError, match="serving.url.*port"):
        load_settings(env={"RTRL_SERVING__URL": "http://h:99999/v1"})


def _announce(bootstrap: str, topic: str, version: int) -> None:
    from confluent_kafka import Producer

    from rtrl.kafka import producer_config
    from schemas.codec import JsonCodec
    from schemas.records import Checkpoint

    ck = Checkpoint(
        version=version,
        parent=None,
        created_at=time.time_ns() // 1_000_000,
        steps=0,
        samples=0,
        tokens=0,
        eval_results={},
        status="promoted",
        reason="test",
        kafka_offsets={},
        path=f"/ckpt/v{version}",
    )
    codec: JsonCodec[Checkpoint] = JsonCodec(Checkpoint)
    p = Producer(producer_config(bootstrap))
    p.produce(topic, key=str(version).encode(), value=codec.encode(ck))
    assert p.flush(10) == 0


@pytest.mark.parametrize("external", [False, True], ids=["own-server", "external-url"])
@pytest.mark.slow
def test_policy_server_publishes_the_collected_rollouts(broker, topic_prefix, model, external):
    """The policy server samples through the completions API - its own on a loopback port, or the one
    serving.url names (then it loads no weights) - and publishes the rollouts the collector built."""
    from client.sdk import RtrlClient
    from rtrl.kafka import read_topic
    from rtrl.settings import load_settings
    from schemas.codec import JsonCodec
    from schemas.records import Rollout
    from simulator.serve import PolicyServer

    settings = load_settings(env={"RTRL_KAFKA__TOPIC_PREFIX": topic_prefix})
    ext = CompletionServer({"served-elsewhere": model}).start() if external else None
    loads: list[str] = []
    try:
        with RtrlClient.from_settings(settings, bootstrap=broker.bootstrap) as client:
            kw = {"url": ext.url, "model_name": "served-elsewhere"} if ext else {}
            server = PolicyServer(
                broker.bootstrap, topic_prefix, client, None if ext else model, ["org-0"], seed=5, **kw
            )
            assert server.url.startswith("http://127.0.0.1:") and (server.api is None) == external
            _announce(broker.bootstrap, topic_prefix + "deployments", 0)
            for _ in range(20):
                server.refresh(lambda m, p: loads.append(p), timeout_s=0.2)
            assert server.version == 0 and loads == ([] if external else ["/ckpt/v0"])
            served = server.serve(3, group_size=4)
            assert served["control"].trajectories == 12
            server.close()
    finally:
        if ext is not None:
            ext.close()
    rollouts = [JsonCodec(Rollout).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "rollouts")]
    assert len(rollouts) == 12 and {r.policy_version for r in rollouts} == {0}
    groups: dict[str, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4] and all(r.group_size == 4 for r in rollouts)
    for r in rollouts:
        assert len(r.completion_ids) == 2 and r.loss_mask == [1, 1]
        np.testing.assert_allclose(
            r.behaviour_logprobs, _model_logprobs(model, r.prompt_ids + r.completion_ids)[-2:], atol=1e-5
        )


@pytest.mark.slow
def test_ab_candidate_is_served_under_its_model_name(broker, topic_prefix, model):
    """A/B mode: an announced candidate is loaded into the candidate model (under the server's lock) and served
    as ``candidate_name``; its rollouts carry its version and its own log-probs."""
    from confluent_kafka import Producer

    from client.sdk import RtrlClient
    from rtrl.kafka import producer_config, read_topic
    from rtrl.sections.trainer import ModelSettings
    from rtrl.settings import load_settings
    from schemas.codec import JsonCodec
    from schemas.records import Checkpoint, Rollout
    from simulator.serve import PolicyServer
    from trainer.model import build_model

    candidate = build_model(ModelSettings.tiny(vocab_size=VOCAB, seq_length=SEQ))  # other weights than `model`
    settings = load_settings(env={"RTRL_KAFKA__TOPIC_PREFIX": topic_prefix})
    loaded: list[tuple[object, str]] = []
    with RtrlClient.from_settings(settings, bootstrap=broker.bootstrap) as client:
        server = PolicyServer(
            broker.bootstrap, topic_prefix, client, model, ["org-0"], seed=2, candidate_model=candidate
        )
        assert server.collector.client.models() == ["rtrl-policy", "rtrl-candidate"]
        _announce(broker.bootstrap, topic_prefix + "deployments", 0)
        ck = Checkpoint(
            version=1, parent=0, created_at=1, steps=1, samples=1, tokens=1, eval_results={}, status="candidate",
            reason="test", kafka_offsets={}, path="/ckpt/v1",
        )  # fmt: skip
        p = Producer(producer_config(broker.bootstrap))
        p.produce(topic_prefix + "deployments", key=b"1", value=JsonCodec(Checkpoint).encode(ck))
        assert p.flush(10) == 0
        for _ in range(20):
            server.refresh(lambda m, path: loaded.append((m, path)), timeout_s=0.2)
        assert server.candidate == (1, "rtrl-candidate")
        assert [path for m, path in loaded if m is candidate] == ["/ckpt/v1"]
        served = server.serve(2, group_size=2, candidate_share=1.0)
        assert served["candidate"].trajectories == 4 and "control" not in served
        server.close()
    rollouts = [JsonCodec(Rollout).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "rollouts")]
    assert len(rollouts) == 4 and {r.policy_version for r in rollouts} == {1}
    for r in rollouts:
        seq = r.prompt_ids + r.completion_ids
        np.testing.assert_allclose(r.behaviour_logprobs, _model_logprobs(candidate, seq)[-2:], atol=1e-5)
        assert not np.allclose(r.behaviour_logprobs, _model_logprobs(model, seq)[-2:], atol=1e-3)
