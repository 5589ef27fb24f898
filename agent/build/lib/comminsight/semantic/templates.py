"""Step templates: small TOML files that teach the engine a parallel layout.

A template names token rules; each rule matches event signatures (op, communicator role,
size) and gives them a class: ``start`` (may open a step), ``end`` (closes the body of a
step) or ``neutral`` (ignored by the state machine). The state machine per rank is:

    a step opens at the first run of at least ``min_run`` consecutive start tokens
    (neutral and unmatched events do not break a run) that follows an end token,
    or that begins the trace.

The format is specified in docs/semantic.md; the built-in templates live in
comminsight/templates/*.toml and users pass their own with ``--template FILE``.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from comminsight.evidence.schema import OPS
from comminsight.semantic.roles import N_SIGNATURES, OP_CODE, ROLE_CODE, ROLES

NEUTRAL, START, END = 0, 1, 2
_CLASSES = {"neutral": NEUTRAL, "start": START, "end": END}
_RULE_KEYS = {"name", "class", "ops", "roles", "min_bytes", "max_bytes"}
_TOP_KEYS = {"name", "description", "min_run", "requires", "requires_any", "tokens"}
MAX_TEMPLATE_BYTES = 64 * 1024
MAX_RULES = 64


class TemplateError(ValueError):
    """A template file that does not follow the format; the message says where."""


@dataclass(frozen=True)
class TokenRule:
    name: str
    cls: int
    ops: frozenset[str] | None
    roles: frozenset[str] | None
    min_bytes: int | None
    max_bytes: int | None


@dataclass(frozen=True)
class Template:
    name: str
    description: str
    min_run: int
    requires: tuple[str, ...]
    requires_any: tuple[str, ...]
    tokens: tuple[TokenRule, ...]

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(class per signature, token index per signature or -1): lookup tables for numpy."""
        cls = np.zeros(N_SIGNATURES, dtype=np.int8)
        tok = np.full(N_SIGNATURES, -1, dtype=np.int16)
        for role in ROLES:
            for op in OPS:
                for bucket in range(64):
                    lo = 0 if bucket == 0 else 1 << (bucket - 1)  # smallest size in this bucket
                    hi = 0 if bucket == 0 else (1 << bucket) - 1  # largest
                    for i, rule in enumerate(self.tokens):
                        if rule.ops is not None and op not in rule.ops:
                            continue
                        if rule.roles is not None and role not in rule.roles:
                            continue
                        # Sizes compare by power-of-two bucket; unknown sizes match no size rule.
                        if rule.min_bytes is not None and (bucket == 0 or hi < rule.min_bytes):
                            continue
                        if rule.max_bytes is not None and (bucket == 0 or lo > rule.max_bytes):
                            continue
                        sig = (ROLE_CODE[role] * 16 + OP_CODE[op]) * 64 + bucket
                        cls[sig] = rule.cls
                        tok[sig] = i
                        break
        return cls, tok


def _str_list(value: object, where: str, allowed: set[str] | None = None) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or len(value) > 64:
        raise TemplateError(f"{where}: expected a list of strings")
    if allowed is not None:
        unknown = set(value) - allowed
        if unknown:
            raise TemplateError(f"{where}: unknown {sorted(unknown)} (known: {sorted(allowed)})")
    return frozenset(value)


def _int(value: object, where: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise TemplateError(f"{where}: expected a whole number in [{lo}, {hi}]")
    return value


def parse_template(text: str, origin: str = "<template>") -> Template:
    """Parse and validate one template from TOML text."""
    if len(text.encode()) > MAX_TEMPLATE_BYTES:
        raise TemplateError(f"{origin}: template is larger than {MAX_TEMPLATE_BYTES} bytes")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TemplateError(f"{origin}: not valid TOML: {exc}") from exc
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise TemplateError(f"{origin}: unknown keys {sorted(unknown)}")
    name = doc.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise TemplateError(f"{origin}: 'name' must be a non-empty string of at most 64 characters")
    rules_doc = doc.get("tokens")
    if not isinstance(rules_doc, list) or not rules_doc or len(rules_doc) > MAX_RULES:
        raise TemplateError(f"{origin}: 'tokens' must be a list of 1 to {MAX_RULES} tables ([[tokens]])")
    rules = []
    for i, rule in enumerate(rules_doc):
        where = f"{origin}: tokens[{i}]"
        if not isinstance(rule, dict):
            raise TemplateError(f"{where}: expected a table")
        bad = set(rule) - _RULE_KEYS
        if bad:
            raise TemplateError(f"{where}: unknown keys {sorted(bad)}")
        rname = rule.get("name")
        if not isinstance(rname, str) or not rname:
            raise TemplateError(f"{where}: 'name' must be a non-empty string")
        cls = rule.get("class")
        if cls not in _CLASSES:
            raise TemplateError(f"{where}: 'class' must be one of {sorted(_CLASSES)}")
        rules.append(
            TokenRule(
                name=rname,
                cls=_CLASSES[cls],
                ops=_str_list(rule["ops"], f"{where}.ops", set(OPS)) if "ops" in rule else None,
                roles=_str_list(rule["roles"], f"{where}.roles", set(ROLES)) if "roles" in rule else None,
                min_bytes=_int(rule["min_bytes"], f"{where}.min_bytes", 0, 1 << 62) if "min_bytes" in rule else None,
                max_bytes=_int(rule["max_bytes"], f"{where}.max_bytes", 0, 1 << 62) if "max_bytes" in rule else None,
            )
        )
    names = {r.name for r in rules}
    requires = tuple(_str_list(doc.get("requires", []), f"{origin}: requires", names))
    requires_any = tuple(_str_list(doc.get("requires_any", []), f"{origin}: requires_any", names))
    if not any(r.cls == START for r in rules):
        raise TemplateError(f"{origin}: at least one token must have class 'start'")
    description = doc.get("description", "")
    if not isinstance(description, str):
        raise TemplateError(f"{origin}: 'description' must be a string")
    return Template(
        name=name,
        description=description,
        min_run=_int(doc.get("min_run", 1), f"{origin}: min_run", 1, 1024),
        requires=tuple(sorted(requires)),
        requires_any=tuple(sorted(requires_any)),
        tokens=tuple(rules),
    )


def load_template(path: Path | str) -> Template:
    """Read a template file (bounded size)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise TemplateError(f"{path}: {exc.strerror}") from exc
    if size > MAX_TEMPLATE_BYTES:
        raise TemplateError(f"{path}: template is larger than {MAX_TEMPLATE_BYTES} bytes")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"{path}: cannot read: {exc}") from exc
    return parse_template(text, str(path))


def builtin_templates() -> list[Template]:
    """The templates shipped in comminsight/templates, in the order they are tried."""
    order = ("megatron", "fsdp", "ddp")
    root = resources.files("comminsight.templates")
    found = {}
    for entry in root.iterdir():
        if entry.name.endswith(".toml"):
            template = parse_template(entry.read_text(encoding="utf-8"), f"comminsight/templates/{entry.name}")
            found[template.name] = template
    return [found[n] for n in order if n in found] + [t for n, t in sorted(found.items()) if n not in order]
