"""Secret screening (issue 38, point 4): a rollout whose decoded text holds a secret is kept back where rollouts
are collected (the SDK), so its tokens reach no topic, micro-batch, archive or table; the finding says which
detector and where, never the secret. Tested with realistic planted secrets through the real collector, flows
and trainer input, with a real tokenizer (the tokenizers library, trained here: no download).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from bytewax.testing import run_main
from prometheus_client import REGISTRY

from client.screening import DetectSecrets, Screen, scanner_from, screen_for, tokenizer_decoder
from client.sdk import RtrlClient
from flows import batch_flow, reward_flow
from flows.counts import FlowCounts
from rtrl.errors import ConfigError
from rtrl.kafka import ensure_topics, read_topic
from rtrl.settings import load_settings
from schemas.codec import JsonCodec, decode_batch
from schemas.records import Rollout
from simulator.tasks import decode, sample_task, warm_start_completion
from tests.test_reward_flow import _services_env
from trainer.data import BatchStream

#: realistic secrets as they turn up in a coding agent's context, each with the detector that must find it. They are
#: well-known documentation examples or random strings of the right shape, not live credentials.
PLANTED = {
    "AWSKeyDetector": "AKIAIOSFODNN7EXAMPLE",
    "GitHubTokenDetector": "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
    "SlackDetector": "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
    "StripeDetector": "sk_live_4eC39HqLyjWDarjtT1zdp7dc",
    "PrivateKeyDetector": "-----BEGIN RSA PRIVATE KEY-----",
    "BasicAuthDetector": "hunter2-Pa55word",
    "JwtTokenDetector": "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
}

CONTEXT = {
    "AWSKeyDetector": 'import boto3\ns3 = boto3.client("s3", aws_access_key_id="{s}")\n',
    "GitHubTokenDetector": "git clone https://github.com/acme/app\nexport GITHUB_TOKEN={s}\n",
    "SlackDetector": 'SLACK_BOT_TOKEN = "{s}"\npost(channel, text)\n',
    "StripeDetector": 'stripe.api_key = "{s}"\ncharge = stripe.Charge.create(amount=100)\n',
    "PrivateKeyDetector": "cat ~/.ssh/id_rsa\n{s}\nMIIEpAIBAAKCAQEA\n",
    "BasicAuthDetector": 'DATABASE_URL = "postgres://admin:{s}@db.internal:5432/app"\n',
    "JwtTokenDetector": 'headers = {{"Authorization": "Bearer {s}"}}\n',
}

ORDINARY = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "class Repo:\n    def __init__(self, path):\n        self.path = path\n",
    "# fix the off-by-one in the loop\nwhile n > 0:\n    n -= 1\n",
    "def check(password: str) -> bool:\n    return len(password) >= 12\n",
    "sha = 'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855'\n",
]


def _text(detector: str) -> str:
    return CONTEXT[detector].format(s=PLANTED[detector])


def test_each_planted_secret_is_found_where_it_is_and_the_finding_holds_no_secret():
    """detect-secrets' detectors find each planted secret at its character offset; a finding names the detector
    and the offset only."""
    screen = Screen(DetectSecrets(), lambda ids: "".join(map(chr, ids)))
    for detector, secret in PLANTED.items():
        text = _text(detector)
        findings = screen.rollout([ord(c) for c in "fix the bug\n"], [ord(c) for c in text])
        assert [f.detector for f in findings] == [detector], (detector, findings)
        (f,) = findings
        start = text.index(secret)  # the offset points into the secret (the key's header is matched without dashes)
        assert f.location == "completion" and start <= f.char_offset < start + len(secret), (text, f)
        assert secret not in repr(f) and secret[:8] not in repr(f)


def test_ordinary_code_and_the_simulators_traffic_are_not_flagged():
    """No finding on ordinary code (hashes and the word password included: the noisy detectors are off), nor on
    2,000 rollouts of the simulator's traffic decoded with its vocabulary: a false-positive rate of 0 there."""
    scanner = DetectSecrets()
    assert [t for t in ORDINARY if scanner.scan(t)] == []
    rng = random.Random(7)
    flagged = 0
    for i in range(2000):
        task = sample_task(rng, f"org-{i % 5}", hard_share=0.5)
        flagged += bool(scanner.scan(decode(task.prompt) + "\n" + decode(warm_start_completion(rng, task))))
    assert flagged == 0


class Marker:
    """A scanner of one's own (governance.secret_scanner = 'module:Class'): it flags the word CONFIDENTIAL."""

    def scan(self, text: str) -> list[tuple[str, int]]:
        at = text.find("CONFIDENTIAL")
        return [("Marker", at)] if at >= 0 else []


def test_the_scanner_is_pluggable_and_can_be_off():
    assert isinstance(scanner_from("detect-secrets"), DetectSecrets)
    assert scanner_from("") is None and screen_for("", "", decode) is None
    assert screen_for("detect-secrets", "", None) is None  # no decoder: the product sets RtrlClient.screen
    mine = screen_for("tests.test_secret_screening:Marker", "", lambda ids: "".join(map(chr, ids)))
    assert mine is not None and [f.char_offset for f in mine.rollout([], [ord(c) for c in "a CONFIDENTIAL b"])] == [2]
    for bad in ("no.such.module:X", "tests.test_secret_screening:Nothing", "json:dumps"):
        with pytest.raises(ConfigError, match="governance.secret_scanner"):
            scanner_from(bad)
    assert load_settings(env={}).governance.secret_scanner == "detect-secrets"


def _tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer trained on a little code, saved as a model folder's tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(ORDINARY * 20 + [CONTEXT[d] for d in CONTEXT] * 5, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.slow
def test_planted_secrets_reach_no_micro_batch_archive_topic_or_table(
    broker, topic_prefix, ch_dsn, ch_client, ch_db, tmp_path
):
    """Twelve trajectories through the SDK with a real tokenizer, five with a planted secret in the prompt or the
    completion, then the reward flow, the batch flow and the trainer's input. Only the clean trajectories reach
    micro-batches; no planted one's rollout reaches Kafka; no secret is in any topic, the archive or a ClickHouse
    table; each finding is in secret_findings with its detector and offset; the planted trajectories' rewards are
    monitor_only, and the findings are counted in Prometheus."""
    from tokenizers import Tokenizer

    folder = _tokenizer(tmp_path / "model")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer_decoder(folder)(tok.encode(_text("AWSKeyDetector")).ids) == _text("AWSKeyDetector")
    ensure_topics(broker.bootstrap, topic_prefix, 2)
    env = _services_env(broker, topic_prefix, ch_dsn, ch_db, tmp_path / "data") | {
        "RTRL_BATCHING__TAIL": "false",
        "RTRL_BATCHING__SEQ_LEN": "256",
        "RTRL_MODEL__HF_PATH": str(folder),
    }
    settings = load_settings(env=env)
    found_before = sum(_metric("rtrl_secrets_found_total", detector=d) for d in PLANTED)
    planted = {f"p{i}": (d, "prompt" if i % 2 else "completion") for i, d in enumerate(list(PLANTED)[:5])}
    with RtrlClient.from_settings(settings) as client:
        assert client.screen is not None  # from the settings: the model folder's tokenizer.json
        for i in range(12):
            tid = f"p{i}" if f"p{i}" in planted else f"c{i}"
            prompt, completion = "fix the failing test in repo.py\n", ORDINARY[i % len(ORDINARY)]
            if tid in planted:
                detector, where = planted[tid]
                prompt, completion = (_text(detector), completion) if where == "prompt" else (prompt, _text(detector))
            t = client.start_trajectory(
                org_id="acme", user_id=f"u{i}", task_kind="bugfix", policy_version=1, trajectory_id=tid
            )
            p_ids, c_ids = tok.encode(prompt).ids, tok.encode(completion).ids
            sent = t.rollout(
                Rollout(
                    trajectory_id=tid, policy_version=1, group_id=tid, group_size=1, org_id="acme", task_kind="bugfix",
                    prompt_ids=p_ids, completion_ids=c_ids, behaviour_logprobs=[-0.5] * len(c_ids),
                    loss_mask=[1] * len(c_ids), created_at=int(time.time() * 1000),
                )
            )  # fmt: skip
            assert sent == (tid not in planted), tid
            t.tool_call("run_tests", valid=True)
            t.edit_accepted(t.edit_proposed(lines=3))
            t.end("completed")
        assert client.flush(30) == 0
    assert sum(_metric("rtrl_secrets_found_total", detector=d) for d in PLANTED) == found_before + len(planted)

    run_main(reward_flow.build_flow(settings))
    counts = FlowCounts()
    run_main(batch_flow.build_flow(settings, counts=counts))
    assert counts.snapshot()["dropped:data_use:monitor_only"] == len(planted)  # the batch flow kept them out too

    rollouts = [
        JsonCodec(Rollout).decode(m.value()).trajectory_id
        for m in read_topic(broker.bootstrap, topic_prefix + "rollouts")
    ]
    assert sorted(rollouts) == sorted(f"c{i}" for i in range(len(planted), 12))
    stream = BatchStream(broker.bootstrap, topic_prefix + "batches", topic_prefix + "dead_letters")
    trained: list[str] = []
    while (b := stream.get(5)) is not None:
        trained += b.sample_ids
    stream.close()
    assert trained and not set(trained) & set(planted), trained
    secrets = [s.encode() for s in PLANTED.values()]
    for m in (
        m
        for name in ("events", "rollouts", "rewards", "batches", "dead_letters")
        for m in read_topic(broker.bootstrap, topic_prefix + name)
    ):
        value = m.value() or b""
        assert not any(s in value for s in secrets)
        if m.topic().endswith("batches"):
            assert not set(decode_batch(value).sample_ids) & set(planted)
    archive = list(Path(settings.archive_root).rglob("*.parquet"))
    assert archive and not [p for p in archive if any(s in p.read_bytes() for s in secrets)]
    for table in ("events", "trajectories", "rewards", "dead_letters", "rollouts", "batches"):
        dump = repr(ch_client.query(f"SELECT * FROM {ch_db}.{table}").result_rows)
        assert not any(s.decode() in dump for s in secrets), table
    findings = ch_client.query(
        f"SELECT trajectory_id, detector, location, char_offset FROM {ch_db}.secret_findings ORDER BY trajectory_id"
    ).result_rows
    expected = []
    for tid, (detector, where) in sorted(planted.items()):
        text = _text(detector)
        expected.append((tid, detector, where, text.find(PLANTED[detector])))
    assert [(t, d, w) for t, d, w, _ in findings] == [(t, d, w) for t, d, w, _ in expected]
    # each offset points into its secret (a detector may match inside it: the private key's header without dashes)
    assert all(e[3] <= o < e[3] + len(PLANTED[e[1]]) for (*_, o), e in zip(findings, expected)), (findings, expected)
    uses = dict(ch_client.query(f"SELECT trajectory_id, data_use FROM {ch_db}.rewards FINAL").result_rows)
    assert {uses[t] for t in planted} == {"monitor_only"} and {uses[f"c{i}"] for i in range(5, 12)} == {"train"}
