"""Secret screening of rollouts where they are collected, before anything keeps them (issue 38, point 4).

The SDK decodes each rollout's prompt and completion to text and scans it. A rollout that holds a secret is kept
back: its tokens reach no topic, table, archive or micro-batch. The SDK records a ``secret_found`` event per
finding instead, naming the detector and the offset, never the secret. The reward flow then gives the whole
trajectory the class ``monitor_only``, so none of it trains.

- The scanner is pluggable (setting ``governance.secret_scanner``). The default, :class:`DetectSecrets`, runs
  detect-secrets' detectors of cloud and API keys, private keys, tokens and passwords in URLs. Its entropy and
  keyword detectors are left out: they flag ordinary code (hashes, ids, the word ``password``).
- The decoder is the model folder's tokenizer (``tokenizer.json``) for a Hugging Face model, else the
  simulator's vocabulary; the policy server chooses (simulator/serve.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rtrl.errors import ConfigError


@dataclass(frozen=True)
class Finding:
    """A secret found in a rollout: which detector, in which part, at which character. Never the secret."""

    detector: str
    location: str  # "prompt" or "completion"
    char_offset: int


class Scanner(Protocol):
    """Finds secrets in text: ``(detector, character offset)`` per secret."""

    def scan(self, text: str) -> list[tuple[str, int]]: ...


class DetectSecrets:
    """detect-secrets' detectors, run on each line of the text (its own unit of scanning)."""

    #: detectors that fire on ordinary code: long hex or base64 strings (hashes, ids), and the word "password"
    NOISY = ("Base64HighEntropyString", "HexHighEntropyString", "KeywordDetector", "IPPublicDetector")

    def __init__(self, exclude: Sequence[str] = NOISY):
        from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class

        mapping: dict[Any, Any] = get_mapping_from_secret_type_to_class()
        classes: dict[str, Any] = {}
        for detector in mapping.values():  # several secret types may share one detector class
            classes[detector.__name__] = detector
        self.detectors = [cls() for name, cls in sorted(classes.items()) if name not in exclude]

    def scan(self, text: str) -> list[tuple[str, int]]:
        found = []
        start = 0
        for number, line in enumerate(text.split("\n"), 1):
            for det in self.detectors:
                for secret in det.analyze_line(filename="rollout", line=line, line_number=number):
                    at = line.find(secret.secret_value) if secret.secret_value else -1
                    found.append((type(det).__name__, start + max(at, 0)))
            start += len(line) + 1
        return sorted(set(found), key=lambda f: (f[1], f[0]))


def scanner_from(spec: str) -> Scanner | None:
    """The scanner ``governance.secret_scanner`` names: ``detect-secrets``, ``module:Class`` (built with no
    arguments), or empty for none."""
    if not spec:
        return None
    if spec == "detect-secrets":
        return DetectSecrets()
    module, _, name = spec.partition(":")
    try:
        scanner = getattr(importlib.import_module(module), name)()
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        raise ConfigError(
            f"governance.secret_scanner = {spec!r} could not be built ({type(e).__name__}: {e}); fix: "
            "'detect-secrets', 'package.module:Class' with a scan(text) method, or '' for no screening"
        ) from None
    if not callable(getattr(scanner, "scan", None)):
        raise ConfigError(f"governance.secret_scanner = {spec!r} has no scan(text) method; fix: give it one")
    return scanner


def tokenizer_decoder(folder: str | Path) -> Callable[[Sequence[int]], str]:
    """The decoder of a Hugging Face model folder's ``tokenizer.json`` (the tokenizers library, as transformers'
    fast tokenizers use it)."""
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.exists():
        raise ConfigError(
            f"{path} does not exist: secret screening decodes rollouts with the model's tokenizer; fix: save the "
            "tokenizer in model.hf_path (tokenizer.save_pretrained), or set governance.secret_scanner = ''"
        )
    tok = Tokenizer.from_file(str(path))
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


class Screen:
    """A scanner and the decoder of the model's token ids: :meth:`rollout` gives a rollout's findings."""

    def __init__(self, scanner: Scanner, decode: Callable[[Sequence[int]], str]):
        self.scanner, self.decode = scanner, decode

    def rollout(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[Finding]:
        return [
            Finding(detector, location, offset)
            for location, ids in (("prompt", prompt_ids), ("completion", completion_ids))
            for detector, offset in self.scanner.scan(self.decode(ids))
        ]


def screen_for(spec: str, hf_path: str, vocabulary: Callable[[Sequence[int]], str] | None = None) -> Screen | None:
    """The screen the settings give (``governance.secret_scanner``, ``model.hf_path``): the model folder's tokenizer
    when it has one, else ``vocabulary`` (the simulator's). None when screening is off, or when there is no decoder:
    a product without a tokenizer folder sets ``RtrlClient.screen`` itself."""
    scanner = scanner_from(spec)
    if scanner is None:
        return None
    if hf_path and (Path(hf_path) / "tokenizer.json").exists():
        return Screen(scanner, tokenizer_decoder(hf_path))
    return Screen(scanner, vocabulary) if vocabulary is not None else None
