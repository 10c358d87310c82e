"""The base of every settings section, and the redaction of secrets in what settings show.

A section is one component's settings, defined beside the component (``rtrl/sections/flows.py``,
``rtrl/sections/trainer.py`` ...). :mod:`rtrl.settings` composes the sections into one tree and loads it.
This module imports no other project module, so every component's config can import it.
"""

from __future__ import annotations

import re
from types import UnionType
from typing import Any, Union, get_args, get_origin
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


def setting(default: Any, help: str, **constraints: Any) -> Any:
    """A setting: its default, its help text (shown by ``rtrl config``) and pydantic constraints."""
    return Field(default, description=help, **constraints)


_SECRET_WORDS = frozenset(
    "password passwd pwd pass passphrase token secret key apikey auth authorization credential credentials "
    "signature sig jwt".split()
)
#: parts of a run-together name that make its value a secret (``sasl.password`` and ``ApiKey`` as well)
_SECRET_PARTS = (
    "password",
    "passwd",
    "passphrase",
    "secret",
    "token",
    "apikey",
    "accesskey",
    "privatekey",
    "credential",
)
#: rtrl's own DSN parameters: each names a file or a switch, never a secret (``client_cert_key`` is a path)
_PLAIN_PARAMS = frozenset(("password_file", "ca_cert", "verify", "client_cert", "client_cert_key"))
_PARAM = re.compile(r"(?<=[?&;#])([^=&;#?\s'\"]+)=([^&;#\s]*)")


def _secret_param(name: str) -> bool:
    """Whether a query parameter called ``name`` carries a credential (case and percent-encoding ignored)."""
    n = unquote(name.replace("+", " ")).lower()
    words = [w for w in re.split(r"[^a-z0-9]+", n) if w]
    if n in _PLAIN_PARAMS or not words or words[-1] in ("file", "path", "location", "dir"):
        return False  # a path to a secret is not one
    compact = "".join(words)
    return any(w in _SECRET_WORDS or w.endswith("key") for w in words) or any(p in compact for p in _SECRET_PARTS)


def _redact_userinfo(token: str) -> str:
    """``token`` with the password of its ``user:password@`` part (with or without a scheme) as ``***``."""
    if "://" not in token and "," in token:  # a broker list: each host on its own
        return ",".join(_redact_userinfo(t) for t in token.split(","))
    start = token.find("://")
    start = start + 3 if start >= 0 else len(token) - len(token.lstrip("'\"([{<="))
    rest = token[start:]
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, end)
    colon = rest.find(":", rest.find("]") + 1 if rest.startswith("[") else 0, end)  # past an IPv6 address
    if at < 0 and colon >= 0 and not rest[colon + 1 : end].isdigit():
        at = rest.find("@", colon)  # a password with an unescaped / ? or # in it: never half shown
    user, sep, password = rest[: max(at, 0)].partition(":")
    if at < 0 or not sep or not password:
        return token
    return f"{token[:start]}{user}:***{rest[at:]}"


def redact_dsn(dsn: str) -> str:
    """``dsn`` (or any text holding DSNs) with every secret in it replaced by ``***``.

    The password of a ``user:password@`` part goes, with or without a scheme.
    So do the values of credential-like query parameters (``password``, ``token``, ``access_token``, ``key``,
    ``secret``, ``api_key``, ``sasl.password`` ...), matched case-insensitively, also after a ``#``.
    The rest stays readable: ``https://user:***@host:8443/?token=***&database=rtrl``.
    """

    def param(m: re.Match[str]) -> str:
        value = m[2].rstrip("'\")]}>,.:")  # the quote or bracket around a DSN in a message stays
        return f"{m[1]}=***{m[2][len(value) :]}" if value and _secret_param(m[1]) else m[0]

    text = _PARAM.sub(param, dsn)
    return re.sub(r"\S+", lambda m: _redact_userinfo(m[0]) if "@" in m[0] else m[0], text)


def _numeric(annotation: Any) -> bool:
    """Whether a setting of type ``annotation`` holds numbers (``int``, ``float | None``, ``list[float]`` ...)."""
    if annotation in (int, float):
        return True
    args = [a for a in get_args(annotation) if a is not type(None)]
    return get_origin(annotation) in (list, tuple, set, Union, UnionType) and any(map(_numeric, args))


def _boolean(value: Any) -> bool:
    """Whether ``value`` is a boolean: TOML's ``true`` / ``false``, or the same word from the environment."""
    if isinstance(value, list | tuple):
        return any(map(_boolean, value))
    return isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in ("true", "false"))


class Section(BaseModel):
    """One component's settings: unknown keys are errors; assignments are validated too; numbers are finite
    (an infinite timeout or a NaN rate is a typo, never a wish); a boolean is never a number; errors and
    ``repr`` never show a secret in a value (:func:`redact_dsn`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, hide_input_in_errors=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_number(cls, v: Any, info: ValidationInfo) -> Any:
        """Refuse ``true`` / ``false`` for a count, size, port or duration (pydantic would read them as 1 / 0)."""
        if info.field_name is not None and _boolean(v) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError("is a boolean, not a number (true is never read as 1, nor false as 0)")
        return v

    def __repr_args__(self):  # a password in a DSN or URL never reaches a log
        for k, v in super().__repr_args__():
            yield k, redact_dsn(v) if isinstance(v, str) else v
