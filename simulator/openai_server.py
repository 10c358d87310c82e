"""The policy's inference server: the OpenAI-compatible completions API that vLLM and SGLang speak.

The simulator's policy server samples through this server over HTTP, with the rollout collector
(:mod:`client.rollouts`) that a production fleet integration uses against vLLM or SGLang, so the loop
exercises the production path. :class:`CompletionServer` runs on a thread (stdlib ``ThreadingHTTPServer``,
loopback by default, a free port by default) and serves one or more named models:

``POST /v1/completions``  ``model``, ``prompt`` (a string, a list of token ids, or a list of either),
                          ``max_tokens`` (default 16), ``temperature`` (default 1; 0 = greedy), ``n``,
                          ``logprobs`` (int: the sampled token's log-prob plus the top ``logprobs``),
                          ``prompt_logprobs``, ``seed``, ``ignore_eos``, and vLLM's
                          ``return_tokens_as_token_ids`` and ``return_token_ids``. The response is
                          vLLM's: ``choices`` prompt-major (choice ``i`` is sample ``i % n`` of prompt
                          ``i // n``) with ``text``, ``logprobs`` (``tokens``, ``token_logprobs``,
                          ``top_logprobs``, ``text_offset``), ``finish_reason`` (``length``, or ``stop`` at
                          EOS), ``token_ids`` / ``prompt_token_ids`` when asked; ``usage``.
``GET /v1/models``        the served model names (``max_model_len`` included, as vLLM lists it), then the loaded
                          LoRA adapters with ``root`` their folder and ``parent`` their base model, as vLLM does.
``GET /health``           200 with an empty body while the server runs.
``POST /update_weights_from_disk``  SGLang's native reload API: ``model_path`` (a Hugging Face export folder, e.g. a
                          registry version ``<registry>/v3``), optional ``weight_version`` (a label), ``load_format``
                          (null, ``auto`` or ``safetensors``), and this server's ``model`` (which served model;
                          default the first). The weights are loaded in place (:func:`trainer.registry.load_export`)
                          while no request samples; 200 ``{"success": true, "message", "num_paused_requests": 0}``,
                          or 400 with ``success`` false and why (no Hugging Face config for that model, another
                          architecture, missing tensors; the weights are then unchanged). Only models given a
                          Hugging Face ``configs`` entry can be reloaded.
``POST /v1/load_lora_adapter``  vLLM's runtime LoRA API: ``lora_name`` and ``lora_path`` (a PEFT LoRA folder, as
                          :func:`trainer.lora.export_peft` writes, for a Hugging Face model; or an rtrl adapter
                          checkpoint, :func:`trainer.lora.save_adapter`, for any model) and optional
                          ``base_model_name`` (which served model it goes on; default the first). From then on a
                          request whose ``model`` is ``lora_name`` samples from that base with the adapter (S-LoRA /
                          Punica style: one copy of the base, many adapters). Beyond ``max_loras`` adapters the least
                          recently used one is unloaded. 200 with vLLM's text ``Success: LoRA adapter '...' added
                          successfully.``; 400 for a name already loaded or a folder that does not load.
``POST /v1/unload_lora_adapter``  ``lora_name``: 200 ``Success: LoRA adapter '...' removed successfully.``, 404
                          for a name not loaded. Both also answer at SGLang's paths (``/load_lora_adapter``,
                          ``/unload_lora_adapter``).
``GET /get_model_info``   SGLang's: ``model_path`` (the last export loaded, else the model's source) and
                          ``weight_version`` of the first model, ``is_generation``.

Errors are vLLM's shape, ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP
status: 400 ``BadRequestError`` (bad JSON, a bad or unsupported parameter), 404 ``NotFoundError`` (an
unknown model or path), 413 (a body over the limit), 500 ``InternalServerError``.

Sampling is what the trainer recomputes (the ``Rollout`` contract): token by token from the full softmax
of ``logits / temperature``, no top-p, top-k, min-p or penalties; a request that asks for one of those is
refused (400), never served from another distribution. The reported log-probs are those of the
distribution each token was drawn from (vLLM's ``--logprobs-mode processed_logprobs``, SGLang's default);
at temperature 1 they equal the model's own log-probs. ``prompt_logprobs`` are the model's (temperature 1).
With a ``seed`` the response is a function of the weights and the request alone (a generator seeded per
request); without one, of the server's own generator.

Prompts given as text are split on whitespace and around ``<...>`` into the names of :data:`TOKEN_TEXT` (the simulator's
vocabulary has no tokenizer beyond that); ``text`` is the completion's token texts joined, special tokens
skipped unless ``skip_special_tokens`` is false. Hold :attr:`CompletionServer.lock` to change a model's
weights: a request samples under it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from rtrl.errors import ConfigError
from simulator.tasks import ASK, BOS, DIGIT0, EASY, EOS, HARD, KINDS, MALFORMED, PAD, SEP, TOOLS, VOCAB
from trainer import lora
from trainer.model import causal_mask

#: the text of each token of the simulator's vocabulary (a leading space, as byte-level BPE pieces have)
TOKEN_TEXT: list[str] = [f" <unused-{i}>" for i in range(VOCAB)]
for _tok, _text in (
    {PAD: "<pad>", BOS: "<bos>", SEP: "<sep>", EOS: "<eos>", ASK: " ask", EASY: " easy", HARD: " hard"}
    | {t: f" {name}" for t, name in TOOLS.items()}
    | {t: f" <malformed-{i}>" for i, t in enumerate(MALFORMED)}
    | {DIGIT0 + d: f" {d}" for d in range(10)}
    | {t: f" {kind}" for kind, t in KINDS.items()}
).items():
    TOKEN_TEXT[_tok] = _text
SPECIAL = frozenset({PAD, BOS, SEP, EOS})
_WORDS = {t.strip(): i for i, t in enumerate(TOKEN_TEXT)}

#: sampling parameters of the API this server does not implement, with the value that means "off": a request
#: giving another value is refused (it would be sampled from a distribution the trainer does not recompute)
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "stream": (False, None),
    "echo": (False, None),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "use_beam_search": (False, None),
    "top_p": (None, 1, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "stop": (None, [], ""),
    "stop_token_ids": (None, []),
    "min_tokens": (None, 0),
    "allowed_token_ids": (None,),
    "response_format": (None,),
    "structured_outputs": (None,),
}


def token_text(token_id: int) -> str:
    return TOKEN_TEXT[token_id] if 0 <= token_id < len(TOKEN_TEXT) else f" <{token_id}>"


def detokenize(ids: list[int], skip_special_tokens: bool = True) -> str:
    return "".join(token_text(t) for t in ids if not (skip_special_tokens and t in SPECIAL))


def tokenize(text: str) -> list[int]:
    """Token names, apart by whitespace or by ``<...>`` (``<bos> bugfix easy 3 4<sep>``) -> token ids."""
    out = []
    for word in re.findall(r"<[^<>\s]*>|[^<\s]+", text):
        if word not in _WORDS:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"'{word}' is not a token of this model's vocabulary", "prompt")
        out.append(_WORDS[word])
    return out


class ApiError(Exception):
    """An error the API answers with: its HTTP status, message and the parameter at fault."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLarge"}.get(
            self.status.value, "InternalServerError"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status.value}}


def _int(body: Mapping[str, Any], name: str, default: int | None, lo: int | None = None, hi: int | None = None):
    v = body.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"`{name}` must be an integer, got {v!r}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ApiError(HTTPStatus.BAD_REQUEST, f"`{name}` must be {bounds}, got {v}", name)
    return v


def _bool(body: Mapping[str, Any], name: str, default: bool | None) -> bool | None:
    v = body.get(name, default)
    if v is not None and not isinstance(v, bool):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"`{name}` must be true or false, got {v!r}", name)
    return v


class CompletionServer:
    """The completions API over ``models`` (name -> megatron ``GPTModel``) on ``host:port`` (0 = a free port).

    ``max_model_len`` bounds prompt + completion (default: the first model's ``max_sequence_length``);
    ``max_logprobs`` bounds ``logprobs`` and ``prompt_logprobs`` (vLLM's ``--max-logprobs``, default 20);
    ``max_n`` the sequences one request samples (prompts x ``n``); ``max_loras`` the LoRA adapters held at once;
    ``return_tokens_as_token_ids`` is the default of the request field of that name (vLLM's
    ``--return-tokens-as-token-ids``); ``configs`` (name -> the :class:`~rtrl.sections.trainer.ModelSettings` a model was
    built from) makes a Hugging Face model reloadable from an export (``POST /update_weights_from_disk``). Use as a
    context manager, or :meth:`start` and :meth:`close`."""

    def __init__(
        self,
        models: Mapping[str, Any],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_model_len: int | None = None,
        max_logprobs: int = 20,
        max_n: int = 4096,
        max_body_bytes: int = 8 << 20,
        return_tokens_as_token_ids: bool = False,
        eos_token_id: int = EOS,
        seed: int = 0,
        lock: threading.Lock | None = None,
        request_timeout_s: float = 60.0,
        configs: Mapping[str, Any] | None = None,
        max_loras: int = 64,
    ):
        if not models:
            raise ValueError("a completions server needs at least one model")
        self.models = dict(models)
        self.configs = dict(configs or {})
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras!r}")
        #: LoRA adapters by name -> (base model name, folder), least recently used first
        self.loras: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self.max_loras = max_loras
        #: per model: the export folder it last loaded (else its source) and the weight_version label given with it
        self.loaded: dict[str, tuple[str, str | None]] = {
            name: (getattr(self.configs.get(name), "hf_path", "") or "", None) for name in self.models
        }
        first = next(iter(self.models.values()))
        self.max_model_len = max_model_len or int(getattr(first, "max_sequence_length", 64))
        self.max_logprobs, self.max_n, self.max_body_bytes = max_logprobs, max_n, max_body_bytes
        self.return_tokens_as_token_ids, self.eos = return_tokens_as_token_ids, eos_token_id
        #: held while a request samples: hold it to load new weights into a served model
        self.lock = lock if lock is not None else threading.Lock()
        self._generator = torch.Generator().manual_seed(seed)
        self._created = int(time.time())
        server = self

        class Handler(_Handler):
            api = server
            timeout = request_timeout_s  # a client that stops sending mid-request is dropped

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The API's base URL, e.g. ``http://127.0.0.1:41234/v1`` (what ``serving.url`` would hold)."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> CompletionServer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="completions-api", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving; the LoRA adapters loaded through the API leave the models (the caller's) with it."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(10)
            self._thread = None
        self.httpd.server_close()
        with self.lock:
            while self.loras:
                name, (base, _) = self.loras.popitem()
                lora.remove_adapter(self.models[base], name)

    def __enter__(self) -> CompletionServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ the API, without HTTP

    def list_models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self._created,
                    "owned_by": "rtrl",
                    "root": name,
                    "parent": None,
                    "max_model_len": self.max_model_len,
                }
                for name in self.models
            ]
            + [
                {
                    "id": name,
                    "object": "model",
                    "created": self._created,
                    "owned_by": "rtrl",
                    "root": folder,
                    "parent": base,
                    "max_model_len": self.max_model_len,
                }
                for name, (base, folder) in self.loras.items()
            ],
        }

    def load_lora_adapter(self, body: Any) -> str:
        """vLLM's ``/v1/load_lora_adapter`` body -> its success text; raises :class:`ApiError` (the served models are
        then unchanged)."""
        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
        name, path = body.get("lora_name"), body.get("lora_path")
        base = body.get("base_model_name") or next(iter(self.models))
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError(HTTPStatus.BAD_REQUEST, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        if name in self.loras or name in self.models:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if not isinstance(base, str) or base not in self.models:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"The model `{base}` does not exist.", "base_model_name")
        model, folder = self.models[base], Path(path)
        with self.lock:
            try:
                if (folder / "adapter_config.json").is_file():  # a PEFT folder: only a Hugging Face model reads it
                    cfg = self.configs.get(base)
                    if cfg is None:
                        raise ConfigError(
                            f"{path} is a PEFT adapter, and model `{base}` was given no Hugging Face config: load an "
                            "rtrl adapter checkpoint instead"
                        )
                    lora.load_peft(model, cfg, name, folder)
                else:
                    lora.load_adapter(folder, model, name, restore_rng=False)
            except Exception as e:  # noqa: BLE001 - a folder that does not load is the client's 400, as in vLLM
                if name in lora.adapter_names(model):
                    lora.remove_adapter(model, name)
                why = (
                    str(e)
                    if isinstance(e, ConfigError | OSError | ValueError | KeyError)
                    else f"{type(e).__name__}: {e}"
                )
                raise ApiError(
                    HTTPStatus.BAD_REQUEST, f"Failed to load LoRA adapter '{name}' from {path}: {why}", "lora_path"
                ) from None
            self.loras[name] = (base, path)
            while len(self.loras) > self.max_loras:  # least recently used leaves
                old, (old_base, _) = self.loras.popitem(last=False)
                lora.remove_adapter(self.models[old_base], old)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, body: Any) -> str:
        """vLLM's ``/v1/unload_lora_adapter`` body -> its success text (404 for a name not loaded)."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise ApiError(HTTPStatus.BAD_REQUEST, "'lora_name' must be provided.", "lora_name")
        with self.lock:
            if name not in self.loras:
                raise ApiError(HTTPStatus.NOT_FOUND, f"The lora adapter '{name}' cannot be found.", "lora_name")
            base, _ = self.loras.pop(name)
            lora.remove_adapter(self.models[base], name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def update_weights_from_disk(self, body: Any) -> dict[str, Any]:
        """SGLang's ``/update_weights_from_disk`` body -> its answer; raises :class:`ApiError` (400) when nothing was
        loaded (the served weights are then unchanged)."""
        from trainer.registry import load_export

        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
        path, version = body.get("model_path"), body.get("weight_version")
        name = body.get("model", next(iter(self.models)))
        if not isinstance(path, str) or not path:
            raise ApiError(HTTPStatus.BAD_REQUEST, "`model_path` must name an export folder", "model_path")
        if version is not None and not isinstance(version, str):
            raise ApiError(
                HTTPStatus.BAD_REQUEST, f"`weight_version` must be a string, got {version!r}", "weight_version"
            )
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                "`load_format` must be auto or safetensors: exports are safetensors",
                "load_format",
            )
        if not isinstance(name, str) or name not in self.models:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"The model `{name}` does not exist.", "model")
        cfg = self.configs.get(name)
        if cfg is None:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"model `{name}` was given no Hugging Face config (CompletionServer configs): it cannot be reloaded",
                "model",
            )
        t = time.monotonic()
        with self.lock:
            try:
                load_export(self.models[name], cfg, path)
            except Exception as e:  # noqa: BLE001 - load_export restored the weights; SGLang answers any failure 400
                why = str(e) if isinstance(e, ConfigError | OSError | ValueError) else f"{type(e).__name__}: {e}"
                raise ApiError(HTTPStatus.BAD_REQUEST, f"Failed to load {path}: {why}", "model_path") from None
            self.loaded[name] = (path, version)
        return {
            "success": True,
            "message": f"Succeeded to update model weights of `{name}` from {path} in {time.monotonic() - t:.2f}s.",
            "num_paused_requests": 0,
        }

    def model_info(self) -> dict[str, Any]:
        """SGLang's ``/get_model_info`` for the first model."""
        path, version = self.loaded[next(iter(self.models))]
        return {"model_path": path, "tokenizer_path": None, "is_generation": True, "weight_version": version}

    def complete(self, body: Any) -> dict[str, Any]:
        """One ``/v1/completions`` request body -> the response body (raises :class:`ApiError`)."""
        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
        name = body.get("model")
        if name is None:
            name = next(iter(self.models))
        if not isinstance(name, str) or (name not in self.models and name not in self.loras):
            raise ApiError(HTTPStatus.NOT_FOUND, f"The model `{name}` does not exist.", "model")
        for param, off in UNSUPPORTED.items():
            if param in body and body[param] not in off:
                raise ApiError(
                    HTTPStatus.BAD_REQUEST,
                    f"`{param}` = {body[param]!r} is not supported by this server: it samples from the full "
                    "softmax (what the trainer recomputes), without streaming",
                    param,
                )
        prompts = self._prompts(body.get("prompt"))
        n = _int(body, "n", 1, 1, self.max_n)
        max_tokens = _int(body, "max_tokens", 16, 1)
        logprobs = _int(body, "logprobs", None, 0, self.max_logprobs)
        prompt_logprobs = _int(body, "prompt_logprobs", None, 0, self.max_logprobs)
        seed = _int(body, "seed", None, -(2**63), 2**63 - 1)
        ignore_eos = _bool(body, "ignore_eos", False)
        as_ids = _bool(body, "return_tokens_as_token_ids", None)
        as_ids = self.return_tokens_as_token_ids if as_ids is None else as_ids
        return_ids = _bool(body, "return_token_ids", False)
        skip_special = _bool(body, "skip_special_tokens", True)
        temperature = body.get("temperature", 1.0)
        temperature = 1.0 if temperature is None else temperature
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature < 1e4:
            raise ApiError(
                HTTPStatus.BAD_REQUEST, f"`temperature` must be a number >= 0, got {temperature!r}", "temperature"
            )
        assert n is not None and max_tokens is not None
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > self.max_model_len:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{longest + max_tokens} tokens ({longest} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
                "max_tokens",
            )
        if len(prompts) * n > self.max_n:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"{len(prompts)} prompts x n={n} is {len(prompts) * n} sequences, over this server's {self.max_n}",
                "prompt",
            )
        generator = torch.Generator().manual_seed(seed % 2**64) if seed is not None else self._generator
        rows = [p for p in prompts for _ in range(n)]  # prompt-major, as vLLM orders the choices
        with self.lock, self._use(name) as model:
            outs = _sample(
                model, rows, max_tokens, float(temperature), generator, logprobs or 0, self.eos, bool(ignore_eos)
            )
            plps = (
                [_prompt_logprobs(model, p, prompt_logprobs) for p in prompts] if prompt_logprobs is not None else None
            )
        choices = []
        for i, (ids, lps, tops, finish) in enumerate(outs):
            choice: dict[str, Any] = {
                "index": i,
                "text": detokenize(ids, bool(skip_special)),
                "logprobs": _logprobs_body(ids, lps, tops, logprobs, bool(as_ids)) if logprobs is not None else None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_logprobs": plps[i // n] if plps is not None else None,
            }
            if return_ids:
                choice["prompt_token_ids"], choice["token_ids"] = list(rows[i]), ids
            choices.append(choice)
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(o[0]) for o in outs)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    @contextlib.contextmanager
    def _use(self, name: str) -> Iterator[Any]:
        """The model that serves ``name`` (hold :attr:`lock`): a served model with no adapter active, or a LoRA
        adapter's base with that adapter active (and marked the most recently used)."""
        if name in self.models:
            model = self.models[name]
            if lora.adapter_names(model):  # the base itself: no adapter active
                with lora.activate(model, None):
                    yield model
            else:
                yield model
            return
        base, _ = self.loras[name]
        self.loras.move_to_end(name)
        with lora.activate(self.models[base], name):
            yield self.models[base]

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """``prompt`` as a list of token-id lists (a string or a list of ids is one prompt)."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise ApiError(
                HTTPStatus.BAD_REQUEST, "`prompt` must be a non-empty string, token-id list or list of them", "prompt"
            )
        first = next(iter(self.models))
        cfg = self.configs.get(first)  # a Hugging Face model's real vocabulary; the module's is padded
        vocab = cfg.vocab_size if cfg is not None else int(getattr(self.models[first], "vocab_size", VOCAB))
        out = []
        for p in prompt:
            if isinstance(p, str):
                p = tokenize(p)
            if not isinstance(p, list) or not p or any(isinstance(t, bool) or not isinstance(t, int) for t in p):
                raise ApiError(
                    HTTPStatus.BAD_REQUEST, "each prompt must be a non-empty string or a list of token ids", "prompt"
                )
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ApiError(
                    HTTPStatus.BAD_REQUEST, f"Token id {bad[0]} is out of vocabulary (size {vocab})", "prompt"
                )
            out.append(p)
        return out


def _device(model) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    n, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).expand(n, s)
    return model(tokens, pos, causal_mask(s, tokens.device)).float()  # [N, S, V]


Sampled = tuple[list[int], list[float], list[dict[int, float]], str]


@torch.no_grad()
def _sample(
    model,
    rows: list[list[int]],
    max_tokens: int,
    temperature: float,
    generator: torch.Generator,
    top: int,
    eos: int,
    ignore_eos: bool,
) -> list[Sampled]:
    """Each row's completion: (ids, log-probs, top-``top`` log-probs per step, finish reason). Rows of the same
    length are sampled as one batch, in the order they first appear (so the draws depend on the request only)."""
    model.eval()
    device = _device(model)
    out: list[Sampled | None] = [None] * len(rows)
    by_len: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_len.setdefault(len(r), []).append(i)
    for idx in by_len.values():
        seqs = torch.tensor([rows[i] for i in idx], dtype=torch.long, device=device)
        done = torch.zeros(len(idx), dtype=torch.bool)
        toks, lps, tops = [], [], []
        for _ in range(max_tokens):
            logits = _logits(model, seqs)[:, -1].cpu()
            if temperature < 1e-5:  # greedy, as vLLM reads a temperature this small
                lp = torch.log_softmax(logits, dim=-1)
                tok = lp.argmax(-1, keepdim=True)
            else:
                lp = torch.log_softmax(logits / temperature, dim=-1)
                tok = torch.multinomial(lp.exp(), 1, generator=generator)
            toks.append(tok[:, 0])
            lps.append(lp.gather(1, tok)[:, 0])
            if top:
                v, k = lp.topk(min(top, lp.shape[-1]), dim=-1)
                tops.append((v, k))
            seqs = torch.cat([seqs, tok.to(device)], dim=1)
            if not ignore_eos:
                done |= tok[:, 0] == eos
                if bool(done.all()):
                    break
        all_toks = torch.stack(toks, 1).tolist()
        all_lps = torch.stack(lps, 1).tolist()
        for j, i in enumerate(idx):
            ids, lp_row = all_toks[j], all_lps[j]
            finish = "length"
            if not ignore_eos and eos in ids:
                cut = ids.index(eos) + 1  # the EOS token is part of the output, as in vLLM
                ids, lp_row, finish = ids[:cut], lp_row[:cut], "stop"
            steps = [  # the sampled token first, then the top ones (vLLM's order)
                {ids[s]: lp_row[s]} | ({int(t): float(x) for x, t in zip(tops[s][0][j], tops[s][1][j])} if top else {})
                for s in range(len(ids))
            ]
            out[i] = (ids, lp_row, steps, finish)
    return [o for o in out if o is not None]


@torch.no_grad()
def _prompt_logprobs(model, prompt: list[int], top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token a dict keyed by token id holding the
    prompt token and the top ``top`` with ``logprob``, ``rank`` (1 = most likely) and ``decoded_token``."""
    model.eval()
    device = _device(model)
    lp = torch.log_softmax(_logits(model, torch.tensor([prompt], dtype=torch.long, device=device))[0, :-1].cpu(), -1)
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for s, tok in enumerate(prompt[1:]):
        row = lp[s]
        ids = [tok] + ([int(t) for t in row.topk(min(top, row.shape[0])).indices] if top else [])
        out.append(
            {
                str(t): {
                    "logprob": max(float(row[t]), -9999.0),
                    "rank": int((row > row[t]).sum()) + 1,
                    "decoded_token": token_text(t),
                }
                for t in ids
            }
        )
    return out


def _logprobs_body(
    ids: list[int], lps: list[float], tops: list[dict[int, float]], top: int, as_ids: bool
) -> dict[str, list]:
    """vLLM's completion ``logprobs``: per token its text (or ``token_id:N``), log-prob (clamped at -9999 as
    vLLM does), the top ``top`` plus the sampled token, and its offset in the text."""
    name = (lambda t: f"token_id:{t}") if as_ids else token_text
    tokens = [name(t) for t in ids]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {
        "text_offset": offsets,
        "token_logprobs": [max(x, -9999.0) for x in lps],
        "tokens": tokens,
        "top_logprobs": [{name(t): max(x, -9999.0) for t, x in list(step.items())[: top + 1]} for step in tops],
    }


class _Handler(BaseHTTPRequestHandler):
    api: CompletionServer
    protocol_version = "HTTP/1.1"  # keep-alive: a client's pooled connection serves many requests
    disable_nagle_algorithm = True  # headers and body are two writes: Nagle + delayed ACK would add ~40 ms
    server_version = "rtrl-completions"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass  # one line per request on stderr is noise in every part's log

    def _send(self, status: HTTPStatus, body: dict[str, Any] | None) -> None:
        data = json.dumps(body, separators=(",", ":")).encode() if body is not None else b""
        self.send_response(status.value)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, status: HTTPStatus, text: str) -> None:
        data = text.encode()
        self.send_response(status.value)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: ApiError) -> None:
        self._send(e.status, e.body())

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            self._send(HTTPStatus.OK, None)
        elif path == "/v1/models":
            self._send(HTTPStatus.OK, self.api.list_models())
        elif path == "/get_model_info":
            self._send(HTTPStatus.OK, self.api.model_info())
        else:
            self._error(ApiError(HTTPStatus.NOT_FOUND, f"no route {self.path}"))

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            return self._error(ApiError(HTTPStatus.BAD_REQUEST, "a request body needs a Content-Length"))
        if length > self.api.max_body_bytes:
            self.close_connection = True  # the body is not read: the connection cannot carry another request
            return self._error(
                ApiError(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"the request body has {length} bytes, over the limit of {self.api.max_body_bytes}",
                )
            )
        raw = self.rfile.read(length)
        routes: dict[str, Callable[[Any], dict[str, Any] | str]] = {
            "/v1/completions": self.api.complete,
            "/update_weights_from_disk": self.api.update_weights_from_disk,
            "/v1/load_lora_adapter": self.api.load_lora_adapter,
            "/v1/unload_lora_adapter": self.api.unload_lora_adapter,
            "/load_lora_adapter": self.api.load_lora_adapter,  # SGLang's paths of the same API
            "/unload_lora_adapter": self.api.unload_lora_adapter,
        }
        if path not in routes:
            return self._error(ApiError(HTTPStatus.NOT_FOUND, f"no route {self.path}"))
        reload = path == "/update_weights_from_disk"
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return self._error(ApiError(HTTPStatus.BAD_REQUEST, f"the request body is not valid JSON: {e}"))
        try:
            answer = routes[path](body)
            if isinstance(answer, str):  # vLLM answers the LoRA endpoints in plain text
                self._send_text(HTTPStatus.OK, answer)
            else:
                self._send(HTTPStatus.OK, answer)
        except ApiError as e:
            if reload:  # SGLang's failure shape: success false and the reason
                self._send(e.status, {"success": False, "message": e.message, "num_paused_requests": 0})
            else:
                self._error(e)
        except Exception as e:  # the server answers every request; a bug is a 500 naming it, not a dropped socket
            self._error(ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}"))
