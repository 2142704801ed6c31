"""Read a CosyVoice training yaml as plain data, executing nothing.

The official `cosyvoice2.yaml` / `cosyvoice3.yaml` are HyperPyYAML: tags such
as `!new:cosyvoice.llm.llm.Qwen2LM`, `!name:...`, `!apply:...` would import
and call Python objects, and `!ref <a> * <b>` refers to (and computes with)
other keys. We only need the numbers, so each tagged node becomes a dict:

    !new:pkg.Cls {k: v}   ->  {"_kind": "new", "_target": "pkg.Cls", "k": v}
    !apply:fn [a, b]      ->  {"_kind": "apply", "_target": "fn", "_args": [a, b]}
    !ref <x>              ->  the value of top-level key x (after resolution)
    !ref <a> * <b>        ->  a * b, for + - * / // % ** and parentheses only
    !ref <root>/file.txt  ->  "value-of-root/file.txt" (string interpolation)

`<x[k]>` follows a key inside x. Nothing is imported or called.
"""

from __future__ import annotations

import ast
import copy
import operator
import re
from pathlib import Path
from typing import Any

import yaml

_REF_RE = re.compile(r"<([A-Za-z_][\w.]*)((?:\[[^\]]+\])*)>")
_INDEX_RE = re.compile(r"\[([^\]]+)\]")


class YamlRefError(ValueError):
    """A `!ref` names a key that does not exist, or refers to itself."""


class _Ref:
    """A `!ref`/`!copy` expression awaiting resolution against the whole document."""

    __slots__ = ("expr", "is_copy")

    def __init__(self, expr: str, is_copy: bool = False) -> None:
        self.expr = expr
        self.is_copy = is_copy


class _Loader(yaml.SafeLoader):  # type: ignore[misc]
    """SafeLoader that knows HyperPyYAML's tags and reads `1e-5` as a float."""


# PyYAML (YAML 1.1) reads `1e-06` as a string; HyperPyYAML users mean a float.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _tagged(kind: str) -> Any:
    def construct(loader: _Loader, suffix: str, node: yaml.Node) -> dict[str, Any]:
        out: dict[str, Any] = {"_kind": kind, "_target": suffix}
        if isinstance(node, yaml.MappingNode):
            out.update(loader.construct_mapping(node, deep=True))
        elif isinstance(node, yaml.SequenceNode):
            out["_args"] = loader.construct_sequence(node, deep=True)
        else:
            value = loader.construct_scalar(node)
            if value not in ("", None):
                out["_args"] = [value]
        return out

    return construct


def _construct_ref(loader: _Loader, node: yaml.Node) -> _Ref:
    return _Ref(str(loader.construct_scalar(node)))


def _construct_copy(loader: _Loader, node: yaml.Node) -> _Ref:
    return _Ref(str(loader.construct_scalar(node)), is_copy=True)


def _construct_tuple(loader: _Loader, node: yaml.Node) -> tuple[Any, ...]:
    if isinstance(node, yaml.SequenceNode):
        return tuple(loader.construct_sequence(node, deep=True))
    text = str(loader.construct_scalar(node))
    return tuple(yaml.safe_load(f"[{text.strip('()')}]"))


def _construct_unknown(loader: _Loader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    out: dict[str, Any] = _tagged("tag")(loader, suffix, node)
    return out


_Loader.add_constructor("!ref", _construct_ref)
_Loader.add_constructor("!copy", _construct_copy)
_Loader.add_constructor("!tuple", _construct_tuple)
_Loader.add_multi_constructor("!new:", _tagged("new"))
_Loader.add_multi_constructor("!name:", _tagged("name"))
_Loader.add_multi_constructor("!apply:", _tagged("apply"))
_Loader.add_multi_constructor("!", _construct_unknown)

_BINOPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _eval_arithmetic(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval_arithmetic(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval_arithmetic(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval_arithmetic(node.left), _eval_arithmetic(node.right))
    raise ValueError("not arithmetic")


class _Resolver:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.active: set[str] = set()

    def lookup(self, name: str, indices: str) -> Any:
        if name in self.active:
            raise YamlRefError(f"!ref <{name}> refers to itself")
        if name not in self.doc:
            raise YamlRefError(f"!ref <{name}>: expected a top-level key, got none named {name!r}")
        self.active.add(name)
        try:
            value = self.resolve(self.doc[name])
            self.doc[name] = value
        finally:
            self.active.discard(name)
        for key in _INDEX_RE.findall(indices):
            key = key.strip("'\"")
            try:
                value = value[int(key)] if isinstance(value, list) else value[key]
            except (KeyError, IndexError, ValueError) as exc:
                raise YamlRefError(f"!ref <{name}{indices}>: no entry {key!r}") from exc
        return value

    def resolve_ref(self, ref: _Ref) -> Any:
        expr = ref.expr.strip()
        whole = _REF_RE.fullmatch(expr)
        if whole:
            value = self.lookup(whole.group(1), whole.group(2))
            return copy.deepcopy(value) if ref.is_copy else value
        values: list[Any] = []

        def substitute(match: re.Match[str]) -> str:
            values.append(self.lookup(match.group(1), match.group(2)))
            return repr(values[-1]) if isinstance(values[-1], (int, float)) else str(values[-1])

        text = _REF_RE.sub(substitute, expr)
        if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            try:
                return _eval_arithmetic(ast.parse(text, mode="eval"))
            except (SyntaxError, ValueError, ZeroDivisionError):
                pass
        return text

    def resolve(self, value: Any) -> Any:
        if isinstance(value, _Ref):
            return self.resolve_ref(value)
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.resolve(v) for v in value)
        return value


def load_hyperyaml(text: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse HyperPyYAML text into plain data (dicts, lists, numbers, strings).

    `overrides` replace top-level keys before references are resolved, as
    HyperPyYAML's `overrides=` does (upstream sets `qwen_pretrain_path`).
    """
    doc = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    if not isinstance(doc, dict):
        raise TypeError(f"expected a yaml mapping at the top level, got {type(doc).__name__}")
    doc.update(overrides or {})
    resolver = _Resolver(doc)
    for key in list(doc):
        doc[key] = resolver.lookup(key, "")
    return doc


def load_hyperyaml_file(path: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    return load_hyperyaml(Path(path).read_text(encoding="utf-8"), overrides)
