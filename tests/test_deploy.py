"""What ``deploy/`` gives operators (issue 18), checked offline: the Prometheus alert rules, the Grafana dashboard and
the runbook.

The files are made by ``python -m app.deploy`` and must be what it makes now; every query parses under Prometheus'
grammar (promql-parser) and reads only metrics some part exports (:mod:`rtrl.metrics`); the behaviour alerts carry
the promotion gate's own rules (:data:`monitors.alerts.DEFAULT_RULES`); every alert has its runbook section, and the
runbook covers the situations the issue names. Not run here (no Prometheus or Grafana on this machine): loading the
rule file into Prometheus (``promtool check rules deploy/prometheus/rtrl-alerts.yml``) and the dashboard into
Grafana (Dashboards > Import); docs/production.md says how.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client import REGISTRY

from app import deploy, manifests
from monitors.alerts import DEFAULT_RULES, MismatchRule
from rtrl import metrics
from rtrl.errors import ConfigError
from rtrl.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]


def _exported() -> set[str]:
    """Every sample name the project's metrics produce (counters' ``_total``, histograms' ``_bucket``, ...)."""
    assert metrics.EVENTS is not None  # rtrl.metrics registers its families on import
    names: set[str] = set()
    for family in REGISTRY.collect():
        if family.name.startswith("rtrl_"):
            names |= {family.name, *(s.name for s in family.samples)}
            if family.type == "counter":
                names.add(family.name + "_total")
            if family.type == "histogram":
                names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def _metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(rtrl_[a-z0-9_]+)", expr)) | ({"up"} if re.search(r"\bup\{", expr) else set())


def _rules() -> list[dict]:
    doc = yaml.safe_load(deploy.RULES_FILE.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def _dashboard_exprs() -> list[str]:
    board = json.loads(deploy.DASHBOARD_FILE.read_text())
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def test_the_files_are_what_app_deploy_makes(tmp_path):
    """`python -m app.deploy --out DIR` writes the same files as the repository holds."""
    run = subprocess.run(
        [sys.executable, "-m", "app.deploy", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    made_files = deploy.render()
    assert {deploy.RULES_FILE, deploy.DASHBOARD_FILE, deploy.COMPOSE_FILE} < set(made_files)
    for path in made_files:
        made = tmp_path / path.relative_to(ROOT)
        assert made.read_text() == path.read_text(), f"{path} is stale: run `python -m app.deploy`"


def test_every_query_parses_and_reads_only_exported_metrics():
    exported = _exported() | {"up"}
    exprs = [r["expr"] for r in _rules()] + _dashboard_exprs()
    assert len(exprs) > 20
    for expr in exprs:
        promql_parser.parse(expr)  # raises on anything Prometheus would refuse
        unknown = _metrics_in(expr) - exported
        assert not unknown, (unknown, expr)


def test_the_behaviour_alerts_carry_the_gates_rules():
    rules = {r["labels"].get("monitor"): r for r in _rules() if "monitor" in r["labels"]}
    mirrored = [rule for rule in DEFAULT_RULES if rule.metric in deploy.LIVE_RATES]
    assert {r.metric for r in mirrored} == set(rules) == set(deploy.LIVE_RATES)
    for rule in mirrored:
        expr = rules[rule.metric]["expr"]
        cur, base = deploy.live_rate(rule.metric), deploy.live_rate(rule.metric, "6h offset 1h")
        bad = f"({cur} - {base})" if rule.direction == "increase" else f"({base} - {cur})"
        assert expr.startswith(f"{bad} > {rule.threshold:g} * clamp_min({base}, {rule.floor:g})"), expr
        assert expr.endswith(f">= {rule.min_samples}")
    # each rate is the behaviour view's: numerator and denominator counters of the same trajectories
    assert deploy.LIVE_RATES["broken_tool_call_rate"] == ("broken_tool_calls", "tool_calls")
    mismatch = next(r for r in _rules() if r["alert"] == "RtrlTrainingInferenceMismatch")
    assert mismatch["expr"].endswith(f"> {MismatchRule().max_abs_log_ratio:g}")


def test_every_alert_has_its_runbook_section_and_the_runbook_covers_the_issue():
    runbook = (ROOT / "deploy" / "RUNBOOK.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", runbook, re.M)
    }
    for rule in _rules():
        assert rule["labels"]["severity"] in ("page", "ticket")
        assert rule["annotations"]["summary"]
        path, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert path == "deploy/RUNBOOK.md" and anchor in anchors, (rule["alert"], anchor)
    alerts = {r["alert"] for r in _rules()}
    # the issue's list: a reward-hack alarm, growing lag, a dead-letter spike, a trainer that stopped, a mismatch
    # alarm, a rollback
    for needed in (
        "RtrlBrokenToolCallsRose",
        "RtrlConsumerLagGrowing",
        "RtrlDeadLetterSpike",
        "RtrlTrainerStopped",
        "RtrlTrainingInferenceMismatch",
        "RtrlRollback",
    ):
        assert needed in alerts and needed.lower() in anchors
    assert "rtrl rollback V --reason" in runbook


def test_the_dashboard_shows_every_figure_the_issue_names():
    board = json.loads(deploy.DASHBOARD_FILE.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(p["targets"] and p["gridPos"]["w"] > 0 for p in board["panels"])
    shown = set().union(*(_metrics_in(e) for e in _dashboard_exprs()))
    for name in (
        "rtrl_consumer_lag",  # consumer lag per partition
        "rtrl_events_total",  # events/s
        "rtrl_dead_letters_total",  # dead letters by kind
        "rtrl_open_windows",  # open windows
        "rtrl_window_state_bytes",  # state size
        "rtrl_event_to_reward_seconds_bucket",  # event -> reward latency
        "rtrl_batch_samples_total",  # batch staleness by lag
        "rtrl_trainer_tokens_per_second",
        "rtrl_trainer_loss",
        "rtrl_trainer_kl",
        "rtrl_trainer_grad_norm",
        "rtrl_trainer_mismatch_k3",
        "rtrl_trainer_on_policy_fraction",
        "rtrl_gate_decisions_total",
        "rtrl_serving_version",
    ):
        assert name in shown, name


# ---------------------------------------------------------------- manifests (app.manifests)

#: Kubernetes versions the manifests are checked against: an old supported one and the newest schemas shipped
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def _k8s() -> dict[str, list[dict]]:
    return {
        str(p.relative_to(deploy.K8S_DIR)): [d for d in yaml.safe_load_all(p.read_text()) if d]
        for p in sorted(deploy.K8S_DIR.rglob("*.yaml"))
    }


def _all_k8s() -> list[dict]:
    return [d for docs in _k8s().values() for d in docs]


def _kind(kind: str) -> list[dict]:
    return [d for d in _all_k8s() if d["kind"] == kind]


def _check_model(value: object, type_name: str, where: str, problems: list[str]) -> None:
    """``value`` against the Kubeflow SDK's OpenAPI model ``type_name``, strictly (no unknown field); a pod
    template goes to Kubernetes' own schema (kubernetes-validate) as a PodTemplate."""
    import kubeflow.training.models as models

    if type_name == "V1PodTemplateSpec":
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": value}
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{where} (Kubernetes {version}): {e.message}")
        return
    if m := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        assert isinstance(value, dict), where
        for k, v in value.items():
            _check_model(v, m.group(1), f"{where}.{k}", problems)
        return
    if m := re.fullmatch(r"list\[(.+)\]", type_name):
        assert isinstance(value, list), where
        for i, v in enumerate(value):
            _check_model(v, m.group(1), f"{where}[{i}]", problems)
        return
    scalars = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
    if type_name in scalars:
        if not isinstance(value, scalars[type_name]):  # type: ignore[arg-type]
            problems.append(f"{where} is {type(value).__name__}, the model says {type_name}")
        return
    cls = getattr(models, type_name)
    if not isinstance(value, dict):
        problems.append(f"{where} is not an object ({type_name})")
        return
    by_json = {j: a for a, j in cls.attribute_map.items()}
    for key, v in value.items():
        if key not in by_json:
            problems.append(f"{where}.{key} is not a field of {type_name}")
            continue
        _check_model(v, cls.openapi_types[by_json[key]], f"{where}.{key}", problems)


def test_the_kubernetes_manifests_validate_against_kubernetes_schemas():
    """Every core resource, strictly (an unknown or misspelt field fails), against an old and the newest
    Kubernetes schemas kubernetes-validate ships; the PyTorchJob against the Kubeflow SDK's models, its pod
    templates against Kubernetes' own."""
    docs = _all_k8s()
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == [
        "ConfigMap",
        "CronJob",
        "Job",
        "Namespace",
        "PersistentVolumeClaim",
        "PyTorchJob",
        "Secret",
        "Service",
        "StatefulSet",
    ]
    problems: list[str] = []
    for d in docs:
        if d["kind"] == "PyTorchJob":
            assert d["apiVersion"] == "kubeflow.org/v1"
            _check_model(d["spec"], "KubeflowOrgV1PyTorchJobSpec", "PyTorchJob.spec", problems)
            _check_model(d["metadata"], "V1ObjectMeta", "PyTorchJob.metadata", problems)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{d['kind']}/{d['metadata']['name']} (Kubernetes {version}): {e.message}")
    assert not problems, "\n".join(problems)
    # the validators catch what they are here for
    bad = copy.deepcopy(_kind("StatefulSet")[0])
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    job = copy.deepcopy(_kind("PyTorchJob")[0])
    job["spec"]["pytorchReplicaSpecs"]["Master"]["replica"] = 1
    caught: list[str] = []
    _check_model(job["spec"], "KubeflowOrgV1PyTorchJobSpec", "spec", caught)
    assert caught == ["spec.pytorchReplicaSpecs.Master.replica is not a field of KubeflowOrgV1ReplicaSpec"]


def test_the_flows_are_bytewax_clusters_with_recovery_volumes_and_probes():
    """Each flow: a StatefulSet started in parallel (a Bytewax cluster starts whole), a volume per process for its
    recovery folder, the addressing bytewax.run reads (pod name, StatefulSet name, every process's address on the
    headless Service, which publishes not-ready pods), and probes on the metrics endpoint."""
    services = {d["metadata"]["name"]: d for d in _kind("Service")}
    for sts in _kind("StatefulSet"):
        name, spec = sts["metadata"]["name"], sts["spec"]
        assert spec["podManagementPolicy"] == "Parallel" and spec["serviceName"] == name
        assert spec["updateStrategy"] == {"type": "OnDelete"}  # upgraded whole, never one process at a time
        svc = services[name]["spec"]
        assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
        (c,) = spec["template"]["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["BYTEWAX_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["BYTEWAX_STATEFULSET_NAME"]["value"] == name
        port = next(p["port"] for p in svc["ports"] if p["name"] == "bytewax")
        assert env["BYTEWAX_ADDRESSES"]["value"].split(";") == [
            f"{name}-{i}.{name}:{port}" for i in range(spec["replicas"])
        ]
        assert c["command"][:3] == ["rtrl", "flow", "rewards" if "reward" in name else "batches"]
        (claim,) = spec["volumeClaimTemplates"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"])
        assert mount["mountPath"] == manifests.DATA_DIR  # data_dir: the recovery folder and window state on it
        assert (
            c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        )
        assert sts["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(manifests.METRICS_PORT)
    assert next(s for s in _kind("StatefulSet") if "reward" in s["metadata"]["name"])["spec"]["replicas"] == 2


def test_each_flow_pod_finds_its_place_in_the_cluster_from_the_manifests_environment():
    """What `rtrl flow` resolves from a pod's environment as the StatefulSet sets it: process id = the pod's
    ordinal, every process's address, and metrics on metrics.port (where the probes look) in every pod."""
    from app.flow_state import cluster_from

    for sts in _kind("StatefulSet"):
        name, n = sts["metadata"]["name"], sts["spec"]["replicas"]
        env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
        for i in range(n):
            pod_env = {k: v for k, v in env.items() if k.startswith("BYTEWAX_") and v} | {
                "BYTEWAX_POD_NAME": f"{name}-{i}"
            }
            cluster = cluster_from(env=pod_env)
            assert cluster.process_id == i and len(cluster.addresses) == n
            assert cluster.local_index == 0  # its own address: metrics on the probed port


def test_each_deployed_part_is_one_file_sized_by_its_shape_field():
    """The manifests come from the part table: one file per part with a workload, its kind's builder, its name, and
    as many pods (or trainer nodes) as the Shape field it names says."""
    from app.parts import PART_LIST

    shape = manifests.Shape(reward_processes=3, batch_processes=2, trainer_nodes=4)
    files = manifests.kubernetes(load_settings(), shape)
    deployed = [p for p in PART_LIST if p.workload is not None]
    assert deployed and all(p.workload.kind in manifests.WORKLOADS for p in deployed)
    for part in deployed:
        (workload,) = [d for d in files[part.workload.file] if d["kind"] == part.workload.kind]
        assert workload["metadata"]["name"] == part.workload.name
        size = getattr(shape, part.workload.replicas)
        if part.workload.kind == "StatefulSet":
            assert workload["spec"]["replicas"] == size
            assert ("volumeClaimTemplates" in workload["spec"]) is part.workload.recovery_volume
        else:
            assert sum(r["replicas"] for r in workload["spec"]["pytorchReplicaSpecs"].values()) == size


def test_the_trainer_is_a_multi_node_torchrun_job():
    (job,) = _kind("PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    shape = manifests.Shape()
    assert specs["Master"]["replicas"] + specs["Worker"]["replicas"] == shape.trainer_nodes
    assert job["spec"]["nprocPerNode"] == str(shape.gpus_per_node)
    for spec in specs.values():
        (c,) = spec["template"]["spec"]["containers"]
        assert c["name"] == "pytorch" and c["command"] == ["torchrun", "-m", "trainer"]
        assert c["image"] == shape.trainer_image != shape.image  # the GPU build
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(shape.gpus_per_node)
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {f"{manifests.DATA_DIR}/checkpoints", "/dev/shm"}
    (claim,) = _kind("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every node writes its shards of a checkpoint


def test_settings_go_in_a_configmap_and_secrets_only_in_the_secret(tmp_path):
    """The ConfigMap's rtrl.toml is the source settings as a container sees them; it reads back (with the secrets
    from the Secret's files) to exactly those settings; no secret appears in any manifest; every container that
    reads settings mounts both and names each secret's file."""
    source = deploy.source_settings()
    (cm,) = _kind("ConfigMap")
    toml_text = cm["data"]["rtrl.toml"]
    (secret,) = _kind("Secret")
    keys = set(secret["stringData"])
    assert keys == {"sdk-salt", "clickhouse-password"} and not any(secret["stringData"].values())
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for k in keys:
        (secrets / k).write_text(f"value-of-{k}\n")
    (tmp_path / "rtrl.toml").write_text(toml_text)
    env = {
        manifests.SECRET_KEYS[s][1]: str(secrets / manifests.SECRET_KEYS[s][0])
        for s in manifests.secrets_needed(source)
    }
    back = load_settings(tmp_path / "rtrl.toml", env=env)
    # the salt is read from its file; the ClickHouse password's file is named, and connect() reads it
    assert back.sdk.salt == "value-of-sdk-salt"
    assert back.clickhouse.password_file == str(secrets / "clickhouse-password")
    expected = manifests.deployed_settings(source).updated(
        {"sdk.salt": back.sdk.salt, "clickhouse.password_file": back.clickhouse.password_file}
    )
    assert back == expected
    assert back.kafka.bootstrap == source.kafka.bootstrap and back.model == source.model
    text = "\n".join(p.read_text() for p in deploy.K8S_DIR.rglob("*.yaml"))
    # the Secret's skeleton is outside what `kubectl apply -f deploy/k8s/` applies: re-applying never blanks it
    assert [p for p in _k8s() if any(d["kind"] == "Secret" for d in _k8s()[p])] == ["secret/rtrl-secrets.example.yaml"]
    assert "stand-in" not in text and "password_file" not in toml_text and "salt" not in toml_text
    for d in _all_k8s():
        pod = d.get("spec", {}).get("template", {}).get("spec") or {}
        if d["kind"] == "PyTorchJob":
            pod = d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        if pod:  # the Secret's files: owner root, group fsGroup, readable by the group the containers run as
            volume = next(v for v in pod["volumes"] if "secret" in v)
            assert volume["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == 10001
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            names = {e["name"]: e.get("value") for e in c["env"]}
            assert names["RTRL_CONFIG"] == f"{manifests.CONFIG_DIR}/rtrl.toml"
            assert {k: v for k, v in names.items() if k.endswith("_FILE")} == {
                k: v.replace(str(secrets), manifests.SECRET_DIR) for k, v in env.items()
            }
            assert not [k for k in names if k in ("RTRL_SDK__SALT", "RTRL_CLICKHOUSE__PASSWORD")]


def test_an_empty_secret_file_is_refused_naming_the_fix(tmp_path):
    """The Secret ships with empty values: a deployment that forgot one fails at start, saying which and how."""
    (tmp_path / "sdk-salt").write_text("\n")
    with pytest.raises(ConfigError, match=r"RTRL_SDK__SALT_FILE.*empty.*fix"):
        load_settings(None, env={"RTRL_SDK__SALT_FILE": str(tmp_path / "sdk-salt")})


def test_manifests_are_made_from_any_settings_file(tmp_path):
    """`python -m app.deploy --config FILE` renders a team's own settings (SASL adds its secret) and shape (four
    reward flow processes: four addresses)."""
    cfg = tmp_path / "mine.toml"
    cfg.write_text(
        deploy.SOURCE.read_text()
        .replace('# security_protocol = "SASL_SSL"', 'security_protocol = "SASL_SSL"')
        .replace('# sasl_mechanism = "SCRAM-SHA-512"', 'sasl_mechanism = "SCRAM-SHA-512"')
        .replace('# sasl_username = "rtrl"', 'sasl_username = "rtrl"')
    )
    run = subprocess.run(
        [sys.executable, "-m", "app.deploy", "--config", str(cfg), "--out", str(tmp_path), "--reward-processes", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    docs = list(yaml.safe_load_all((tmp_path / "deploy/k8s/secret/rtrl-secrets.example.yaml").read_text()))
    docs += list(yaml.safe_load_all((tmp_path / "deploy/k8s/00-config.yaml").read_text()))
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert set(secret["stringData"]) == {"sdk-salt", "clickhouse-password", "kafka-sasl-password"}
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    assert 'security_protocol = "SASL_SSL"' in cm["data"]["rtrl.toml"]
    flows = list(yaml.safe_load_all((tmp_path / "deploy/k8s/20-reward-flow.yaml").read_text()))
    sts = next(d for d in flows if d["kind"] == "StatefulSet")
    env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert sts["spec"]["replicas"] == 4 and len(env["BYTEWAX_ADDRESSES"].split(";")) == 4
    assert env["RTRL_KAFKA__SASL_PASSWORD_FILE"] == f"{manifests.SECRET_DIR}/kafka-sasl-password"


def test_the_compose_file_validates_against_the_compose_spec(tmp_path):
    """The compose spec's own JSON schema (vendored by check-jsonschema) accepts the file; it runs the real
    engines' images; its rtrl settings read back and point at them; secrets come from the environment."""
    run = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(deploy.COMPOSE_FILE)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    doc = yaml.safe_load(deploy.COMPOSE_FILE.read_text())
    services = doc["services"]
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["clickhouse"]["image"].startswith("clickhouse/clickhouse-server:")
    assert services["loop"]["depends_on"] == {"setup": {"condition": "service_completed_successfully"}}
    kafka = services["kafka"]  # the broker writes on its volume (apache/kafka's default log dir is under /tmp)
    assert kafka["environment"]["KAFKA_LOG_DIRS"] == kafka["volumes"][0].split(":", 1)[1]
    settings_text = doc["configs"]["rtrl-settings"]["content"]
    (tmp_path / "rtrl.toml").write_text(settings_text)  # read back as the container would, secrets from env
    back = load_settings(
        tmp_path / "rtrl.toml", env={"RTRL_SDK__SALT": "salt-for-the-test", "RTRL_CLICKHOUSE__PASSWORD": "y"}
    )
    assert back.kafka.bootstrap == "kafka:9092" and back.clickhouse.dsn.startswith("http://rtrl@clickhouse:8123")
    assert back.kafka.replication_factor == 1  # one broker
    from app.loop_config import loop_settings

    loop_settings(back)  # the main job takes these settings as they are (it refuses any it would have to change)
    assert set(doc["secrets"]) == {"sdk-salt", "clickhouse-password"}
    assert all("environment" in v for v in doc["secrets"].values())
    assert "${RTRL_CLICKHOUSE_PASSWORD:?" in services["clickhouse"]["environment"]["CLICKHOUSE_PASSWORD"]
    # the schema catches what it is here for
    bad = copy.deepcopy(doc)
    bad["services"]["kafka"]["healthchek"] = {}
    bad_file = tmp_path / "bad.yml"
    bad_file.write_text(yaml.safe_dump(bad))
    run = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(bad_file)],
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0 and "healthchek" in run.stdout + run.stderr


def test_the_dockerfile_copies_every_package_the_project_installs():
    """The image installs the project from the copied folders: each package pyproject.toml finds must be copied."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "deploy" / "Dockerfile").read_text(), re.M))
    assert {p.rstrip("*") for p in include} <= copied


def test_the_mismatch_alert_follows_the_rendered_settings(tmp_path):
    """A deployment that tightens the gate's mismatch limits gets the same limits in its alert, k3 included."""
    cfg = tmp_path / "mine.toml"
    cfg.write_text(deploy.SOURCE.read_text() + "\n[loop]\nmismatch_log_ratio_max = 6.5\nmismatch_k3_max = 0.25\n")
    rules = deploy.prometheus_rules(deploy.source_settings(cfg))
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r["alert"] == "RtrlTrainingInferenceMismatch"]
    assert "> 6.5" in rule["expr"] and "rtrl_trainer_mismatch_k3) > 0.25" in rule["expr"]
    promql_parser.parse(rule["expr"])
    (default,) = [r for r in _rules() if r["alert"] == "RtrlTrainingInferenceMismatch"]
    assert f"> {MismatchRule().max_abs_log_ratio:g}" in default["expr"] and "k3" not in default["expr"]
