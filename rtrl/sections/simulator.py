"""The simulator's section and the policy server's (``serving``: the completions server, the registry, reloads)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import ValidationInfo, field_validator, model_validator

from rtrl.section import Section, redact_dsn, setting


class SimulatorSettings(Section):
    seed: int = setting(0, "random seed; the same seed gives the same events")
    trajectories: int = setting(2000, "trajectories to simulate in one run", gt=0)
    orgs: int = setting(6, "simulated organisations", gt=0)
    users_per_org: int = setting(20, "simulated users in each organisation", gt=0)
    rate: float = setting(0.0, "events per second sent through the SDK; 0 = as fast as possible", ge=0)
    start_ms: int = setting(0, "event time of the first trajectory (ms since epoch); 0 = now", ge=0)
    duplicate_rate: float = setting(0.01, "fraction of events the client sends twice", ge=0, le=1)
    reorder_rate: float = setting(0.02, "fraction of events delivered after their successor", ge=0, le=1)
    late_check_rate: float = setting(0.05, "fraction of persistence checks that arrive hours late", ge=0, le=1)
    long_task_share: float = setting(
        0.0,
        "share of trajectories that are hours-long background tasks (kind 'background') judged by a verdict",
        ge=0,
        le=1,
    )
    long_task_hours: float = setting(3.0, "median event-time length of a background task, hours", gt=0)
    verdict_min_h: float = setting(1.0, "least event-time hours between a background task's end and its verdict", ge=0)
    verdict_max_h: float = setting(48.0, "most event-time hours between a background task's end and its verdict", ge=0)
    verdict_rate: float = setting(0.9, "share of background tasks whose user ever gives a verdict", ge=0, le=1)

    @model_validator(mode="after")
    def _verdict_range(self) -> SimulatorSettings:
        if self.verdict_min_h > self.verdict_max_h:
            raise ValueError(
                f"simulator.verdict_min_h = {self.verdict_min_h} is above simulator.verdict_max_h = "
                f"{self.verdict_max_h}; fix: make the range [verdict_min_h, verdict_max_h] non-empty"
            )
        return self


class ServingSettings(Section):
    url: str = setting(
        "",
        "base URL of the OpenAI-compatible completions server the policy server samples from (vLLM, SGLang), "
        "e.g. http://127.0.0.1:8000/v1; it must serve the promoted version itself; empty = the project's own "
        "server over the policy, in-process on a free loopback port",
    )
    model: str = setting("rtrl-policy", "model name sent with each request (vLLM: --served-model-name)")
    candidate_model: str = setting(
        "rtrl-candidate", "A/B mode (loop.ab_share > 0): the model name under which the server serves the candidate"
    )
    timeout_s: float = setting(30.0, "seconds a completions request may take to connect, and to answer, per try", gt=0)
    retries: int = setting(
        3, "retries of a failed completions request (connection error, timeout, 429, 5xx), with backoff", ge=0
    )
    api_key_file: str = setting(
        "", "file holding the server's API key, sent as a bearer token (vLLM: --api-key); empty = none"
    )
    registry_dir: str = setting(
        "",
        "model registry: each promotion of a Hugging Face model is exported to <registry_dir>/v<N> (safetensors, "
        "config.json, rtrl.json with its content hash), what a fleet loads; empty = <data_dir>/registry",
    )
    reload_api: Literal["sglang", "vllm"] = setting(
        "sglang",
        "weight-reload API of the inference server `rtrl fleet follow` drives: sglang (POST "
        "/update_weights_from_disk; the project's own server too) or vllm (POST /collective_rpc reload_weights, "
        "needs VLLM_SERVER_DEV_MODE=1)",
    )
    reload_url: str = setting(
        "",
        "base URL of that server's reload endpoint, e.g. http://127.0.0.1:30000; empty = serving.url without /v1",
    )
    reload_timeout_s: float = setting(
        600.0, "seconds one weight reload may take, per try (a large model loads for minutes)", gt=0
    )

    @field_validator("url", "reload_url")
    @classmethod
    def _url(cls, v: str, info: ValidationInfo) -> str:
        if not v:
            return v
        try:
            parts = urlsplit(v)
            parts.port  # noqa: B018 - raises on a port outside 1..65535 or not a number
        except ValueError:
            raise ValueError(f"has a bad port in {redact_dsn(v)!r}: a port is 1..65535") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            form = "http(s)://host:port/v1" if info.field_name == "url" else "http(s)://host:port"
            raise ValueError(f"must be {form}, not {redact_dsn(v)!r}")
        return v
