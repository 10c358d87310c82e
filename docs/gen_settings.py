"""The settings page (docs/reference/settings.md): every setting of the typed tree and what ``rtrl run`` fixes.

Read from the settings tree (``rtrl/settings.py`` composes the sections of each package's ``config.py``: pydantic
models, their fields' types, defaults, constraints and help) and from what the closed loop fixes (``LOOP_FIXED``/``LOOP_OWNS`` in ``app/loop_config.py``, read
from its source without importing it). A default resolved at run time, such as ``train.torch_threads = 0``, is
shown as that 0 with the help saying what it means.
"""

from __future__ import annotations

import ast
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from docs.gen_markdown import ROOT, cell, code, header, own_doc, toml


def _setting_type(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(toml(a) for a in get_args(annotation))
    if origin is Annotated:
        return _setting_type(get_args(annotation)[0])
    if origin in (list, tuple, set):
        return f"{origin.__name__}[{', '.join(_setting_type(a) for a in get_args(annotation))}]"
    if origin in (Union, types.UnionType):
        return " | ".join(_setting_type(a) for a in get_args(annotation))
    if annotation is type(None):
        return "none"
    return getattr(annotation, "__name__", str(annotation))


def _setting_constraints(field: Any) -> list[str]:
    out = []
    for m in field.metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(m, attr, None) is not None:
                out.append(f"{sym} {getattr(m, attr)!r}")
        if getattr(m, "min_length", None) is not None:
            out.append(f"length >= {m.min_length}")
        if getattr(m, "max_length", None) is not None:
            out.append(f"length <= {m.max_length}")
        if getattr(m, "pattern", None):
            out.append(f"matches {code(m.pattern)}")
    return out


def _settings_rows(fields: Mapping[str, FieldInfo], prefix: str, secrets: Iterable[str]) -> list[str]:
    from rtrl.settings import env_name

    rows = []
    for key, f in fields.items():
        name = f"{prefix}{key}"
        default = f.get_default(call_default_factory=True)
        kind = [code(_setting_type(f.annotation)), *_setting_constraints(f)]
        if name in secrets:
            kind.append("secret (shown as `***`)")
        rows.append(
            f"| `{name}` | {', '.join(kind)} | {code(toml(default))} | `{env_name(name)}` | {cell(f.description or '')} |"
        )
    return rows


_TABLE_HEAD = ["| setting | type | default | environment | what it does |", "|---|---|---|---|---|"]


def settings_page(root: type[BaseModel] | None = None, loop_source: Path | None = None) -> str:
    """Every setting of ``root`` (default ``rtrl.settings.Settings``), a table per section."""
    from rtrl import settings as rs

    root = root or rs.Settings
    top = {k: f for k, f in root.model_fields.items() if not _is_section(f.annotation)}
    sections = {k: f.annotation for k, f in root.model_fields.items() if _is_section(f.annotation)}
    lines = header("Settings", "rtrl/sections/, rtrl/settings.py and app/loop_config.py")
    lines += [
        "One typed tree (`rtrl/settings.py`, pydantic-settings) holds every setting: a section per component, defined "
        "in `rtrl/sections/`.",
        "Sources, later ones winning: the defaults below, a TOML file (`rtrl --config FILE` or "
        f"`{rs.ENV_CONFIG_FILE}=FILE`), then environment variables `{rs.ENV_PREFIX}<SECTION>__<KEY>` "
        "(list settings: comma-separated). Unknown keys are errors, a bad value is refused naming the setting, "
        "where its value came from and the fix. `rtrl config` prints the effective settings (secrets as `***`), "
        "`rtrl config --example` every key at its default as TOML (what `deploy/rtrl.example.toml` holds).",
        "",
        "In a TOML file a setting `section.key` is written `key = value` under `[section]`; top-level settings "
        "come before the first section.",
        "",
        "Sections: " + ", ".join(f"[`{s}`](#{s})" for s in sections) + ".",
        "",
    ]
    if top:
        lines += ["## Top level", "", *_TABLE_HEAD, *_settings_rows(top, "", rs.SECRETS), ""]
    for sec, model in sections.items():
        lines += [f"## {sec}", ""]
        doc = own_doc(model)
        if doc:
            lines += [doc, ""]
        lines += [*_TABLE_HEAD, *_settings_rows(model.model_fields, f"{sec}.", rs.SECRETS), ""]
    fixed, owned = loop_rules(loop_source or ROOT / "app" / "loop_config.py")
    if fixed or owned:
        lines += [
            "## What `rtrl run` fixes",
            "",
            "The closed loop (`rtrl run`, `rtrl part`) fits some settings to its tiny simulated tasks "
            "(`app.loop_config.LOOP_FIXED`) and decides others itself (`app.loop_config.LOOP_OWNS`). A value you set "
            "otherwise is refused with the reason, never silently changed; the other jobs (`rtrl flow`, "
            "`rtrl train`, `torchrun -m trainer`) use your values.",
            "",
        ]
        if fixed:
            lines += ["| setting | the loop uses | why |", "|---|---|---|"]
            lines += [f"| `{n}` | {code(v)} | {cell(why)} |" for n, v, why in fixed]
            lines.append("")
        if owned:
            lines += ["| setting | decided by the loop |", "|---|---|"]
            lines += [f"| `{n}` | {cell(why)} |" for n, why in owned]
            lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _is_section(annotation: Any) -> typing.TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _module_constants(path: Path, depth: int = 1) -> dict[str, Any]:
    """Module-level constants of a Python file, read from its source (``A = 1``, ``A, B = 1, 2``,
    ``A: int = 1``), and - ``depth`` levels deep - the names it imports from project modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and depth > 0 and node.module and node.level == 0:
            target = ROOT / Path(*node.module.split(".")).with_suffix(".py")
            if target.exists():
                theirs = _module_constants(target, depth - 1)
                for alias in node.names:
                    if alias.name in theirs:
                        out[alias.asname or alias.name] = theirs[alias.name]
            continue
        targets: list[ast.expr]
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        try:
            v = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError):
            continue
        for t in targets:
            if isinstance(t, ast.Name):
                out[t.id] = v
            elif isinstance(t, ast.Tuple) and isinstance(v, tuple) and len(t.elts) == len(v):
                for e, x in zip(t.elts, v):
                    if isinstance(e, ast.Name):
                        out[e.id] = x
    return out


def loop_rules(path: Path) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """``LOOP_FIXED`` as (setting, value, why) and ``LOOP_OWNS`` as (setting, why), read from ``path``'s
    source; a value that is a constant of the module (or one it imports) is shown resolved."""
    if not path.exists():
        return [], []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    consts = _module_constants(path)
    fixed: list[tuple[str, str, str]] = []
    owned: list[tuple[str, str]] = []
    for node in tree.body:
        name = value = None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name, value = node.target.id, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        if name not in ("LOOP_FIXED", "LOOP_OWNS") or not isinstance(value, ast.Dict):
            continue
        for k, v in zip(value.keys, value.values):
            if not isinstance(k, ast.Constant):
                continue
            if name == "LOOP_OWNS" and isinstance(v, ast.Constant):
                owned.append((str(k.value), str(v.value)))
            elif name == "LOOP_FIXED" and isinstance(v, ast.Tuple) and len(v.elts) == 2:
                expr, why = v.elts
                try:
                    shown = toml(ast.literal_eval(expr))
                except ValueError:
                    src = ast.unparse(expr)
                    shown = toml(consts[src]) if src in consts else src
                fixed.append((str(k.value), shown, str(ast.literal_eval(why))))
    return fixed, owned
