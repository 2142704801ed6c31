"""The gateway's imports run one way (docs/architecture.md, "The rooms"): each room imports only
rooms below it, read from the source (imports for type checking alone do not count)."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[3] / "gateway"
#: bottom to top, as the drawing has them: a module imports only from layers below its own
LAYERS = [
    {"errors", "bodies", "text", "audio", "metrics"},  # leaves
    {"access"},
    {"voices"},
    {"stream"},
    {"config"},
    {"state"},
    {"http", "compat"},
    {"app"},
    {"ray_serve", "workers"},
    {"cli"},
]


def _room(parts: list[str]) -> str | None:
    """`gateway.stream.session` -> "stream", `gateway.errors` -> "errors"."""
    return parts[1] if len(parts) > 1 and parts[0] == "gateway" else None


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def test_every_gateway_import_goes_to_a_lower_layer() -> None:
    layer_of = {room: n for n, rooms in enumerate(LAYERS) for room in rooms}
    upward: list[str] = []
    for path in sorted(GATEWAY.rglob("*.py")):
        parts = ["gateway", *path.relative_to(GATEWAY).with_suffix("").parts]
        source = _room(parts)
        if source is None or source == "__init__":
            continue
        assert source in layer_of, f"{source} is in no layer: place it in LAYERS and the drawing"
        for name in _imports(path):
            target = _room(name.split("."))
            if target is not None and target != source and layer_of[target] >= layer_of[source]:
                upward.append(f"{path.relative_to(GATEWAY.parent)} imports {name}")
    assert upward == []
