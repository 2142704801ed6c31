"""Piper graph rewrites that keep the outputs: each LayerNorm as one operator.

VITS normalizes channels as Transpose -> ReduceMean, Sub, Pow(2), ReduceMean,
Add(eps), Sqrt, Div, Mul(gamma), Add(beta) -> Transpose: nine small operators
per LayerNorm, since piper's exports are opset 15, older than ONNX's
LayerNormalization. onnxruntime's own LayerNorm fusion does not match them:
its transpose optimizer first moves the transposes away, which leaves the
means over the channel axis instead of the last. So `fuse_layer_norms`
rewrites the nine into one LayerNormalization over the last axis before
onnxruntime sees the graph (the transposes stay; onnxruntime runs
LayerNormalization at every opset). joe's text part has 36 of them (text
encoder and duration predictor); measured when the rewrite was made, on one
thread it went from 24.7 to 22.2 ms, its durations equal and z_p within 7e-6
(spinning on both cores: docs/benchmarks.md, "Decoder windows", text part).
The loader checks each rewrite against the original at load and keeps
the original where they differ.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: the operators of one decomposed LayerNorm, in graph order after its first ReduceMean
_PATTERN = ("Sub", "Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul", "Add")


def fuse_layer_norms(graph: bytes) -> tuple[bytes, int]:
    """The graph with each decomposed LayerNorm as one LayerNormalization, and how many.

    (graph, 0) unchanged where none is found.
    """
    import onnx
    from onnx import helper

    model = onnx.load_from_string(graph)
    nodes = list(model.graph.node)
    constants = _constants(model)
    readers: dict[str, list[Any]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    fused: dict[str, Any] = {}  # name of a pattern's first node -> its LayerNormalization
    dropped: set[str] = set()
    for node in nodes:
        if node.op_type == "ReduceMean" and node.name not in dropped:
            match = _match(node, readers, constants)
            if match is not None:
                parts, eps, gamma, beta = match
                dropped.update(part.name for part in parts)
                fused[node.name] = helper.make_node(
                    "LayerNormalization", [node.input[0], gamma, beta], [parts[-1].output[0]],
                    name=f"{node.name}/LayerNormalization", axis=-1, epsilon=eps)
    if not fused:
        return graph, 0
    kept = [fused.get(node.name, node) for node in nodes if node.name in fused
            or node.name not in dropped]
    # The epsilons and exponents the LayerNorms no longer read go too (onnxruntime
    # would warn about each unused initializer at every session it opens).
    read = {name for node in kept for name in node.input} | {out.name for out in model.graph.output}
    kept = [node for node in kept if node.op_type != "Constant" or node.output[0] in read]
    unused = [init for init in model.graph.initializer if init.name not in read]
    for init in unused:
        model.graph.initializer.remove(init)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model.SerializeToString(), len(fused)


def _match(mean: Any, readers: dict[str, list[Any]],
           constants: dict[str, np.ndarray]) -> tuple[list[Any], float, str, str] | None:
    """(the nine nodes, epsilon, gamma, beta) of the LayerNorm that begins at `mean`, or None."""
    x = mean.input[0]
    if _axes(mean) != [-1] or not _keeps_dims(mean):
        return None
    parts = [mean]
    sub = _only_reader(mean.output[0], readers)
    if sub is None or sub.op_type != "Sub" or list(sub.input) != [x, mean.output[0]]:
        return None
    centered = readers.get(sub.output[0], [])  # Pow and Div both read x - mean
    power = next((n for n in centered if n.op_type == "Pow"), None)
    divide = next((n for n in centered if n.op_type == "Div"), None)
    if len(centered) != 2 or power is None or divide is None:
        return None
    variance = _only_reader(power.output[0], readers)
    plus_eps = variance and _only_reader(variance.output[0], readers)
    root = plus_eps and _only_reader(plus_eps.output[0], readers)
    scale = _only_reader(divide.output[0], readers)
    shift = scale and _only_reader(scale.output[0], readers)
    parts += [sub, power, variance, plus_eps, root, divide, scale, shift]
    if any(part is None for part in parts) or tuple(p.op_type for p in parts[1:]) != _PATTERN:
        return None
    exponent, eps = constants.get(power.input[1]), constants.get(plus_eps.input[1])
    if (exponent is None or exponent.size != 1 or float(exponent) != 2.0
            or eps is None or eps.size != 1):
        return None
    if (_axes(variance) != [-1] or not _keeps_dims(variance)
            or list(divide.input) != [sub.output[0], root.output[0]]):
        return None
    gamma, beta = scale.input[1], shift.input[1]
    if scale.input[0] != divide.output[0] or shift.input[0] != scale.output[0]:
        return None
    if any(constants.get(name) is None or constants[name].ndim != 1 for name in (gamma, beta)):
        return None  # LayerNormalization takes per-channel weights of the last axis only
    return parts, float(eps), gamma, beta


def _only_reader(name: str, readers: dict[str, list[Any]]) -> Any:
    found = readers.get(name, [])
    return found[0] if len(found) == 1 else None


def _axes(node: Any) -> list[int] | None:
    from onnx import helper

    for attribute in node.attribute:
        if attribute.name == "axes":
            return list(helper.get_attribute_value(attribute))
    return None  # opset 18 passes axes as an input: not this pattern


def _keeps_dims(node: Any) -> bool:
    return all(attribute.i == 1 for attribute in node.attribute if attribute.name == "keepdims")


def _constants(model: Any) -> dict[str, np.ndarray]:
    """Initializers and Constant node outputs by name."""
    from onnx import numpy_helper

    found = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            found[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return found
