"""Piper voices cut into graphs at their flow and decoder (onnx graph surgery, at load).

A Piper VITS graph is a text part (text encoder, duration predictor, the
prior `z_p` drawn over the expanded frames), a flow (WaveNet coupling layers,
`z_p` -> the latent), and a HiFi-GAN decoder that turns the masked latent
[B, 192, T] (T frames of `hop_length` samples) into audio. The decoder begins
at `/dec/conv_pre/Conv` (`DECODER_ENTRY`); its input is `flow(z_p) * mask`.
This module owns the cuts, made with onnx's Extractor (the file on disk is
never changed), into three graphs:

- the front part: the voice's inputs -> (z_p, mask, durations), once per segment;
- the flow: (z_p, mask) -> latent, run on slices of a segment's frames;
- the decoder: latent (plus `sid` for multi-speaker voices) -> audio, run over
  windows of the latent (engine/backends/piper/windows.py runs both on slices,
  engine/backends/piper/plan.py sizes them).

A graph without the decoder cut (an unknown export) is not split:
`split_voice` returns None, the loader logs it and the backend synthesizes
whole segments; one whose flow cannot be cut out keeps the flow in its front
part (`SplitGraphs.flow` None) and streams the decoder alone. It also owns
the decoder's 2-D form (`decoder_as_2d`): on one thread onnxruntime's blocked
x86 kernels take 2-D convolutions, ~20% faster on joe and equal to float
rounding (on several threads they are slower, and the 1-D graph stays).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger("voxgate.engine")

DECODER_ENTRY = "/dec/conv_pre/Conv"


@dataclass(slots=True)
class SplitGraphs:
    """The serialized graphs and the tensor names that join them.

    With `flow` the front part outputs (z_p, mask, durations) and the flow
    graph takes `flow_inputs` (z_p, mask, then graph inputs it also needs);
    without it the front part outputs (latent, durations).
    """

    front: bytes
    decoder: bytes
    latent_name: str
    decoder_inputs: tuple[str, ...]  # latent first, then graph inputs it also needs (sid)
    flow: bytes | None = None
    flow_inputs: tuple[str, ...] = ()


def split_voice(model: Any) -> SplitGraphs | None:
    """Cut a patched piper graph (outputs: audio, durations) at its flow and decoder.

    None if the decoder cannot be cut out; `flow` None if only the flow cannot.
    """
    from onnx.utils import Extractor

    graph = model.graph
    entry = next((n for n in graph.node if n.name == DECODER_ENTRY), None)
    if entry is None or len(graph.output) != 2:
        return None
    latent = entry.input[0]
    audio_name, durations_name = graph.output[0].name, graph.output[1].name
    inputs = [i.name for i in graph.input]
    extra = _inputs_needed(model, audio_name, {latent}, inputs)
    try:
        extractor = Extractor(model)
        decoder = extractor.extract_model([latent, *extra], [audio_name])
    except Exception as exc:  # noqa: BLE001 - onnx raises its own types for a graph it cannot cut
        logger.warning("piper graph cannot be split at %s: %s", DECODER_ENTRY, exc)
        return None
    if any(i.name == durations_name for i in decoder.graph.input):
        return None  # the decoder depends on the durations: not the graph we know
    split = SplitGraphs(b"", decoder.SerializeToString(), latent, (latent, *extra))
    flow = _split_flow(extractor, model, latent, inputs, durations_name)
    if flow is not None:
        split.front, split.flow, split.flow_inputs = flow
        return split
    try:  # the flow stays in the front part
        split.front = extractor.extract_model(inputs, [latent, durations_name]).SerializeToString()
    except Exception as exc:  # noqa: BLE001 - as above
        logger.warning("piper graph cannot be split at %s: %s", DECODER_ENTRY, exc)
        return None
    return split


def _split_flow(extractor: Any, model: Any, latent: str, inputs: list[str],
                durations_name: str) -> tuple[bytes, bytes, tuple[str, ...]] | None:
    """(front part up to z_p and mask, the flow, the flow's inputs); None (logged) if it cannot."""
    cut = _flow_cut(model, latent)
    if cut is None:
        logger.warning("piper graph: no flow input found before %s; the flow runs whole",
                       DECODER_ENTRY)
        return None
    flow_inputs = (*cut, *_inputs_needed(model, latent, set(cut), inputs))
    try:
        flow = extractor.extract_model(list(flow_inputs), [latent])
        front = extractor.extract_model(inputs, [*cut, durations_name])
    except Exception as exc:  # noqa: BLE001 - onnx raises its own types for a graph it cannot cut
        logger.warning("piper graph: the flow cannot be cut out (%s); it runs whole", exc)
        return None
    if {i.name for i in flow.graph.input} != set(flow_inputs):
        logger.warning("piper graph: the flow reads more than (z_p, mask); it runs whole")
        return None
    return front.SerializeToString(), flow.SerializeToString(), flow_inputs


def _flow_cut(model: Any, latent: str) -> tuple[str, str] | None:
    """(z_p, mask): the flow's input and the frame mask, found by the graph's shape.

    The latent is `Mul(flow(z_p), mask)`; z_p is `m_p + noise * exp(logs_p) * noise_scale`,
    the first Add after the graph's last RandomNormalLike.
    """
    nodes = list(model.graph.node)
    producer = {out: node for node in nodes for out in node.output}
    product = producer.get(latent)
    if product is None or product.op_type != "Mul" or len(product.input) != 2:
        return None
    mask = product.input[1]
    noises = [n for n in nodes if n.op_type == "RandomNormalLike"]
    if not noises:
        return None
    consumers: dict[str, list[Any]] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    frontier = [noises[-1].output[0]]
    for _ in range(4):  # noise -> Mul(exp(logs_p)) -> Mul(noise_scale) -> Add(m_p)
        following = [n for name in frontier for n in consumers.get(name, [])]
        adds = [n for n in following if n.op_type == "Add"]
        if adds:
            return adds[0].output[0], mask
        frontier = [out for n in following for out in n.output]
    return None


def _inputs_needed(model: Any, output: str, stops: set[str], inputs: list[str]) -> tuple[str, ...]:
    """The graph inputs reached walking back from `output` without passing `stops`."""
    producer = {out: node for node in model.graph.node for out in node.output}
    seen: set[str] = set()
    todo = [output]
    while todo:
        name = todo.pop()
        if name in seen or name in stops:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None:
            todo.extend(i for i in node.input if i)
    return tuple(name for name in inputs if name in seen)


# Ops the 2-D form carries over unchanged: elementwise on same-shaped tensors or scalars.
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "LeakyRelu", "Relu", "Tanh", "Identity"})


def decoder_as_2d(decoder: bytes) -> bytes | None:
    """The decoder with every 1-D convolution as a 2-D one of height 1, or None.

    onnxruntime runs 2-D convolutions on x86 in its blocked (NCHWc) kernels and
    1-D ones through im2col: measured on joe with one thread, a 152-frame window
    decodes in 90-95 ms against 112-115 ms, equal to 1.3e-7; with two threads
    the blocked kernels are slower (80 against 60 ms), so the loader uses this
    form for one-thread sessions only (docs/history.md, "Piper: graphs and
    runtimes"). The latent [B, C, T] enters through an Unsqueeze to
    [B, C, 1, T]; the output keeps its samples in order (callers reshape it).
    None for a graph with any other op (a multi-speaker decoder's speaker
    conditioning, say): that one runs as it is.
    """
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load_from_string(decoder)
    graph = model.graph
    if len(graph.input) != 1 or len(graph.output) != 1:
        return None
    weights = {init.name: init for init in graph.initializer}
    constants = {node.output[0]: node for node in graph.node if node.op_type == "Constant"}

    def is_scalar(name: str) -> bool:
        if name in weights:
            return int(np.prod(weights[name].dims)) == 1
        node = constants.get(name)
        return node is not None and int(np.prod(node.attribute[0].t.dims)) == 1

    output = graph.output[0].name
    for node in graph.node:
        if node.op_type in ("Conv", "ConvTranspose"):
            weight = weights.get(node.input[1])
            if weight is None or len(weight.dims) != 3:
                return None
            for attr in node.attribute:
                if attr.name in ("kernel_shape", "strides", "dilations", "output_padding"):
                    attr.ints[:] = [1 if attr.name != "output_padding" else 0, *attr.ints]
                elif attr.name == "pads":
                    begin, end = list(attr.ints)
                    attr.ints[:] = [0, begin, 0, end]
                elif attr.name not in ("group",):
                    return None  # auto_pad and the like: not the graph we know
            array = numpy_helper.to_array(weight)
            weight.CopyFrom(numpy_helper.from_array(array[:, :, None, :], weight.name))
        elif node.op_type == "Unsqueeze" and node.output[0] == output:
            node.op_type = "Identity"  # the samples are already in order: [B, 1, 1, T]
            del node.input[1:]
            del node.attribute[:]
        elif node.op_type == "Constant" or (
                node.op_type in _ELEMENTWISE and all(
                    is_scalar(name) or name not in weights and name not in constants
                    for name in node.input)):
            continue
        else:
            return None
    latent = graph.input[0].name
    lifted = latent + "/as_2d"
    for node in graph.node:
        node.input[:] = [lifted if name == latent else name for name in node.input]
    graph.initializer.append(numpy_helper.from_array(np.array([2], dtype=np.int64),
                                                     lifted + "/axes"))
    graph.node.insert(0, helper.make_node("Unsqueeze", [latent, lifted + "/axes"], [lifted],
                                          name=lifted))
    used = {name for node in graph.node for name in node.input}
    for init in [init for init in graph.initializer if init.name not in used]:
        graph.initializer.remove(init)
    del graph.value_info[:]  # the 3-D shapes recorded inside no longer hold
    out_type = graph.output[0].type.tensor_type
    out_type.ClearField("shape")
    return model.SerializeToString()


def latent_channels(decoder: bytes, latent_name: str) -> int | None:
    """Channels of the decoder's latent input, read off the first convolution's weight."""
    import onnx

    graph = onnx.load_from_string(decoder).graph
    weights = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Conv" and node.input[0] == latent_name and node.input[1] in weights:
            return int(weights[node.input[1]].dims[1])
    return None
