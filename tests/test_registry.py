"""Promoted checkpoints go where the fleet can load them (issue 13, point 4): ``trainer/registry.py``,
``client/fleet.py``, the reload endpoint of ``simulator/openai_server.py``, ``rtrl fleet follow``.

On a tiny random Qwen2 built from a config here (no hub access) and imported as the trainer imports one:

- a promotion through the function the loop calls (``export_checkpoint``) writes ``<registry>/v<N>/`` in Hugging Face
  format with ``rtrl.json`` (version, parent, reward version, eval results, created_at, files) and a content hash that
  this test recomputes on its own (hashlib, and coreutils' ``sha256sum``); transformers loads the folder and gives the
  Megatron model's logits; no temporary folder is left; exporting the version again is a no-op with the same hash;
  another model under the same version replaces it with a warning; the default tiny (non Hugging Face) model is not
  exported and says so in one log line; older announcements without the new fields still decode;
- announced on the real broker with ``app.deployments.announce``, the ``rtrl.deployments`` message and the ClickHouse row carry
  the path and hash; the fleet follower reloads the project's completions server over HTTP (SGLang's
  ``/update_weights_from_disk``), after which the server's log-probs are the exported model's as transformers
  computes them; ``app.deployments.rollback`` re-points it to the parent's export; a tampered export is refused by hash and
  the server keeps its weights; ``rtrl fleet follow --once`` does the same from the command line;
- the vLLM kind sends ``POST /collective_rpc`` with ``reload_weights(weights_path=...)`` (checked against a stub
  server), and every failure (refusal, 404, 5xx after retries, no answer, nothing listening) is one line naming
  the URL within bounded time; the server's reload refuses another architecture, a model without a Hugging Face
  config, and a folder missing a tensor, keeping the weights it had.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import pytest
import torch
import urllib3

transformers = pytest.importorskip("transformers")

from client.fleet import (  # noqa: E402
    METADATA,
    ExportMismatch,
    FleetFollower,
    ReloadClient,
    ReloadError,
    content_sha256,
    verify_export,
)
from devservices.broker import free_port  # noqa: E402
from rtrl.errors import ServiceUnavailable  # noqa: E402
from rtrl.sections.trainer import ModelSettings  # noqa: E402
from rtrl.settings import load_settings  # noqa: E402
from schemas.codec import JsonCodec  # noqa: E402
from schemas.records import Checkpoint  # noqa: E402
from simulator.openai_server import CompletionServer  # noqa: E402
from tests.test_hf_convert import BASE, VOCAB  # noqa: E402
from trainer.factory import build  # noqa: E402
from trainer.hf.config import config_from_hf  # noqa: E402
from trainer.model import causal_mask, init_parallel  # noqa: E402
from trainer.registry import export_checkpoint  # noqa: E402

SHAPE = BASE | {"max_position_embeddings": 256}  # the conversion tests' tiny model
TOKENS = [3, 17, 42, 5, 99, 0, 64, 23, 8, 77, 31, 12]


def _hf_folder(folder: Path, **changes) -> Path:
    """A random Qwen2 with weights far from their init, saved as safetensors (as tests/test_hf_convert.py does)."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**(SHAPE | changes))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return _hf_folder(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture
def cfg(source) -> ModelSettings:
    c = config_from_hf(source)
    init_parallel(c)
    return c


def _train(model, seed: int) -> None:
    """Stands for a training cycle: every weight moves."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _settings(tmp_path: Path, **env: str):
    return load_settings(env={"RTRL_DATA_DIR": str(tmp_path / "data")} | env)


def _ck(version: int, parent: int | None, status="promoted", created_at: int | None = None) -> Checkpoint:
    return Checkpoint(
        version=version,
        parent=parent,
        created_at=created_at if created_at is not None else time.time_ns() // 1_000_000,
        steps=3,
        samples=96,
        tokens=1024,
        eval_results={"solve_rate": 0.25 + version / 10, "broken_tool_call_rate": 0.1},
        status=status,
        reason="test",
        kafka_offsets={},
        path=f"/ckpt/v{version}",
    )


def _sha256sum_recipe(folder: Path) -> str | None:
    """The content hash as the docs tell a fleet to compute it with coreutils (None without them)."""
    if not shutil.which("sha256sum") or not shutil.which("bash"):
        return None
    cmd = "ls -A | grep -vx rtrl.json | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum"
    out = subprocess.run(["bash", "-c", cmd], cwd=folder, capture_output=True, text=True, check=True).stdout
    return out.split()[0]


def _independent_hash(folder: Path) -> str:
    lines = ""
    for f in sorted((f for f in folder.iterdir() if f.name != METADATA), key=lambda f: f.name.encode()):
        lines += f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n"
    return hashlib.sha256(lines.encode()).hexdigest()


def _megatron_logits(model) -> torch.Tensor:
    tok = torch.tensor([TOKENS])
    model.eval()
    with torch.no_grad():
        return model(tok, torch.arange(len(TOKENS))[None], causal_mask(len(TOKENS)))[0, :, :VOCAB]


def _hf_logprobs(folder: str | Path) -> torch.Tensor:
    """log p(token i | tokens < i) for i >= 1 under transformers' load of ``folder``."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([TOKENS])).logits[0]
    return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]


# --------------------------------------------------------------------------- the export


def test_export_is_hugging_face_with_metadata_and_a_verifiable_hash(cfg, tmp_path):
    settings = _settings(tmp_path)
    model = build(cfg)  # the imported weights ...
    _train(model, 1)  # ... after a cycle
    ck = _ck(1, 0)
    out = export_checkpoint(settings, model, cfg, ck)

    folder = settings.data_path / "registry" / "v1"  # the default registry: <data_dir>/registry
    assert out.export_path == str(folder) and folder.is_dir()
    assert msgspec.structs.replace(out, export_path="", export_sha256="") == ck  # nothing else changed
    names = {f.name for f in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", METADATA} <= names
    assert [p.name for p in folder.parent.iterdir()] == ["v1"]  # no temporary folder left behind

    # the content hash, recomputed here on its own, and with the coreutils recipe the docs give a fleet
    assert out.export_sha256 == _independent_hash(folder) == content_sha256(folder)
    recipe = _sha256sum_recipe(folder)
    assert recipe is None or recipe == out.export_sha256
    meta = json.loads((folder / METADATA).read_text())
    assert meta["format"] == "rtrl-export/1" and meta["sha256"] == out.export_sha256
    assert (meta["version"], meta["parent"], meta["reward_version"]) == (1, 0, settings.rewards.train_version)
    assert meta["eval_results"] == ck.eval_results and meta["created_at"] == ck.created_at
    assert (meta["checkpoint"], meta["source"]) == (ck.path, cfg.hf_path)
    assert sorted(meta["files"]) == sorted(names - {METADATA})
    for name, d in meta["files"].items():
        assert d == {
            "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
            "bytes": len((folder / name).read_bytes()),
        }

    # transformers loads the export and gives the Megatron model's logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(_megatron_logits(model), ref, atol=1e-4, rtol=0)

    # idempotent: a replay of the same promotion (a later created_at) keeps the export as it is
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    again = export_checkpoint(settings, model, cfg, msgspec.structs.replace(ck, created_at=ck.created_at + 5000))
    assert (again.export_path, again.export_sha256) == (out.export_path, out.export_sha256)
    assert json.loads((folder / METADATA).read_text()) == meta  # created_at of the first export
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in folder.parent.iterdir()] == ["v1"]


def test_another_model_under_the_same_version_is_replaced_with_a_warning(cfg, tmp_path, caplog):
    """A registry that outlived its data folder holds an earlier run's v1: this run's v1 replaces it."""
    settings = _settings(tmp_path, RTRL_SERVING__REGISTRY_DIR=str(tmp_path / "shared-registry"))
    model = build(cfg)
    first = export_checkpoint(settings, model, cfg, _ck(1, 0))
    assert first.export_path == str(tmp_path / "shared-registry" / "v1")
    _train(model, 2)
    with caplog.at_level(logging.WARNING, logger="trainer.registry"):
        second = export_checkpoint(settings, model, cfg, _ck(1, 0))
    assert second.export_path == first.export_path and second.export_sha256 != first.export_sha256
    assert content_sha256(second.export_path) == second.export_sha256
    assert [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()] == [
        f"registry: {first.export_path} held another export of v1 (content sha256 {first.export_sha256}); replaced "
        f"by this one ({second.export_sha256})"
    ]
    assert sorted(p.name for p in (tmp_path / "shared-registry").iterdir()) == ["v1"]


def test_a_model_that_is_not_hugging_face_is_not_exported(tmp_path, caplog):
    """The simulator's tiny LayerNorm/GELU model: one log line, empty path and hash, no registry written."""
    settings = _settings(tmp_path)
    ck = _ck(3, 2)
    with caplog.at_level(logging.INFO, logger="trainer.registry"):
        out = export_checkpoint(settings, None, ModelSettings.tiny(), ck)
    assert out == ck and (out.export_path, out.export_sha256) == ("", "")
    assert [r.getMessage() for r in caplog.records if r.name == "trainer.registry"] == [
        "registry: v3 not exported: the model is not a Hugging Face family (model.hf_path is empty); "
        "rtrl.deployments names its Megatron checkpoint /ckpt/v3 only"
    ]
    assert not (settings.data_path / "registry").exists()


def test_announcements_without_the_export_fields_still_decode():
    codec: JsonCodec[Checkpoint] = JsonCodec(Checkpoint)
    old = json.loads(codec.encode(_ck(2, 1)))
    del old["export_path"], old["export_sha256"]
    decoded = codec.decode(json.dumps(old).encode())
    assert (decoded.export_path, decoded.export_sha256) == ("", "")
    new = msgspec.structs.replace(_ck(2, 1), export_path="/r/v2", export_sha256="ab" * 32)
    assert codec.decode(codec.encode(new)) == new


# --------------------------------------------------------------------------- announce, follow, reload


def _server_logprobs(url: str) -> torch.Tensor:
    http = urllib3.PoolManager()
    body = {"model": "policy", "prompt": TOKENS, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    resp = http.request("POST", f"{url}/completions", body=json.dumps(body).encode(), timeout=30)
    assert resp.status == 200, resp.data
    plp = json.loads(resp.data)["choices"][0]["prompt_logprobs"]
    return torch.tensor([plp[i][str(TOKENS[i])]["logprob"] for i in range(1, len(TOKENS))])


def _deployments(bootstrap: str, topic: str) -> list[Checkpoint]:
    from rtrl.kafka import read_topic

    codec: JsonCodec[Checkpoint] = JsonCodec(Checkpoint)
    return [codec.decode(m.value()) for m in read_topic(bootstrap, topic)]


@pytest.mark.slow
def test_promotion_reaches_the_fleet_and_a_rollback_repoints_it(
    cfg, source, tmp_path, broker, topic_prefix, ch_client, ch_db, monkeypatch, caplog, capsys
):
    from confluent_kafka import Producer

    from app.cli import main
    from app.deployments import announce, rollback
    from rtrl import clickhouse
    from rtrl.kafka import producer_config

    env = {
        "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix,
        "RTRL_CLICKHOUSE__DATABASE": ch_db,
    }
    settings = _settings(tmp_path, **env)
    topic = settings.topic("deployments")
    producer = Producer(producer_config(broker.bootstrap))
    # the trainer's side: v0 (the imported model) promoted, then v1 trained, a candidate, promoted
    trainer_model = build(cfg)
    v0 = export_checkpoint(settings, trainer_model, cfg, _ck(0, None))
    announce(settings, ch_client, producer, v0)
    _train(trainer_model, 1)
    announce(settings, ch_client, producer, _ck(1, 0, status="candidate"))
    v1 = export_checkpoint(settings, trainer_model, cfg, _ck(1, 0))
    announce(settings, ch_client, producer, v1)

    # the deployments topic and ClickHouse carry the export's path and hash
    sent = _deployments(broker.bootstrap, topic)
    assert [(c.version, c.status, c.export_path, c.export_sha256) for c in sent] == [
        (0, "promoted", v0.export_path, v0.export_sha256),
        (1, "candidate", "", ""),
        (1, "promoted", v1.export_path, v1.export_sha256),
    ]
    rows = {c.version: c for c in clickhouse.select(ch_client, ch_db, "checkpoints")}
    assert (rows[1].export_path, rows[1].export_sha256) == (v1.export_path, v1.export_sha256)
    lp0, lp1 = _hf_logprobs(v0.export_path), _hf_logprobs(v1.export_path)
    assert (lp0 - lp1).abs().max() > 1e-2  # the trained version answers differently

    # the fleet's side: the project's server starts on the imported weights; the follower reloads it over HTTP
    server_model = build(cfg)
    with CompletionServer({"policy": server_model}, configs={"policy": cfg}) as server:
        torch.testing.assert_close(_server_logprobs(server.url), lp0, atol=1e-4, rtol=0)
        follower = FleetFollower(
            broker.bootstrap, topic, ReloadClient(server.url, "sglang", timeout_s=60), retry_s=3600
        )
        try:
            served = follower.poll(timeout_s=10)
            assert served is not None and (served.version, served.path, served.sha256) == (
                1,
                v1.export_path,
                v1.export_sha256,
            )
            torch.testing.assert_close(_server_logprobs(server.url), lp1, atol=1e-4, rtol=0)
            info = json.loads(urllib3.request("GET", server.url[: -len("/v1")] + "/get_model_info").data)
            assert (info["model_path"], info["weight_version"]) == (v1.export_path, "v1")

            # a rollback of v1 re-promotes v0: the fleet goes back to v0's export
            rollback(settings, broker.bootstrap, ch_client, 1, "test rollback")
            served = follower.poll(timeout_s=10)
            assert served is not None and (served.version, served.path) == (0, v0.export_path)
            torch.testing.assert_close(_server_logprobs(server.url), lp0, atol=1e-4, rtol=0)
            assert [(c.version, c.status) for c in _deployments(broker.bootstrap, topic)][-2:] == [
                (1, "rolled_back"),
                (0, "promoted"),
            ]

            # v2 promoted, but its export changed after the hash was taken: refused, the server keeps v0
            _train(trainer_model, 2)
            v2 = export_checkpoint(settings, trainer_model, cfg, _ck(2, 0))
            weights = Path(v2.export_path) / "model.safetensors"
            data = bytearray(weights.read_bytes())
            data[-1] ^= 0x01
            weights.write_bytes(bytes(data))
            announce(settings, ch_client, producer, v2)
            with caplog.at_level(logging.ERROR, logger="client.fleet"):
                served = follower.poll(timeout_s=10)
            assert served is not None and served.version == 0
            torch.testing.assert_close(_server_logprobs(server.url), lp0, atol=1e-4, rtol=0)
            refused = [r.getMessage() for r in caplog.records if r.name == "client.fleet"]
            assert len(refused) == 1 and refused[0].startswith(f"fleet: v2: export {v2.export_path} has content hash ")
            assert f"the announcement says {v2.export_sha256}" in refused[0] and "refused" in refused[0]
            with pytest.raises(ExportMismatch):
                verify_export(v2.export_path, v2.export_sha256)
        finally:
            follower.close()

        # the same from the command line: v2's export repaired, `rtrl fleet follow --once` loads it
        data[-1] ^= 0x01
        weights.write_bytes(bytes(data))
        verify_export(v2.export_path, v2.export_sha256)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("RTRL_DATA_DIR", str(tmp_path / "data"))
        capsys.readouterr()
        assert main(["fleet", "follow", "--once", "--url", server.url]) == 0
        out = capsys.readouterr().out
        assert f"serving v2 from {v2.export_path}" in " ".join(out.split()), out
        torch.testing.assert_close(_server_logprobs(server.url), _hf_logprobs(v2.export_path), atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- the reload endpoints


class _Stub:
    """A stub inference server: records each request and answers with ``reply(path, body)`` -> (status, body)."""

    def __init__(self, reply):
        self.requests: list[tuple[str, str, dict]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(("POST", self.path, body))
                status, answer = reply(self.path, body)
                data = json.dumps(answer).encode() if answer is not None else b""
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_vllm_reload_is_collective_rpc_reload_weights_with_the_path():
    stub = _Stub(lambda path, body: (200, {"results": [None]}))
    try:
        client = ReloadClient(stub.url + "/v1", "vllm", timeout_s=5)  # serving.url's form: /v1 is dropped
        assert client.endpoint == f"{stub.url}/collective_rpc"
        client.reload("/registry/v3", 3)
        assert stub.requests == [
            ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/registry/v3"}})
        ]
        sg = ReloadClient(stub.url, "sglang", timeout_s=5)
        assert sg.body("/registry/v3", 3) == {"model_path": "/registry/v3", "weight_version": "v3"}
    finally:
        stub.close()


@pytest.mark.parametrize(
    ("api", "status", "answer", "tries", "message"),
    [
        (
            "sglang",
            400,
            {"success": False, "message": "shapes differ"},
            1,
            "refused to load /r/v1 (400): shapes differ",
        ),
        ("sglang", 200, {"success": False, "message": "not loaded"}, 1, "did not load /r/v1: not loaded"),
        (
            "vllm",
            404,
            {"detail": "Not Found"},
            1,
            "has no reload endpoint (404); fix: start vLLM with VLLM_SERVER_DEV_MODE=1 (the endpoint exists only in "
            "development mode)",
        ),
        ("vllm", 500, {"detail": "worker died"}, 2, "refused to load /r/v1 (500): worker died"),
    ],
)
def test_reload_errors_are_one_line_naming_the_url(api, status, answer, tries, message):
    stub = _Stub(lambda path, body: (status, answer))
    try:
        client = ReloadClient(stub.url, api, timeout_s=5, retries=1, backoff_s=0.01)
        with pytest.raises(ReloadError) as e:
            client.reload("/r/v1", 1)
        assert str(e.value) == f"inference server at {client.endpoint} {message}"
        assert len(stub.requests) == tries  # 5xx is retried; a refusal is not
    finally:
        stub.close()


def test_an_unreachable_or_silent_server_is_reported_within_bounded_time():
    port = free_port()
    t = time.monotonic()
    with pytest.raises(
        ServiceUnavailable,
        match=rf"inference server at http://127.0.0.1:{port}/update_weights_from_disk "
        r"did not answer a reload of /r/v1 after 2 tries .*connection refused",
    ):
        ReloadClient(f"http://127.0.0.1:{port}", timeout_s=1, retries=1, backoff_s=0.01).reload("/r/v1")
    silent = _Stub(lambda path, body: (time.sleep(3), (200, None))[1])
    try:
        with pytest.raises(ServiceUnavailable, match=r"after 2 tries \(0.5s each\): timed out"):
            ReloadClient(silent.url, "vllm", timeout_s=0.5, retries=1, backoff_s=0.01).reload("/r/v1")
    finally:
        silent.close()
    assert time.monotonic() - t < 10


def test_the_server_reload_refuses_what_it_cannot_load_and_keeps_its_weights(cfg, source, tmp_path):
    other = config_from_hf(_hf_folder(tmp_path / "wider", intermediate_size=128))
    missing = tmp_path / "missing"
    shutil.copytree(source, missing)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.norm.weight"]  # loaded last: every layer is copied before it fails
    save_file(tensors, str(missing / "model.safetensors"), metadata={"format": "pt"})
    model = build(cfg)
    _train(model, 3)
    before = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    with CompletionServer({"policy": model, "plain": model}, configs={"policy": cfg}) as server:
        client = ReloadClient(server.url, "sglang", timeout_s=30, retries=0)
        with pytest.raises(
            ReloadError,
            match=r"refused to load .*wider \(400\): Failed to load .*another architecture "
            r"than the served model: ffn_hidden_size 128 \(serving 96\)",
        ):
            client.reload(str(tmp_path / "wider"))
        assert other.ffn_hidden_size == 128
        with pytest.raises(
            ReloadError, match=r"refused to load .*missing \(400\): .*tensor model.norm.weight is missing"
        ):
            client.reload(str(missing))
        with pytest.raises(ReloadError, match=r"refused to load .*absent \(400\): .*no config.json"):
            client.reload(str(tmp_path / "absent"))
        http = urllib3.PoolManager()
        resp = http.request("POST", client.endpoint, body=json.dumps({"model_path": str(source), "model": "plain"}))
        assert resp.status == 400 and "was given no Hugging Face config" in json.loads(resp.data)["message"]
        assert json.loads(resp.data)["success"] is False
        after = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        assert all(torch.equal(before[k], after[k]) for k in before)
