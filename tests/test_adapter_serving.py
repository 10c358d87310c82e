"""Multi-adapter serving over real HTTP: vLLM's runtime LoRA API on the project's completions server.

- ``/v1/load_lora_adapter`` loads an rtrl adapter checkpoint (any model) or a PEFT folder (a Hugging Face model)
  onto the one copy of the base; a request naming the adapter samples from base + adapter, with the log-probs of
  the trainer's own forward pass with that adapter active; a request naming the base still gets the base alone.
- Several adapters are held at once (``/v1/models`` lists them with their folder and parent, as vLLM does); beyond
  ``max_loras`` the least recently used leaves; ``/v1/unload_lora_adapter`` removes one; a name already loaded,
  a folder that does not load, or an unknown name are vLLM's 400/404 errors and leave the served models as they
  were.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import urllib3

from rtrl.sections.trainer import ModelSettings
from simulator.openai_server import CompletionServer
from simulator.tasks import VOCAB, sample_task
from trainer import lora
from trainer.model import build_model, causal_mask, init_parallel

SEQ = 32


@pytest.fixture(scope="module")
def model():
    cfg = ModelSettings.tiny(vocab_size=VOCAB, seq_length=SEQ)
    init_parallel(cfg)
    return build_model(cfg)


def _trained_adapter(model, name: str, seed: int, root) -> str:
    """An adapter with non-zero B (so it changes the logits), saved as an rtrl adapter checkpoint."""
    lora.add_adapter(model, name, lora.LoraConfig(rank=4, alpha=8.0), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.adapter_parameters(model, name):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    path = lora.save_adapter(root / name, model, name, step=1, base="test-base")
    lora.remove_adapter(model, name)
    return str(path)


def _logits(model, prompt: list[int], adapter: str | None) -> torch.Tensor:
    tokens = torch.tensor([prompt])
    pos = torch.arange(len(prompt)).unsqueeze(0)
    with torch.no_grad(), lora.activate(model, adapter):
        model.eval()
        return model(tokens, pos, causal_mask(len(prompt), tokens.device))[0, -1].float()


@pytest.fixture
def http():
    pool = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=5, read=60))
    yield pool
    pool.clear()


def _call(http, server, route: str, body) -> tuple[int, str]:
    r = http.request("POST", f"http://{server.host}:{server.port}{route}", body=json.dumps(body).encode())
    return r.status, r.data.decode()


def _greedy_logprob(http, server, name: str, prompt: list[int]) -> tuple[int, float]:
    status, text = _call(
        http,
        server,
        "/v1/completions",
        {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 0, "return_token_ids": True},
    )
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    return choice["token_ids"][0], choice["logprobs"]["token_logprobs"][0]


@pytest.mark.slow
def test_requests_name_their_adapter_and_get_base_plus_adapter(model, http, tmp_path):
    paths = {org: _trained_adapter(model, org, seed, tmp_path) for seed, org in enumerate(("org-1", "org-2"), 1)}
    with CompletionServer({"rtrl-policy": model}) as server:
        for org, path in paths.items():
            status, text = _call(http, server, "/v1/load_lora_adapter", {"lora_name": org, "lora_path": path})
            assert (status, text) == (200, f"Success: LoRA adapter '{org}' added successfully.")
        listed = json.loads(http.request("GET", f"{server.url}/models").data)["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [
            ("rtrl-policy", None),
            ("org-1", "rtrl-policy"),
            ("org-2", "rtrl-policy"),
        ]
        assert listed[1]["root"] == paths["org-1"]
        prompt = sample_task(random.Random(3), "o").prompt
        seen = {}
        for name, adapter in (("rtrl-policy", None), ("org-1", "org-1"), ("org-2", "org-2")):
            tok, lp = _greedy_logprob(http, server, name, prompt)
            want = torch.log_softmax(_logits(model, prompt, adapter), -1)
            assert tok == int(want.argmax())
            assert lp == pytest.approx(float(want[tok]), abs=1e-5)
            seen[name] = want
        assert not torch.allclose(seen["org-1"], seen["rtrl-policy"])  # the adapters do change the policy
        assert not torch.allclose(seen["org-1"], seen["org-2"])
        assert lora.active_adapter(model) is None  # nothing stays active after a request


def test_least_recently_used_adapter_leaves_and_errors_change_nothing(model, http, tmp_path):
    paths = {org: _trained_adapter(model, org, seed, tmp_path) for seed, org in enumerate(("a", "b", "c"), 11)}
    with CompletionServer({"rtrl-policy": model}, max_loras=2) as server:
        for org in ("a", "b"):
            assert _call(http, server, "/v1/load_lora_adapter", {"lora_name": org, "lora_path": paths[org]})[0] == 200
        prompt = sample_task(random.Random(4), "o").prompt
        _greedy_logprob(http, server, "a", prompt)  # a is now the most recently used
        assert _call(http, server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": paths["c"]})[0] == 200
        assert list(server.loras) == ["a", "c"] and sorted(lora.adapter_names(model)) == ["a", "c"]
        status, text = _call(http, server, "/v1/completions", {"model": "b", "prompt": prompt, "max_tokens": 1})
        assert status == 404 and "does not exist" in text
        # errors: a name already loaded, a folder that does not load, unloading an unknown name
        status, text = _call(http, server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": paths["a"]})
        assert status == 400 and "already been loaded" in text
        status, text = _call(
            http, server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(tmp_path / "nothing")}
        )
        assert status == 400 and "Failed to load LoRA adapter 'd'" in text
        assert "d" not in lora.adapter_names(model) and list(server.loras) == ["a", "c"]
        assert _call(http, server, "/v1/unload_lora_adapter", {"lora_name": "zzz"})[0] == 404
        status, text = _call(http, server, "/v1/unload_lora_adapter", {"lora_name": "a"})
        assert (status, text) == (200, "Success: LoRA adapter 'a' removed successfully.")
        assert list(server.loras) == ["c"] and lora.adapter_names(model) == ["c"]
        _call(http, server, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert lora.adapter_names(model) == []


def _decision(version: int, status: str, org: str = "", base: int | None = None, path: str = ""):
    from schemas.records import Checkpoint

    return Checkpoint(
        version=version,
        parent=None,
        created_at=0,
        steps=0,
        samples=0,
        tokens=0,
        eval_results={},
        status=status,  # type: ignore[arg-type]
        reason="test",
        kafka_offsets={},
        path=path or f"/ckpt/v{version}",
        org=org,
        base_version=base,
    )


@pytest.mark.slow  # a broker, a completions server and a policy server
def test_policy_server_answers_each_org_with_its_promoted_adapter(broker, topic_prefix, model, tmp_path):
    """Adapter decisions on rtrl.deployments: org-1's promoted adapter (validated on the serving base) serves
    org-1's tasks, under its own model name, while org-0 gets the base; the rollouts carry the log-probs of what
    served them. A per-org rollback, or a base promotion the adapter was not validated on, returns org-1 to the
    base alone; org-0 is never touched."""
    from confluent_kafka import Producer

    from client.sdk import RtrlClient
    from rtrl.kafka import producer_config, read_topic
    from rtrl.settings import load_settings
    from schemas.codec import JsonCodec
    from schemas.records import Checkpoint, Rollout
    from simulator.serve import PolicyServer

    path = _trained_adapter(model, "org-1", 5, tmp_path)
    settings = load_settings(env={"RTRL_KAFKA__TOPIC_PREFIX": topic_prefix})
    codec: JsonCodec[Checkpoint] = JsonCodec(Checkpoint)
    producer = Producer(producer_config(broker.bootstrap))

    def announce(*cks: Checkpoint) -> None:
        for ck in cks:
            producer.produce(topic_prefix + "deployments", value=codec.encode(ck))
        assert producer.flush(10) == 0

    def rollouts() -> list[Rollout]:
        assert client.flush(10) == 0  # the client lingers: what it served may still sit in its queue
        return [JsonCodec(Rollout).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "rollouts")]

    def served_by_adapter(r: Rollout) -> bool:
        seq = r.prompt_ids + r.completion_ids
        with lora.activate(model, "org-1"):
            with_adapter = _seq_logprobs(model, seq)
        base = _seq_logprobs(model, seq)
        got = torch.tensor(r.behaviour_logprobs)
        if torch.allclose(got, with_adapter, atol=1e-5):
            return True
        assert torch.allclose(got, base, atol=1e-5), (got, base, with_adapter)
        return False

    lora.load_adapter(path, model, "org-1", restore_rng=False)  # to compute the expected log-probs
    with RtrlClient.from_settings(settings, bootstrap=broker.bootstrap) as client:
        server = PolicyServer(broker.bootstrap, topic_prefix, client, model, ["org-0", "org-1"], seed=5)
        try:
            announce(_decision(0, "promoted"), _decision(1, "promoted", org="org-1", base=0, path=path))
            for _ in range(20):
                server.refresh(lambda m, p: None, timeout_s=0.2)
                if server.adapters:
                    break
            assert server.version == 0 and server.adapters == {"org-1": (1, "rtrl-policy-org-1-a1")}
            assert server.model_for("org-1") == "rtrl-policy-org-1-a1" and server.model_for("org-0") == "rtrl-policy"
            server.serve(12, group_size=2)
            first = rollouts()
            assert {r.org_id for r in first} == {"org-0", "org-1"}
            assert all(served_by_adapter(r) == (r.org_id == "org-1") for r in first)
            # each rollout names the adapter version that sampled it (0: the base alone)
            assert all(r.adapter_version == (1 if r.org_id == "org-1" else 0) for r in first)
            # a per-org rollback: org-1 goes back to the base alone
            announce(_decision(1, "rolled_back", org="org-1", base=0, path=path))
            for _ in range(20):
                server.refresh(lambda m, p: None, timeout_s=0.2)
                if not server.adapters:
                    break
            assert server.adapters == {} and "rtrl-policy-org-1-a1" not in (server.api.loras if server.api else {})
            # promoted again, then the base moves on: an adapter validated on v0 does not serve over v1
            announce(_decision(2, "promoted", org="org-1", base=0, path=path))
            for _ in range(20):
                server.refresh(lambda m, p: None, timeout_s=0.2)
                if server.adapters:
                    break
            assert server.adapters == {"org-1": (2, "rtrl-policy-org-1-a2")}
            announce(_decision(1, "promoted"))
            for _ in range(20):
                server.refresh(lambda m, p: None, timeout_s=0.2)
                if server.version == 1:
                    break
            assert server.version == 1 and server.adapters == {}
            server.serve(6, group_size=2)
            later = [r for r in rollouts() if r.policy_version == 1]  # (a topic of several partitions: no order)
            assert later and not any(served_by_adapter(r) for r in later)
            assert all(r.adapter_version == 0 for r in later)
        finally:
            server.close()
            lora.remove_adapter(model, "org-1")


def _seq_logprobs(model, seq: list[int]) -> torch.Tensor:
    """log p of the last two tokens of ``seq`` (the completion) under the model as it is."""
    tokens = torch.tensor([seq])
    pos = torch.arange(len(seq)).unsqueeze(0)
    with torch.no_grad():
        model.eval()
        logits = model(tokens, pos, causal_mask(len(seq), tokens.device))[0].float()
    lp = torch.log_softmax(logits[:-1], -1)
    return torch.stack([lp[i, seq[i + 1]] for i in range(len(seq) - 3, len(seq) - 1)])


@pytest.mark.slow  # a broker, ClickHouse, transformers + peft, a completions server
def test_a_promoted_adapter_is_exported_in_peft_format_and_the_fleet_serves_it(
    tmp_path, broker, topic_prefix, ch_client, ch_db
):
    """An adapter promotion of a Hugging Face model goes through the registry (``export_adapter``: a PEFT folder with
    a content hash this test recomputes, which ``peft`` loads onto the transformers model to give the Megatron
    model's logits with that adapter), is announced with org and base version, and ``FleetFollower`` loads it into
    the project's completions server through the runtime LoRA API (hash-checked): a request naming the adapter's
    model gets the adapter's log-probs. A per-org rollback unloads it; a base promotion it was not validated on
    unloads it too; a tampered export is refused."""
    import peft
    import transformers
    from confluent_kafka import Producer

    from app.deployments import announce
    from client.fleet import FleetFollower, ReloadClient, adapter_model_name, content_sha256
    from rtrl.kafka import producer_config
    from tests.test_registry import TOKENS, _ck, _hf_folder, _settings
    from trainer.hf.config import config_from_hf
    from trainer.hf.load import load_hf
    from trainer.registry import export_adapter, export_checkpoint

    source = _hf_folder(tmp_path / "qwen2")
    cfg = config_from_hf(source)
    init_parallel(cfg)
    settings = _settings(
        tmp_path,
        RTRL_KAFKA__BOOTSTRAP=broker.bootstrap,
        RTRL_KAFKA__TOPIC_PREFIX=topic_prefix,
        RTRL_CLICKHOUSE__DATABASE=ch_db,
    )
    producer = Producer(producer_config(broker.bootstrap))
    trainer_model = build_model(cfg)
    load_hf(trainer_model, cfg, source)
    v0 = export_checkpoint(settings, trainer_model, cfg, _ck(0, None))
    announce(settings, ch_client, producer, v0)
    lora.add_adapter(trainer_model, "org-1", lora.LoraConfig(rank=4, alpha=8.0), seed=3)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lora.adapter_parameters(trainer_model, "org-1"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ad = export_adapter(
        settings, trainer_model, cfg, "org-1", msgspec_replace(_ck(1, None), org="org-1", base_version=0)
    )
    assert ad.export_path.endswith("adapters/org-1/a1") and ad.export_sha256 == content_sha256(ad.export_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").float().eval()
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(hf, ad.export_path)(input_ids=torch.tensor([TOKENS])).logits[0]
    with torch.no_grad(), lora.activate(trainer_model, "org-1"):
        trainer_model.eval()
        got = trainer_model(torch.tensor([TOKENS]), torch.arange(len(TOKENS))[None], causal_mask(len(TOKENS)))[0]
    torch.testing.assert_close(got[:, : want.shape[-1]].float(), want, atol=1e-4, rtol=1e-4)
    announce(settings, ch_client, producer, ad)

    server_model = build_model(cfg)
    load_hf(server_model, cfg, source)
    with CompletionServer({"policy": server_model}, configs={"policy": cfg}) as server:
        follower = FleetFollower(
            broker.bootstrap, settings.topic("deployments"), ReloadClient(server.url), model_name="policy", retry_s=0
        )
        name = adapter_model_name("policy", "org-1", 1)
        for _ in range(20):
            follower.poll(timeout_s=0.3)
            if follower.adapters:
                break
        assert follower.served is not None and follower.served.version == 0
        assert follower.adapters == {"org-1": (1, name)} and list(server.loras) == [name]
        http = urllib3.PoolManager()
        body = {"model": name, "prompt": TOKENS, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
        resp = http.request("POST", f"{server.url}/completions", body=json.dumps(body).encode(), timeout=30)
        assert resp.status == 200, resp.data
        plp = json.loads(resp.data)["choices"][0]["prompt_logprobs"]
        served = torch.tensor([plp[i][str(TOKENS[i])]["logprob"] for i in range(1, len(TOKENS))])
        lp = torch.log_softmax(want[:-1], -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
        torch.testing.assert_close(served, lp, atol=1e-4, rtol=1e-4)
        # a per-org rollback: the org goes back to the base alone
        announce(settings, ch_client, producer, msgspec_replace(ad, status="rolled_back", created_at=ad.created_at + 1))
        for _ in range(20):
            follower.poll(timeout_s=0.3)
            if not follower.adapters:
                break
        assert follower.adapters == {} and list(server.loras) == []
        # the base moves on to v1: an adapter validated on v0 (a2) is not loaded over it
        announce(settings, ch_client, producer, export_checkpoint(settings, trainer_model, cfg, _ck(1, 0)))
        announce(settings, ch_client, producer, msgspec_replace(ad, version=2, created_at=ad.created_at + 2))
        for _ in range(20):
            follower.poll(timeout_s=0.3)
            if follower.served.version == 1:
                break
        assert follower.served.version == 1 and follower.adapters == {} and list(server.loras) == []
        # validated on v1 (a3) but its export tampered with: refused by hash, nothing loaded
        a3 = msgspec_replace(ad, version=3, base_version=1, created_at=ad.created_at + 3)
        (Path(a3.export_path) / "adapter_config.json").write_text("{}")
        announce(settings, ch_client, producer, a3)
        for _ in range(5):
            follower.poll(timeout_s=0.3)
        assert follower.adapters == {} and any("org-1 adapter a3 not loaded" in v for v in follower.refused.values())
        follower.close()


def msgspec_replace(ck, **changes):
    import msgspec

    return msgspec.structs.replace(ck, **changes)
