"""The fleet side of a promotion: follow ``rtrl.deployments``, check the promoted version's export, and have an
inference server load it.

A promotion of a Hugging Face model is exported to the model registry (:mod:`trainer.registry`) as a folder,
``<serving.registry_dir>/v<N>/``: ``config.json``, ``model.safetensors`` (or shards plus an index), the source's
tokenizer files, and ``rtrl.json`` (version, parent, reward version, eval results, created_at, the files and their
hashes, the content hash). The ``Checkpoint`` announced on ``rtrl.deployments`` names it in ``export_path`` and
its content hash in ``export_sha256``.

**The content hash** (:func:`content_sha256`) is the sha256 of the text ``sha256sum`` prints for every regular
file directly in the folder except ``rtrl.json``, in byte order of the names: one line ``<hex sha256 of the
file>  <name>\\n`` per file (two spaces). So a fleet can check an export with coreutils alone::

    cd /registry/v3 && ls -A | grep -vx rtrl.json | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum

A folder with a subfolder, or a name holding a newline or a backslash (which ``sha256sum`` would escape), has no
content hash: :func:`content_sha256` refuses it, and the registry never writes one.

:class:`ReloadClient` asks an inference server to load an export, over HTTP, with one of two APIs
(``serving.reload_api``):

``sglang``  ``POST {root}/update_weights_from_disk`` ``{"model_path": P, "weight_version": "vN"}``: SGLang's native
            API (``UpdateWeightFromDiskReqInput``); 200 ``{"success": true, "message", "num_paused_requests"}``, 400
            with ``success`` false and the reason. The project's own server (:mod:`simulator.openai_server`) answers
            the same endpoint.
``vllm``    ``POST {root}/collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path": P}}``: vLLM's
            development endpoint (only with ``VLLM_SERVER_DEV_MODE=1``) calling every worker's
            ``reload_weights(weights_path=...)``, which loads the checkpoint folder in place; 200 when done.

``root`` is the server's base URL without ``/v1``. A reload may take long (``timeout_s`` per try, 600 s by
default: a large model reads for minutes) and is retried with backoff on connection errors, timeouts and 5xx
(loading the same folder twice is harmless); what still fails is one line naming the URL.

:class:`FleetFollower` reads ``rtrl.deployments`` from its start (one partition, so in order) and serves what
the policy server (:mod:`simulator.serve`) serves: the newest ``promoted`` announcement of a version whose latest
status is not ``rolled_back`` (a rollback arrives as ``rolled_back`` for the bad version and the re-promotion of
its parent, so the fleet re-points to the parent's export). Before each reload it checks the export's content
hash against the announcement; a mismatch (a tampered, half-copied or replaced folder) is refused, nothing is
loaded, and the server keeps serving what it served.

**Per-org adapters** (issue 17): an announcement with an ``org`` is that org's LoRA adapter decision, its
``export_path`` a PEFT folder (:func:`trainer.registry.export_adapter`). The follower keeps each org on its newest
promoted adapter that was not rolled back and was validated on the base the server serves (``base_version``),
hash-checked like a model export, loaded under :func:`adapter_model_name` through the runtime LoRA API
(:meth:`ReloadClient.load_adapter`: vLLM's ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``, needs
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; SGLang's ``POST /load_lora_adapter``); the version
it replaces is unloaded after. An org whose adapter is rolled back, or not validated on the new base, is served
the base alone: its adapter is unloaded. Requests for an org name its adapter's model name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from client.rollouts import _error_message, json_pool, send_json
from rtrl.errors import RtrlError, ServiceUnavailable
from rtrl.kafka import base_config
from schemas.codec import Invalid, JsonCodec
from schemas.records import Checkpoint

log = logging.getLogger(__name__)

#: the metadata file of an export; the only file the content hash leaves out
METADATA = "rtrl.json"
ReloadApi = Literal["sglang", "vllm"]
RELOAD_APIS: tuple[str, ...] = ("sglang", "vllm")
_CHUNK = 1 << 20


class ExportMismatch(RtrlError):
    """An export's files do not have the content hash the announcement names (or cannot be read)."""


class ReloadError(RtrlError):
    """The inference server answered a reload with an error; the message names the URL and the reason."""


# --------------------------------------------------------------------------- the content hash


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of one file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hashed_files(folder: str | Path) -> list[str]:
    """The names the content hash covers: every regular file directly in ``folder`` but ``rtrl.json``, in byte
    order of the names. A subfolder, a link or a name ``sha256sum`` would escape (newline, backslash) is refused."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportMismatch(f"export {folder} is not a folder")
    names = []
    for entry in folder.iterdir():
        if entry.name == METADATA:
            continue
        if entry.is_symlink() or not entry.is_file():
            raise ExportMismatch(f"export {folder} holds {entry.name}, which is not a regular file")
        if "\n" in entry.name or "\\" in entry.name:
            raise ExportMismatch(f"export {folder} holds a file whose name has a newline or backslash")
        names.append(entry.name)
    return sorted(names, key=lambda n: n.encode())


def file_digests(folder: str | Path) -> dict[str, dict[str, Any]]:
    """``{name: {"sha256": hex, "bytes": size}}`` of the files the content hash covers, in its order."""
    folder = Path(folder)
    return {n: {"sha256": file_sha256(folder / n), "bytes": (folder / n).stat().st_size} for n in hashed_files(folder)}


def manifest_sha256(digests: dict[str, dict[str, Any]]) -> str:
    """The content hash of files whose digests are known: sha256 of their ``sha256sum`` lines, by name."""
    lines = "".join(f"{digests[n]['sha256']}  {n}\n" for n in sorted(digests, key=lambda n: n.encode()))
    return hashlib.sha256(lines.encode()).hexdigest()


def content_sha256(folder: str | Path) -> str:
    """The content hash of an export folder (the module docstring defines it)."""
    return manifest_sha256(file_digests(folder))


def verify_export(path: str | Path, sha256: str) -> None:
    """Raise :class:`ExportMismatch` (one line naming the folder and both hashes) unless the files of ``path``
    have the content hash ``sha256``."""
    try:
        got = content_sha256(path)
    except OSError as e:
        raise ExportMismatch(f"export {path} cannot be read ({e.strerror or e}); nothing was loaded") from None
    if got != sha256:
        raise ExportMismatch(
            f"export {path} has content hash {got}, the announcement says {sha256}: its files changed after the "
            "export (tampered, half-copied or replaced); refused, nothing was loaded"
        )


def read_metadata(path: str | Path) -> dict[str, Any]:
    """An export's ``rtrl.json``."""
    return json.loads((Path(path) / METADATA).read_text())


# --------------------------------------------------------------------------- the reload endpoint


def server_root(url: str) -> str:
    """``http://host:8000/v1`` (what ``serving.url`` holds) -> ``http://host:8000``: where the reload endpoints are."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"an inference server URL is http(s)://host:port[/v1], not {url!r}")
    root = url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class ReloadClient:
    """Asks one inference server at ``url`` (``/v1`` or not) to load an export, with ``api`` ``sglang`` or
    ``vllm`` (the module docstring shows the requests). Each try may take ``connect_timeout_s`` to connect and
    ``timeout_s`` to answer; ``retries`` more tries follow connection errors, timeouts and 5xx, with exponential
    backoff from ``backoff_s``. ``api_key`` is sent as a bearer token (SGLang's ``--api-key`` /
    ``--admin-api-key``, vLLM's ``--api-key``)."""

    def __init__(
        self,
        url: str,
        api: ReloadApi = "sglang",
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retries: int = 2,
        backoff_s: float = 1.0,
        api_key: str | None = None,
    ):
        if api not in RELOAD_APIS:
            raise ValueError(f"reload api must be one of {', '.join(RELOAD_APIS)}, not {api!r}")
        self.root, self.api, self.timeout_s, self.retries = server_root(url), api, timeout_s, retries
        self.endpoint = f"{self.root}/update_weights_from_disk" if api == "sglang" else f"{self.root}/collective_rpc"
        self._http = json_pool(
            retries=retries,
            backoff_s=backoff_s,
            backoff_max_s=30.0,
            methods=frozenset({"POST"}),  # loading the same folder again is harmless
            connect_s=connect_timeout_s,
            read_s=timeout_s,
            api_key=api_key,
            pools=1,
            connections=1,
        )

    def body(self, path: str, version: int | None = None) -> dict[str, Any]:
        """The request body that loads ``path``."""
        if self.api == "sglang":
            return {"model_path": path} | ({"weight_version": f"v{version}"} if version is not None else {})
        return {"method": "reload_weights", "kwargs": {"weights_path": path}}

    def reload(self, path: str | Path, version: int | None = None) -> str:
        """Load the export folder ``path`` (as the server sees it: give the path on the server's file system);
        returns the server's message. :class:`ServiceUnavailable` when it cannot be reached, :class:`ReloadError`
        when it answers with an error."""
        where = self.endpoint
        resp = send_json(
            self._http,
            "POST",
            where,
            self.body(str(path), version),
            what=f"inference server at {where}",
            tries=self.retries + 1,
            timeout_s=self.timeout_s,
            action=f" a reload of {path}",
        )
        text = resp.data.decode("utf-8", "replace")
        if resp.status == 404:
            hint = (
                "start vLLM with VLLM_SERVER_DEV_MODE=1 (the endpoint exists only in development mode)"
                if self.api == "vllm"
                else "is it SGLang (or rtrl's own server)? else set serving.reload_api"
            )
            raise ReloadError(f"inference server at {where} has no reload endpoint (404); fix: {hint}")
        if resp.status >= 400:
            raise ReloadError(f"inference server at {where} refused to load {path} ({resp.status}): {_detail(text)}")
        if self.api == "sglang":
            try:
                answer = json.loads(text)
            except ValueError:
                answer = None
            if not isinstance(answer, dict) or answer.get("success") is not True:
                raise ReloadError(f"inference server at {where} did not load {path}: {_detail(text)}")
            return str(answer.get("message", ""))
        return text[:200]

    def _lora(self, action: str, body: dict[str, Any]) -> tuple[int, str]:
        where = f"{self.root}/v1/{action}" if self.api == "vllm" else f"{self.root}/{action}"
        resp = send_json(
            self._http,
            "POST",
            where,
            body,
            what=f"inference server at {where}",
            tries=self.retries + 1,
            timeout_s=self.timeout_s,
            action=f" {action} {body.get('lora_name')}",
        )
        return resp.status, resp.data.decode("utf-8", "replace")

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Serve the PEFT LoRA folder ``path`` as model ``name`` (runtime LoRA API, module docstring). Loading a
        name the server already holds (a retried request that did land) is not an error."""
        status, text = self._lora("load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        if status == 404 and "already" not in text:
            raise ReloadError(
                f"inference server at {self.root} has no runtime LoRA endpoint (404); fix: vLLM needs --enable-lora "
                "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
            )
        if status >= 400 and "already" not in text:
            raise ReloadError(f"inference server at {self.root} refused adapter {name} ({status}): {_detail(text)}")

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` (a name the server does not hold: nothing to do)."""
        status, text = self._lora("unload_lora_adapter", {"lora_name": name})
        if status >= 400 and status != 404:
            raise ReloadError(
                f"inference server at {self.root} did not unload adapter {name} ({status}): {_detail(text)}"
            )

    def close(self) -> None:
        self._http.clear()


def _detail(text: str) -> str:
    """SGLang's ``{"success": false, "message"}``, vLLM's ``{"detail"}`` or ``{"error": ...}``; else the text."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300] or "(empty body)"
    if isinstance(body, dict) and "message" in body and "error" not in body:
        return str(body["message"])[:300]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])[:300]
    return _error_message(text)


# --------------------------------------------------------------------------- following rtrl.deployments


def adapter_model_name(model: str, org: str, version: int) -> str:
    """The model name under which a server serves ``org``'s adapter version ``version`` over base model ``model``
    (a request for the org names it): versioned, so the new version loads before the old one leaves."""
    return f"{model}-{org}-a{version}"


@dataclass(frozen=True)
class Served:
    """What the server loaded: the version, its export folder and content hash."""

    version: int
    path: str
    sha256: str


class FleetFollower:
    """Follows ``topic`` (``rtrl.deployments``) on ``bootstrap`` and keeps the inference server behind ``engine``
    on the newest promotion that was not rolled back (the module docstring says which). ``served`` is what the
    server serves when this follower starts (None: unknown, the first target is loaded). ``path_map`` turns an
    announced export path into the path the server reads (a shared volume mounted elsewhere); default as is.

    :meth:`poll` reads what is new and reloads when the target changed; :meth:`run` polls until a stop event.
    A refused export (hash mismatch), an announcement without an export and a failed reload are logged in one
    line each (once per target) and leave the server on what it serves; a refused or failed target is tried
    again after ``retry_s`` (a copy still arriving, a server restarting), one without an export never."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        engine: ReloadClient,
        *,
        served: Served | None = None,
        path_map: Callable[[str], str] | None = None,
        retry_s: float = 30.0,
        model_name: str = "rtrl-policy",
    ):
        self.engine, self.topic, self.served = engine, topic, served
        self.path_map = path_map or (lambda p: p)
        self.retry_s = retry_s
        self.codec: JsonCodec[Checkpoint] = JsonCodec(Checkpoint)
        self.latest: dict[int, str] = {}  # version -> its latest status
        self.promotions: list[Checkpoint] = []  # promoted announcements, in order
        self.refused: dict[tuple[int, str, str], str] = {}  # target -> why it was not loaded
        self._failed_at: dict[tuple[int, str, str], float] = {}
        self.model_name = model_name  # the base model's served name: adapters are named after it
        self.adapter_status: dict[tuple[str, int], str] = {}  # (org, adapter version) -> its latest status
        self.adapter_promotions: dict[str, list[Checkpoint]] = {}  # per org, its promoted announcements in order
        self.adapters: dict[str, tuple[int, str]] = {}  # per org: (adapter version, model name) loaded
        self.consumer = Consumer(
            base_config(bootstrap) | {"group.id": f"rtrl-fleet-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False}
        )
        self.consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])

    def target(self) -> Checkpoint | None:
        """The promotion to serve: the newest ``promoted`` announcement whose version was not rolled back since."""
        for ck in reversed(self.promotions):
            if self.latest.get(ck.version) == "promoted":
                return ck
        return None

    def _read(self, timeout_s: float) -> int:
        n, deadline = 0, time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.consumer.poll(min(0.2, max(0.0, deadline - time.monotonic())))
            if msg is None:
                if n:
                    break  # caught up with what there is
                continue
            if msg.error():
                continue
            try:
                ck = self.codec.decode(msg.value())
            except Invalid as e:
                log.warning("fleet: skipped an undecodable announcement at offset %s: %s", msg.offset(), e)
                continue
            n += 1
            if ck.org:  # an org's adapter decision: followed apart (_follow_adapters)
                self.adapter_status[(ck.org, ck.version)] = ck.status
                if ck.status == "promoted":
                    self.adapter_promotions.setdefault(ck.org, []).append(ck)
                continue
            self.latest[ck.version] = ck.status
            if ck.status == "promoted":
                self.promotions.append(ck)
        return n

    def poll(self, timeout_s: float = 1.0) -> Served | None:
        """Read new announcements (up to ``timeout_s``), load the target if it is not what is served, then each
        org's adapter (:meth:`follow_adapters`). Returns what is served."""
        self._read(timeout_s)
        self._follow_base()
        try:
            self.follow_adapters()
        except (ReloadError, ServiceUnavailable) as e:  # an unload that failed: tried again at the next poll
            log.error("fleet: %s", e)
        return self.served

    def _follow_base(self) -> Served | None:
        ck = self.target()
        if ck is None:
            return self.served
        key = (ck.version, ck.export_path, ck.export_sha256)
        if self.served is not None and (self.served.version, self.served.path, self.served.sha256) == key:
            return self.served
        if key in self.refused and time.monotonic() - self._failed_at.get(key, float("inf")) < self.retry_s:
            return self.served
        if not ck.export_path or not ck.export_sha256:
            self._refuse(
                key,
                f"fleet: v{ck.version} was promoted without an export (not a Hugging Face model): "
                "nothing to load; the server keeps what it serves",
            )
            return self.served
        path = self.path_map(ck.export_path)
        try:
            verify_export(path, ck.export_sha256)
        except ExportMismatch as e:
            self._refuse(key, f"fleet: v{ck.version}: {e}")
            self._failed_at[key] = time.monotonic()  # a copy still arriving (replication) may match later
            return self.served
        try:
            self.engine.reload(path, ck.version)
        except (ReloadError, ServiceUnavailable) as e:
            self._refuse(key, f"fleet: v{ck.version} not loaded: {e}")
            self._failed_at[key] = time.monotonic()  # the server's side: worth another try later
            return self.served
        self.refused.pop(key, None)
        self.served = Served(ck.version, ck.export_path, ck.export_sha256)
        log.info("fleet: serving v%s from %s (sha256 %s)", ck.version, path, ck.export_sha256[:12])
        return self.served

    def adapter_target(self, org: str) -> Checkpoint | None:
        """``org``'s adapter to serve: its newest promotion not rolled back since, if validated on the served base."""
        for ck in reversed(self.adapter_promotions.get(org, [])):
            if self.adapter_status.get((org, ck.version)) == "promoted":
                ok = self.served is not None and ck.base_version == self.served.version
                return ck if ok else None
        return None

    def follow_adapters(self) -> dict[str, tuple[int, str]]:
        """Load each org's target adapter (hash-checked), unload what it replaces or what no longer serves; returns
        the adapters served per org."""
        for org in sorted(set(self.adapter_promotions) | set(self.adapters)):
            ck, have = self.adapter_target(org), self.adapters.get(org)
            if ck is None:
                if have is not None:
                    self.engine.unload_adapter(have[1])
                    del self.adapters[org]
                continue
            if have is not None and have[0] == ck.version:
                continue
            key = (ck.version, f"{org}:{ck.export_path}", ck.export_sha256)
            if key in self.refused and time.monotonic() - self._failed_at.get(key, float("inf")) < self.retry_s:
                continue
            if not ck.export_path or not ck.export_sha256:
                self._refuse(key, f"fleet: {org} adapter a{ck.version} has no PEFT export: the base serves {org}")
                continue
            path = self.path_map(ck.export_path)
            name = adapter_model_name(self.model_name, org, ck.version)
            try:
                verify_export(path, ck.export_sha256)
                self.engine.load_adapter(name, path)
            except (ExportMismatch, ReloadError, ServiceUnavailable) as e:
                self._refuse(key, f"fleet: {org} adapter a{ck.version} not loaded: {e}")
                self._failed_at[key] = time.monotonic()
                continue
            self.refused.pop(key, None)
            self.adapters[org] = (ck.version, name)
            if have is not None:
                self.engine.unload_adapter(have[1])
            log.info("fleet: %s served by adapter a%s (%s) from %s", org, ck.version, name, path)
        return dict(self.adapters)

    def _refuse(self, key: tuple[int, str, str], line: str) -> None:
        if key not in self.refused:
            log.error("%s", line)
        self.refused[key] = line

    def run(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """Poll until ``stop`` is set."""
        while not stop.is_set():
            self.poll(timeout_s=min(1.0, interval_s))
            stop.wait(interval_s)

    def close(self) -> None:
        self.consumer.close()
        self.engine.close()
