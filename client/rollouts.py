"""The rollout collector: samples from an OpenAI-compatible completions server over HTTP and builds
:class:`schemas.records.Rollout` records from what it returns.

What a production fleet integration uses against vLLM or SGLang (``serving.url``, e.g.
``http://127.0.0.1:8000/v1``), and what the simulator's policy server uses against its own server
(:mod:`simulator.openai_server`), so the loop runs the production path.

    from client.rollouts import CompletionsClient, RolloutCollector
    collector = RolloutCollector(CompletionsClient("http://127.0.0.1:8000/v1", "my-policy"))
    groups = collector.start([prompt_ids], group_size=4, max_tokens=256)   # one request, n = 4
    for t in groups[0]:
        t.tool(tool_output_ids)                   # context: loss-masked, not sampled
    collector.next_turn(groups[0], max_tokens=256)   # the whole history as the prompt
    rollouts = [t.rollout(trajectory_id=..., policy_version=v, group_id=g, group_size=4,
                          org_id=org, task_kind=kind, created_at=now_ms) for t in groups[0]]

The wire protocol (``POST {url}/completions``): prompts are sent as token ids, never text (re-tokenising a
detokenised history does not always give the same ids, and the trainer recomputes the log-probs of exactly
these ids), several prompts per request with ``n`` samples each (choices come back prompt-major), with
``logprobs`` and both vLLM's ``return_tokens_as_token_ids`` (tokens written ``token_id:N``) and
``return_token_ids`` (``token_ids`` on each choice; SGLang honours this one). A response without token ids
by either route is refused, naming the server flag. The behaviour log-prob of each sampled token is
``logprobs.token_logprobs``: that of the distribution it was drawn from, which the trainer recomputes
(temperature 1, no top-p/top-k: the ``Rollout`` contract).

Multi-turn: a :class:`Transcript` is the prompt plus everything after it - sampled agent turns (loss mask
1, their behaviour log-probs) and context the agent did not sample, such as tool output (loss mask 0,
behaviour log-prob 0.0: JSON carries no NaN, and the trainer ignores untrained positions). Each next turn is
sampled with the whole history as its prompt, so its log-probs are conditioned on exactly the sequence the
trainer sees. The ``Rollout`` carries the original prompt as ``prompt_ids`` and the rest as
``completion_ids`` with that mask.

Every request has a deadline (``timeout_s`` to connect and to read) and is retried with exponential backoff
on connection errors, timeouts, 429 and 5xx (urllib3's ``Retry``); what still fails is one error naming
the URL: :class:`rtrl.errors.ServiceUnavailable` when the server cannot be reached,
:class:`CompletionError` when it answers with an error or an unusable response.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import urllib3
from urllib3.exceptions import HTTPError, MaxRetryError
from urllib3.util import Retry, Timeout

from rtrl.errors import RtrlError, ServiceUnavailable
from schemas.records import Rollout

#: vLLM's spelling of a token in ``logprobs.tokens`` with ``return_tokens_as_token_ids``
TOKEN_ID_PREFIX = "token_id:"


class _QuietRetries(logging.Filter):
    """urllib3 logs a WARNING per retry; for this client's requests the outcome is reported instead (an answer,
    or one error naming the URL), so those lines are dropped - only while this client's request runs."""

    active = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (getattr(self.active, "on", False) and str(record.msg).startswith("Retrying"))


_QUIET = _QuietRetries()
logging.getLogger("urllib3.connectionpool").addFilter(_QUIET)


def json_pool(
    *,
    retries: int,
    backoff_s: float,
    backoff_max_s: float,
    methods: frozenset[str],
    connect_s: float,
    read_s: float,
    api_key: str | None,
    pools: int,
    connections: int,
) -> urllib3.PoolManager:
    """A pooled, keep-alive JSON client with bounded timeouts: ``retries`` more tries after connection errors,
    timeouts, 429 and 5xx, with exponential backoff from ``backoff_s``; the last error answer is returned (with
    the server's message) rather than raised. ``api_key`` is sent as a bearer token."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    retry = Retry(
        total=retries,
        connect=retries,
        read=retries,
        status=retries,
        other=0,
        allowed_methods=methods,
        status_forcelist=(429, 500, 502, 503, 504),
        backoff_factor=backoff_s,
        backoff_max=backoff_max_s,
        raise_on_status=False,
        respect_retry_after_header=True,
    )
    return urllib3.PoolManager(
        num_pools=pools,
        maxsize=connections,
        headers=headers,
        timeout=Timeout(connect=connect_s, read=read_s),
        retries=retry,
    )


def send_json(
    http: urllib3.PoolManager,
    method: str,
    where: str,
    body: Any,
    *,
    what: str,
    tries: int,
    timeout_s: float,
    action: str = "",
    fix: str = "",
) -> urllib3.BaseHTTPResponse:
    """``method`` ``where`` with ``body`` as JSON (None: no body), urllib3's retry warnings silenced; a server that
    cannot be reached after ``tries`` is one :class:`ServiceUnavailable` line: ``{what} did not answer{action}
    after N tries (Ts each): reason{fix}``."""
    _QUIET.active.on = True
    try:
        data = json.dumps(body, separators=(",", ":")).encode() if body is not None else None
        return http.request(method, where, body=data)
    except MaxRetryError as e:
        raise ServiceUnavailable(
            f"{what} did not answer{action} after {tries} tries ({timeout_s:g}s each): {_reason(e.reason)}{fix}"
        ) from None
    except HTTPError as e:
        raise ServiceUnavailable(f"{what} failed{action}: {_reason(e)}") from None
    finally:
        _QUIET.active.on = False


class CompletionError(RtrlError):
    """The completions server answered with an error, or with a response the collector cannot use; the message
    names the URL and what was wrong."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its token ids, the log-prob of each under the sampling distribution, and why it
    ended (``length``, ``stop``, ...)."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


def parse_token_id(token: str) -> int:
    """``token_id:123`` -> 123 (vLLM's ``return_tokens_as_token_ids`` form); ValueError otherwise."""
    if not token.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"{token!r} is not a token_id:N token")
    return int(token[len(TOKEN_ID_PREFIX) :])


class CompletionsClient:
    """HTTP client of one OpenAI-compatible completions API (``url`` ends in ``/v1``), pooled and keep-alive.

    ``model`` is the name sent with each request (vLLM: ``--served-model-name``). Each request may take
    ``timeout_s`` to connect and ``timeout_s`` to read the response, and is retried ``retries`` times with
    exponential backoff from ``backoff_s`` (so a dead server is reported within about
    ``(retries + 1) x timeout_s`` plus the backoff). ``api_key`` is sent as a bearer token (vLLM's
    ``--api-key``). ``logprobs`` is how many top log-probs to ask for besides the sampled token's."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        api_key: str | None = None,
        logprobs: int = 1,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a completions URL is http(s)://host:port/v1, not {url!r}")
        self.url, self.model, self.timeout_s, self.retries, self.logprobs = (
            url.rstrip("/"),
            model,
            timeout_s,
            retries,
            logprobs,
        )
        self._http = json_pool(
            retries=retries,
            backoff_s=backoff_s,
            backoff_max_s=10.0,
            methods=frozenset({"GET", "POST"}),  # a retried completion is a new sample: nothing is lost
            connect_s=timeout_s,
            read_s=timeout_s,
            api_key=api_key,
            pools=2,
            connections=4,
        )

    # ------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, text: bool = False) -> Any:
        where = f"{self.url}{path}"
        resp = send_json(
            self._http,
            method,
            where,
            body,
            what=f"completions server at {where}",
            tries=self.retries + 1,
            timeout_s=self.timeout_s,
            fix="; fix: start it, or set serving.url to a running server (empty = the project's own)",
        )
        text_body = resp.data.decode("utf-8", "replace")
        if resp.status >= 400:
            raise CompletionError(f"completions server at {where} answered {resp.status}: {_error_message(text_body)}")
        if method == "GET" and path.endswith("/health"):
            return None
        if text:  # vLLM answers its LoRA endpoints in plain text
            return text_body
        try:
            return json.loads(text_body)
        except ValueError:
            raise CompletionError(
                f"completions server at {where} sent a response that is not JSON: {text_body[:200]!r}"
            ) from None

    def models(self) -> list[str]:
        """The names ``GET /v1/models`` lists."""
        body = self._request("GET", "/models")
        try:
            return [m["id"] for m in body["data"]]
        except (KeyError, TypeError):
            raise CompletionError(
                f"completions server at {self.url}/models listed no models: {str(body)[:200]}"
            ) from None

    def check(self) -> None:
        """The server answers and serves :attr:`model` (else one error naming the URL and what it serves)."""
        names = self.models()
        if self.model not in names:
            raise CompletionError(
                f"completions server at {self.url} does not serve model {self.model!r} (it serves "
                f"{', '.join(map(repr, names)) or 'nothing'}); fix: set serving.model to one of them"
            )

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter in folder ``path`` (as the server sees it) as model ``name``: vLLM's runtime LoRA
        API (``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), which the project's own server speaks
        too. Loading a name the server already holds (a retried request that did land) is not an error."""
        try:
            self._request("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path}, text=True)
        except CompletionError as e:
            if "already been loaded" not in str(e):
                raise

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving LoRA adapter ``name`` (a name the server does not hold: nothing to do)."""
        try:
            self._request("POST", "/unload_lora_adapter", {"lora_name": name}, text=True)
        except CompletionError as e:
            if " 404:" not in str(e):
                raise

    def close(self) -> None:
        self._http.clear()

    def __enter__(self) -> CompletionsClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ sampling

    def complete(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        model: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> list[list[Completion]]:
        """``n`` completions of each prompt (token ids), in one request; per prompt its ``n`` completions.
        ``ignore_eos`` (vLLM and SGLang) samples ``max_tokens`` even past EOS; ``extra`` adds request fields."""
        if not prompts:
            return []
        body: dict[str, Any] = {
            "model": model or self.model,
            "prompt": [[int(t) for t in p] for p in prompts],
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": self.logprobs,
            "return_tokens_as_token_ids": True,  # vLLM: tokens as token_id:N
            "return_token_ids": True,  # vLLM >= 0.10.2 and SGLang: token_ids on each choice
        }
        if seed is not None:
            body["seed"] = seed
        if ignore_eos:
            body["ignore_eos"] = True
        body |= extra or {}
        resp = self._request("POST", "/completions", body)
        return self._parse(resp, len(prompts), n)

    def _parse(self, resp: Any, n_prompts: int, n: int) -> list[list[Completion]]:
        where = f"{self.url}/completions"
        try:
            choices = sorted(resp["choices"], key=lambda c: c["index"])
        except (KeyError, TypeError):
            raise CompletionError(f"completions server at {where} sent no choices: {str(resp)[:200]}") from None
        if len(choices) != n_prompts * n:
            raise CompletionError(
                f"completions server at {where} sent {len(choices)} choices for {n_prompts} prompts x n={n}"
            )
        out: list[list[Completion]] = [[] for _ in range(n_prompts)]
        for i, c in enumerate(choices):
            out[i // n].append(_completion(c, where))
        return out


def _completion(choice: dict[str, Any], where: str) -> Completion:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs"), list):
        raise CompletionError(f"completions server at {where} sent a choice without logprobs.token_logprobs")
    logprobs = lp["token_logprobs"]
    ids = choice.get("token_ids")
    tokens = lp.get("tokens")
    from_tokens = None
    if (
        isinstance(tokens, list)
        and tokens
        and all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens)
    ):
        from_tokens = [parse_token_id(t) for t in tokens]
    if ids is None:
        ids = from_tokens
    elif from_tokens is not None and from_tokens != ids:
        raise CompletionError(f"completions server at {where} sent token_ids that differ from its logprobs.tokens")
    if ids is None and not logprobs:
        ids = []  # nothing sampled (e.g. max_tokens reached by the prompt)
    if ids is None:
        raise CompletionError(
            f"completions server at {where} sent no token ids: vLLM needs --return-tokens-as-token-ids (or a "
            "version that honours return_token_ids), SGLang return_token_ids (any recent version)"
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise CompletionError(f"completions server at {where} sent token ids that are not ids: {str(ids)[:100]}")
    if len(logprobs) != len(ids) or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in logprobs):
        raise CompletionError(
            f"completions server at {where} sent {len(logprobs)} log-probs for {len(ids)} tokens (or a null one)"
        )
    return Completion(list(ids), [float(x) for x in logprobs], choice.get("finish_reason"))


def _reason(e: BaseException | None) -> str:
    text = str(e) if e is not None else "no reason given"
    if "Connection refused" in text or "NewConnectionError" in text:
        return "connection refused"
    if "timed out" in text.lower() or "timeout" in type(e).__name__.lower():
        return "timed out"
    return f"{type(e).__name__}: {text[:200]}"


def _error_message(text: str) -> str:
    """The message of an error body: OpenAI's and vLLM's ``{"error": {"message", "type", ...}}``, SGLang's flat
    ``{"object": "error", "message", "type", ...}``; else the text."""
    try:
        body = json.loads(text)
        err = body.get("error", body) if isinstance(body, dict) else body
        if isinstance(err, dict) and "message" in err:
            return f"{err.get('type', 'error')}: {err['message']}"
        return str(err)[:300]
    except ValueError:
        return text[:300] or "(empty body)"


@dataclass
class Transcript:
    """One trajectory as tokens: the prompt, then agent turns (sampled: trained on) and context (not sampled,
    e.g. tool output: loss-masked), in order. :attr:`history` is the next turn's prompt."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def turns(self) -> list[list[int]]:
        """The agent's turns (runs of trained tokens), in order."""
        out: list[list[int]] = []
        prev = 0
        for t, m in zip(self.completion_ids, self.loss_mask):
            if m and not prev:
                out.append([])
            if m:
                out[-1].append(t)
            prev = m
        return out

    def agent(self, c: Completion) -> Transcript:
        """Append a sampled turn: trained on, with its behaviour log-probs."""
        self.completion_ids += c.ids
        self.behaviour_logprobs += c.logprobs
        self.loss_mask += [1] * len(c.ids)
        self.finish_reason = c.finish_reason
        return self

    def tool(self, ids: Sequence[int]) -> Transcript:
        """Append context the agent did not sample (tool output, a user message): loss mask 0, log-prob 0.0."""
        ids = [int(t) for t in ids]
        self.completion_ids += ids
        self.behaviour_logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        return self

    def rollout(
        self,
        *,
        trajectory_id: str,
        policy_version: int,
        group_id: str,
        group_size: int,
        org_id: str,
        task_kind: str,
        created_at: int,
        adapter_version: int = 0,
    ) -> Rollout:
        """The rollout of this transcript; ``adapter_version``: the org's adapter version that sampled it over
        ``policy_version`` (0: the shared policy alone). A fleet that serves org adapters must pass it: the model
        name a request went to, ``<serving.model>-<org>-a<N>``, carries N. Left at 0 for an adapter-served
        sample, the trainers take the base alone for its behaviour policy: its org's adapter then trains on it on
        the delayed path (truncated importance weights; not at all with ``train.max_delayed_lag`` 0), and the
        shared policy trains it on the base alone."""
        return Rollout(
            trajectory_id=trajectory_id,
            policy_version=policy_version,
            group_id=group_id,
            group_size=group_size,
            org_id=org_id,
            task_kind=task_kind,
            prompt_ids=list(self.prompt_ids),
            completion_ids=list(self.completion_ids),
            behaviour_logprobs=list(self.behaviour_logprobs),
            loss_mask=list(self.loss_mask),
            created_at=created_at,
            adapter_version=adapter_version,
        )


def _contract_temperature(temperature: float) -> None:
    """Rollouts are sampled at temperature 1: the trainer's ratio compares the policy's own log-probs with the
    behaviour log-probs, and a Rollout records no temperature (the ``Rollout`` contract)."""
    if temperature != 1.0:
        raise ValueError(
            f"temperature {temperature:g}: rollouts are sampled at temperature 1 (the Rollout contract: the trainer "
            "compares its own log-probs with the behaviour log-probs, and a Rollout records no temperature)"
        )


class RolloutCollector:
    """Groups of sampled trajectories from a :class:`CompletionsClient`, turn by turn, as :class:`Transcript`\\ s."""

    def __init__(self, client: CompletionsClient):
        self.client = client

    def start(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int,
        max_tokens: int,
        *,
        temperature: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        model: str | None = None,
    ) -> list[list[Transcript]]:
        """The first agent turn: ``group_size`` samples of each prompt, all in one request (``n = group_size``);
        per prompt its group."""
        _contract_temperature(temperature)
        groups = self.client.complete(
            prompts,
            n=group_size,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            ignore_eos=ignore_eos,
            model=model,
        )
        return [[Transcript(list(p)).agent(c) for c in g] for p, g in zip(prompts, groups)]

    def next_turn(
        self,
        transcripts: Sequence[Transcript],
        max_tokens: int,
        *,
        temperature: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        model: str | None = None,
    ) -> None:
        """The next agent turn of each transcript, sampled with its whole history as the prompt (one request,
        one prompt per transcript); appended to it."""
        _contract_temperature(temperature)
        out = self.client.complete(
            [t.history for t in transcripts],
            n=1,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            ignore_eos=ignore_eos,
            model=model,
        )
        for t, (c,) in zip(transcripts, out):
            t.agent(c)
