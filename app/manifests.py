"""Kubernetes manifests and a docker-compose file made from the settings tree (issue 18): how the parts run on the
engines a team already has.

- **Kubernetes** (``deploy/k8s/``): the settings as a ConfigMap (``rtrl.toml``, :func:`rtrl.settings.settings_toml`:
  no secret in it); the salt and passwords only in a Secret (its skeleton in ``secret/``, outside the applied
  folder), mounted read-only and named by ``RTRL_..._FILE`` variables; the reward flow and the batch flow as Bytewax clusters (a StatefulSet each, ``podManagementPolicy:
  Parallel`` so every process starts together, a recovery volume per pod, and the addressing ``bytewax.run -i/-a``
  reads: ``BYTEWAX_POD_NAME``, ``BYTEWAX_STATEFULSET_NAME``, ``BYTEWAX_ADDRESSES`` over a headless Service that
  publishes not-ready pods); the trainer as a Kubeflow PyTorchJob (``torchrun -m trainer`` on every node, the
  operator's ``PET_*`` variables giving it the nodes, ranks and master); topics and migrations as a Job. Every
  long-running container has liveness ``/healthz`` and readiness ``/readyz`` probes on its metrics port
  (:mod:`rtrl.metrics`) and the ``prometheus.io`` scrape annotations.
- **docker-compose** (``deploy/compose/docker-compose.yml``): one host with a real Kafka (``apache/kafka``, KRaft)
  and a real ClickHouse server (``clickhouse/clickhouse-server``) in place of the embedded stand-ins; a setup
  service makes the topics and applies the migrations, then ``rtrl run`` runs the main job (the closed loop on
  the defaults) on them. Secrets come from the environment (``.env``) as compose secrets.

Each part with a ``workload`` in :data:`app.parts.PART_LIST` gets its file: :data:`WORKLOADS` makes its kind's
resources. Its name and its replicas' :class:`Shape` field come from the part. A part without one is not deployed.

The embedded ClickHouse front (:mod:`devservices.chserver`) is not deployed: it binds loopback only, by design (a
dev stand-in for one machine); a cluster runs a ClickHouse server (the compose file's, or an operator's on
Kubernetes) and ``clickhouse.dsn`` names it. Made by ``python -m app.deploy [--config FILE] [--out DIR]`` from
``deploy/production.example.toml`` (tests/test_deploy.py checks the committed files and validates them offline).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.parts import PART_LIST, Part, Workload
from rtrl.settings import Settings, settings_toml

#: where a container finds the settings (the ConfigMap) and the secrets (the Secret's files)
CONFIG_DIR = "/etc/rtrl"
SECRET_DIR = "/etc/rtrl-secrets"  # a sibling of the ConfigMap's mount, not inside it
DATA_DIR = "/var/lib/rtrl"
METRICS_PORT = 9400
BYTEWAX_PORT = 2101
APP = "rtrl"

#: secret setting -> (key in the Secret, the variable that names its file)
SECRET_KEYS = {
    "sdk.salt": ("sdk-salt", "RTRL_SDK__SALT_FILE"),
    "clickhouse.password": ("clickhouse-password", "RTRL_CLICKHOUSE__PASSWORD_FILE"),
    "kafka.sasl_password": ("kafka-sasl-password", "RTRL_KAFKA__SASL_PASSWORD_FILE"),
    "kafka.oauth_client_secret": ("kafka-oauth-client-secret", "RTRL_KAFKA__OAUTH_CLIENT_SECRET_FILE"),
    "kafka.ssl_key_password": ("kafka-ssl-key-password", "RTRL_KAFKA__SSL_KEY_PASSWORD_FILE"),
}


@dataclass(frozen=True)
class Shape:
    """What the settings do not say about a cluster: names, sizes and the image."""

    namespace: str = "rtrl"
    image: str = "rtrl:0.1.0"  # built from deploy/Dockerfile (CPU torch): the flows and the setup Job
    trainer_image: str = (
        "rtrl-gpu:0.1.0"  # deploy/Dockerfile with the GPU build arguments (CUDA torch, Transformer Engine)
    )
    reward_processes: int = 2  # Bytewax processes (pods) of the reward flow
    batch_processes: int = 1
    workers_per_process: int = 1
    trainer_nodes: int = 2
    gpus_per_node: int = 8
    recovery_storage: str = "20Gi"
    checkpoint_storage: str = "2Ti"
    storage_class: str = ""  # empty = the cluster's default


def secrets_needed(settings: Settings) -> list[str]:
    """The secret settings this deployment reads: the salt always, the others as the connections use them."""
    k, ch = settings.kafka, settings.clickhouse
    out = ["sdk.salt"]
    if not ch.dsn.startswith("chdb://"):
        out.append("clickhouse.password")
    if k.security_protocol.startswith("SASL"):
        out.append("kafka.oauth_client_secret" if k.sasl_mechanism == "OAUTHBEARER" else "kafka.sasl_password")
    if k.ssl_key_location:
        out.append("kafka.ssl_key_password")
    return out


def deployed_settings(settings: Settings) -> Settings:
    """The settings as every container sees them: state under DATA_DIR (recovery and window state on the pod's
    volume, checkpoints on the shared one), the metrics endpoint on every interface, the ClickHouse password from
    the Secret's file (so not from a path of the source file)."""
    return settings.updated(
        {
            "data_dir": DATA_DIR,
            "flow.recovery_dir": "",
            "flow.state_dir": "",
            "batching.recovery_dir": "",
            "train.checkpoint_dir": f"{DATA_DIR}/checkpoints",
            "metrics.port": METRICS_PORT,
            "metrics.host": "0.0.0.0",
            "clickhouse.password_file": "",
            "clickhouse.password": "",
        }
    )


def _labels(component: str) -> dict[str, str]:
    """A resource's labels, and its pods' selector."""
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component}


def _meta(name: str, shape: Shape, component: str, **extra: Any) -> dict:
    return {"name": name, "namespace": shape.namespace, "labels": _labels(component), **extra}


def _env(settings: Settings) -> list[dict]:
    """The settings file, and each secret by its file: nothing secret in the environment itself."""
    out = [{"name": "RTRL_CONFIG", "value": f"{CONFIG_DIR}/rtrl.toml"}]
    out += [{"name": SECRET_KEYS[s][1], "value": f"{SECRET_DIR}/{SECRET_KEYS[s][0]}"} for s in secrets_needed(settings)]
    return out


def _mounts() -> list[dict]:
    return [
        {"name": "settings", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "secrets", "mountPath": SECRET_DIR, "readOnly": True},
    ]


def _config_volumes() -> list[dict]:
    return [
        {"name": "settings", "configMap": {"name": "rtrl-settings"}},
        # owner root, group fsGroup (the containers run as that group): readable by the group only
        {"name": "secrets", "secret": {"secretName": "rtrl-secrets", "defaultMode": 0o440}},
    ]


def _probes(startup_s: int = 300, ready: bool = True) -> dict:
    """Liveness on /healthz (after a startup allowance of ``startup_s``), readiness on /readyz."""

    def probe(path: str, period: int, failures: int) -> dict:
        return {
            "httpGet": {"path": path, "port": "metrics"},
            "periodSeconds": period,
            "failureThreshold": failures,
            "timeoutSeconds": 5,
        }

    out = {
        "startupProbe": probe("/healthz", 5, startup_s // 5),  # imports and the broker check take a while
        "livenessProbe": probe("/healthz", 15, 4),
    }
    return out | {"readinessProbe": probe("/readyz", 10, 3)} if ready else out


def _scrape() -> dict:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT), "prometheus.io/path": "/metrics"}


def _security() -> dict:
    return {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> dict:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def config(settings: Settings, shape: Shape) -> list[dict]:
    """The namespace and the ConfigMap of the settings."""
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": shape.namespace}},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta("rtrl-settings", shape, "settings"),
            "data": {"rtrl.toml": settings_toml(deployed_settings(settings))},
        },
    ]


def secret(settings: Settings, shape: Shape) -> list[dict]:
    """The Secret's skeleton: its keys, empty. Kept out of the folder ``kubectl apply -f deploy/k8s/`` applies, so
    applying it again never blanks the secrets an operator filled in; rtrl refuses an empty one at start."""
    secret_keys = {SECRET_KEYS[s][0]: "" for s in secrets_needed(settings)}
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta(
                "rtrl-secrets",
                shape,
                "settings",
                annotations={
                    "rtrl/fill-in": "every value, e.g. kubectl -n "
                    f"{shape.namespace} create secret generic rtrl-secrets "
                    + " ".join(f"--from-file={k}=./{k}" for k in secret_keys)
                    + "; rtrl refuses an empty one"
                },
            ),
            "type": "Opaque",
            "stringData": secret_keys,
        },
    ]


def _replicas(shape: Shape, workload: Workload) -> int:
    """The pods or nodes ``workload`` has: the shape's field it names."""
    return int(getattr(shape, workload.replicas))


def flow(settings: Settings, shape: Shape, part: Part) -> list[dict]:
    """A Bytewax cluster of one flow part: a headless Service for the processes' addresses and a StatefulSet."""
    if part.workload is None:
        raise ValueError(f"part {part.name} is not deployed")
    name, sts, processes = part.name, part.workload.name, _replicas(shape, part.workload)
    addresses = ";".join(f"{sts}-{i}.{sts}:{BYTEWAX_PORT}" for i in range(processes))
    env = _env(settings) + [
        {"name": "BYTEWAX_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "BYTEWAX_STATEFULSET_NAME", "value": sts},
        {"name": "BYTEWAX_ADDRESSES", "value": addresses},
    ]
    labels = _labels(sts)
    claim: dict[str, Any] = {
        "metadata": {"name": "state"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": shape.recovery_storage}}},
    }
    if shape.storage_class:
        claim["spec"]["storageClassName"] = shape.storage_class
    state_mount, claims = [], {}
    if part.workload.recovery_volume:  # the recovery folder (and spilled window state) of each process
        state_mount, claims = [{"name": "state", "mountPath": DATA_DIR}], {"volumeClaimTemplates": [claim]}
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(sts, shape, sts),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,  # the processes find each other before they are ready
                "selector": labels,
                "ports": [
                    {"name": "bytewax", "port": BYTEWAX_PORT, "targetPort": BYTEWAX_PORT},
                    {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT},
                ],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": _meta(sts, shape, sts),
            "spec": {
                "serviceName": sts,
                "replicas": processes,
                # a Bytewax cluster starts (and resumes) with all its processes: never one at a time
                "podManagementPolicy": "Parallel",
                # ... and is upgraded whole: a rolling update would stop one process while its peers go on (it
                # cannot finish a clean stop alone) and mix two images in one cluster. Delete the pods together.
                "updateStrategy": {"type": "OnDelete"},
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels, "annotations": _scrape()},
                    "spec": {
                        "securityContext": _security(),
                        "terminationGracePeriodSeconds": 120,  # SIGTERM: a clean stop with a final snapshot
                        "containers": [
                            {
                                "name": "flow",
                                "image": shape.image,
                                "command": ["rtrl", "flow", name, "--workers", str(shape.workers_per_process)],
                                "env": env,
                                "ports": [
                                    {"name": "bytewax", "containerPort": BYTEWAX_PORT},
                                    {"name": "metrics", "containerPort": METRICS_PORT},
                                ],
                                "volumeMounts": [*_mounts(), *state_mount],
                                "resources": {
                                    "requests": {"cpu": str(shape.workers_per_process), "memory": "2Gi"},
                                    "limits": {"memory": "8Gi"},
                                },
                                "securityContext": _container_security(),
                                **_probes(),
                            }
                        ],
                        "volumes": _config_volumes(),
                    },
                },
                **claims,
            },
        },
    ]


def trainer(settings: Settings, shape: Shape, part: Part) -> list[dict]:
    """The trainer as a Kubeflow PyTorchJob: ``torchrun -m trainer`` on each node; the training operator sets
    ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` and ``PET_MASTER_ADDR/PORT``, which torchrun reads.
    Checkpoints go to a volume every node shares (ReadWriteMany)."""
    if part.workload is None:
        raise ValueError(f"part {part.name} is not deployed")
    nodes = _replicas(shape, part.workload)
    claim: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta("rtrl-checkpoints", shape, "trainer"),
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": shape.checkpoint_storage}}},
    }
    if shape.storage_class:
        claim["spec"]["storageClassName"] = shape.storage_class
    labels = _labels("trainer")

    def replica(n: int) -> dict:
        return {
            "replicas": n,
            "restartPolicy": "OnFailure",  # a restarted trainer resumes from its step checkpoint
            "template": {
                "metadata": {"labels": labels, "annotations": _scrape()},
                "spec": {
                    "securityContext": _security(),
                    "containers": [
                        {
                            "name": "pytorch",  # the name the training operator looks for
                            "image": shape.trainer_image,
                            "command": ["torchrun", "-m", "trainer"],
                            "env": _env(settings),
                            "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
                            "volumeMounts": [
                                *_mounts(),
                                {"name": "checkpoints", "mountPath": f"{DATA_DIR}/checkpoints"},
                                {"name": "shm", "mountPath": "/dev/shm"},
                            ],
                            "resources": {
                                "requests": {
                                    "cpu": "16",
                                    "memory": "256Gi",
                                    "nvidia.com/gpu": str(shape.gpus_per_node),
                                },
                                "limits": {"nvidia.com/gpu": str(shape.gpus_per_node)},
                            },
                            "securityContext": _container_security(),
                            # local rank 0 of each node serves metrics.port (rank r: port + r): probed; loading
                            # a large model's checkpoint takes long, hence the startup allowance
                            **_probes(startup_s=1800, ready=False),
                        }
                    ],
                    "volumes": [
                        *_config_volumes(),
                        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "rtrl-checkpoints"}},
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
                    ],
                },
            },
        }

    specs = {"Master": replica(1)}
    if nodes > 1:
        specs["Worker"] = replica(nodes - 1)
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _meta(part.workload.name, shape, "trainer"),
        "spec": {
            "nprocPerNode": str(shape.gpus_per_node),
            "runPolicy": {"backoffLimit": 20, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }
    return [claim, job]


def setup_job(settings: Settings, shape: Shape) -> list[dict]:
    """Topics, then migrations and verification, as a Job (idempotent: run it on every upgrade)."""

    def container(name: str, command: list[str]) -> dict:
        return {
            "name": name,
            "image": shape.image,
            "command": command,
            "env": _env(settings),
            "volumeMounts": _mounts(),
            "securityContext": _container_security(),
        }

    return [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": _meta("rtrl-setup", shape, "setup"),
            "spec": {
                "backoffLimit": 6,
                "ttlSecondsAfterFinished": 86400,
                "template": {
                    "metadata": {"labels": _labels("setup")},
                    "spec": {
                        "restartPolicy": "OnFailure",
                        "securityContext": _security(),
                        "initContainers": [container("topics", ["rtrl", "topics"])],
                        "containers": [container("migrate", ["rtrl", "migrate"])],
                        "volumes": _config_volumes(),
                    },
                },
            },
        }
    ]


def retention_cronjob(settings: Settings, shape: Shape) -> list[dict]:
    """`rtrl retention apply` on ``retention.schedule``: the TTLs follow the settings, the archive's old days go."""
    container = {
        "name": "retention",
        "image": shape.image,
        "command": ["rtrl", "retention", "apply"],
        "env": _env(settings),
        # the trainer's shared checkpoints: the versions retention does not keep are deleted there
        "volumeMounts": [*_mounts(), {"name": "checkpoints", "mountPath": f"{DATA_DIR}/checkpoints"}],
        "securityContext": _container_security(),
    }
    return [
        {
            "apiVersion": "batch/v1",
            "kind": "CronJob",
            "metadata": _meta("rtrl-retention", shape, "retention"),
            "spec": {
                "schedule": settings.retention.schedule,
                "concurrencyPolicy": "Forbid",  # a slow run is never joined by the next
                "successfulJobsHistoryLimit": 3,
                "failedJobsHistoryLimit": 3,
                "jobTemplate": {
                    "spec": {
                        "backoffLimit": 3,
                        "ttlSecondsAfterFinished": 86400,
                        "template": {
                            "metadata": {"labels": _labels("retention")},
                            "spec": {
                                "restartPolicy": "OnFailure",
                                "securityContext": _security(),
                                "containers": [container],
                                "volumes": [
                                    *_config_volumes(),
                                    {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "rtrl-checkpoints"}},
                                ],
                            },
                        },
                    }
                },
            },
        }
    ]


#: a part's workload kind -> what makes its resources
WORKLOADS: dict[str, Callable[[Settings, Shape, Part], list[dict]]] = {"StatefulSet": flow, "PyTorchJob": trainer}


def kubernetes(settings: Settings, shape: Shape = Shape()) -> dict[str, list[dict]]:
    """File name (under deploy/k8s) -> its resources, in the order to apply them (``secret/``: not applied with
    the folder; the Secret is created once, filled, by the operator)."""
    out = {
        "00-config.yaml": config(settings, shape),
        "secret/rtrl-secrets.example.yaml": secret(settings, shape),
        "10-setup-job.yaml": setup_job(settings, shape),
    }
    for part in PART_LIST:  # each deployed part as its workload's kind runs it
        if part.workload is not None:
            out[part.workload.file] = WORKLOADS[part.workload.kind](settings, shape, part)
    return out | {"50-retention-cronjob.yaml": retention_cronjob(settings, shape)}


# ---------------------------------------------------------------- docker-compose

KAFKA_IMAGE = "apache/kafka:3.9.1"
CLICKHOUSE_IMAGE = "clickhouse/clickhouse-server:25.3"


def compose_settings(settings: Settings | None = None) -> Settings:
    """The settings of the compose file's rtrl containers: the main job's (the defaults: ``rtrl run`` refuses a
    model or trainer setting it would have to change) on the compose file's Kafka and ClickHouse. The salt here
    is a stand-in that satisfies the check for services off loopback; it is never written (the container reads
    the real one from its compose secret)."""
    settings = (settings or Settings()).updated({"sdk.salt": "stand-in"})
    plain = type(settings.kafka)()  # the compose file's broker speaks PLAINTEXT: no TLS or SASL setting
    security = {
        f"kafka.{k}": getattr(plain, k)
        for k in type(plain).model_fields
        if k == "security_protocol" or k.startswith(("ssl_", "sasl_", "oauth_"))
    }
    return settings.updated(
        security
        | {
            "data_dir": DATA_DIR,
            "kafka.bootstrap": "kafka:9092",
            "kafka.replication_factor": 1,
            "kafka.min_insync_replicas": 1,
            "clickhouse.dsn": "http://rtrl@clickhouse:8123/",
            "clickhouse.password_file": "",
            "clickhouse.password": "",
            "clickhouse.ca_cert": "",
            "metrics.port": METRICS_PORT,
            "metrics.host": "0.0.0.0",
        }
    )


def compose(settings: Settings | None = None, shape: Shape = Shape()) -> dict:
    """One host: apache/kafka (KRaft, one node), clickhouse/clickhouse-server, a setup service (topics and
    migrations) and the closed loop (``rtrl run``) on them. Secrets: ``RTRL_SDK_SALT`` and
    ``RTRL_CLICKHOUSE_PASSWORD`` in the environment or ``.env``, handed to rtrl as compose secrets (files)."""
    s = compose_settings(settings)
    rtrl_env = {"RTRL_CONFIG": "/etc/rtrl/rtrl.toml"} | {
        SECRET_KEYS[k][1]: f"/run/secrets/{SECRET_KEYS[k][0]}" for k in ("sdk.salt", "clickhouse.password")
    }

    def rtrl(args: list[str], depends: dict) -> dict:
        return {
            "image": shape.image,
            "build": {"context": "../..", "dockerfile": "deploy/Dockerfile"},
            "command": args,
            "environment": rtrl_env,
            "configs": [{"source": "rtrl-settings", "target": "/etc/rtrl/rtrl.toml"}],
            "secrets": [SECRET_KEYS["sdk.salt"][0], SECRET_KEYS["clickhouse.password"][0]],
            "volumes": ["rtrl-data:/var/lib/rtrl"],
            "depends_on": depends,
        }

    kafka_env = {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": "PLAINTEXT://:9092,CONTROLLER://:9093",
        "KAFKA_ADVERTISED_LISTENERS": "PLAINTEXT://kafka:9092",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@kafka:9093",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",  # rtrl topics makes them, with their partitions
        "KAFKA_LOG_DIRS": "/var/lib/kafka/data",  # on the named volume (the image's default is under /tmp)
    }
    return {
        "name": "rtrl",
        "services": {
            "kafka": {
                "image": KAFKA_IMAGE,
                "environment": kafka_env,
                "volumes": ["kafka-data:/var/lib/kafka/data"],
                "healthcheck": {
                    "test": [
                        "CMD-SHELL",
                        "/opt/kafka/bin/kafka-broker-api-versions.sh --bootstrap-server localhost:9092 >/dev/null",
                    ],
                    "interval": "5s",
                    "timeout": "10s",
                    "retries": 30,
                },
            },
            "clickhouse": {
                "image": CLICKHOUSE_IMAGE,
                "environment": {
                    "CLICKHOUSE_DB": s.clickhouse.database,
                    "CLICKHOUSE_USER": "rtrl",
                    "CLICKHOUSE_PASSWORD": "${RTRL_CLICKHOUSE_PASSWORD:?set RTRL_CLICKHOUSE_PASSWORD (e.g. in .env)}",
                    "CLICKHOUSE_DEFAULT_ACCESS_MANAGEMENT": "1",
                },
                "ports": ["8123:8123"],
                "volumes": ["clickhouse-data:/var/lib/clickhouse"],
                "ulimits": {"nofile": {"soft": 262144, "hard": 262144}},
                "healthcheck": {
                    "test": ["CMD-SHELL", "wget -q --spider http://localhost:8123/ping"],
                    "interval": "5s",
                    "timeout": "5s",
                    "retries": 30,
                },
            },
            "setup": rtrl(
                ["sh", "-c", "rtrl topics && rtrl migrate"],
                {"kafka": {"condition": "service_healthy"}, "clickhouse": {"condition": "service_healthy"}},
            ),
            "loop": rtrl(["rtrl", "run"], {"setup": {"condition": "service_completed_successfully"}})
            | {"ports": [f"{METRICS_PORT}:{METRICS_PORT}"]},
        },
        "configs": {"rtrl-settings": {"content": settings_toml(s)}},
        "secrets": {
            SECRET_KEYS["sdk.salt"][0]: {"environment": "RTRL_SDK_SALT"},
            SECRET_KEYS["clickhouse.password"][0]: {"environment": "RTRL_CLICKHOUSE_PASSWORD"},
        },
        "volumes": {"kafka-data": {}, "clickhouse-data": {}, "rtrl-data": {}},
    }
