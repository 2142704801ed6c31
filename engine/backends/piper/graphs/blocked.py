"""The 2-D decoder with its activations kept in onnxruntime's blocked layout between convolutions.

On x86 onnxruntime runs a 2-D convolution in its blocked (NCHWc) kernels:
its optimizer wraps each one in a ReorderInput (plain -> blocked) and a
ReorderOutput (blocked -> plain), and fuses away only the pairs that meet
directly. HiFi-GAN's residual blocks put an Add and a LeakyRelu between every
two convolutions, which it runs on plain tensors, and its upsampling
ConvTransposes have no blocked kernel, so joe's decoder reordered 34 times
per call: 19 of its 97 ms on one thread, as measured when this form was
written (the three forms now: docs/benchmarks.md, "Decoder windows").

`blocked_decoder` first writes each ConvTranspose as one Conv over its
stride's phases and an interleave (`_polyphase`), which the blocked kernels
run. It then takes onnxruntime's own optimized graph (its blocked weights,
its block size: made on this machine, at load, never stored) and runs every
Add, LeakyRelu, Div and the like whose tensor inputs are all blocked (or
scalars) on the blocked tensors: they act on each element alone, so either
layout gives the same result. A plain input that such an operator reads is
reordered once for all its readers. A convolution whose only reader adds its
output to another blocked tensor takes that tensor as its `Sum` input (the
kernel adds it before its activation, as onnxruntime's own fusion does in
ResNets). What is left is a pair of reorders around each interleave, and the
graph's input and output. The loader checks the result against the
original at load and keeps the original where they differ.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

_NCHWC = "com.microsoft.nchwc"
#: operators that act on each element alone (with scalars at most): any layout gives the same
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "LeakyRelu", "Relu", "Tanh", "Sigmoid"})


def blocked_decoder(decoder: bytes, latent_channels: int) -> bytes | None:
    """The decoder (a 2-D graph, `graphs.split.decoder_as_2d`) with fewer layout reorders.

    `latent_channels` is the channel count of its input [B, C, T]. None where
    onnxruntime blocks nothing on this machine (no NCHWc kernels, or no 2-D
    convolution) or where no reorder can go.
    """
    import onnx

    decoder = _polyphase(decoder)
    channels = _channels(onnx.load_from_string(decoder), latent_channels)
    model = onnx.load_from_string(_optimized(decoder))
    graph = model.graph
    num_before = _num_reorders(graph.node)
    if num_before == 0:
        return None
    nodes, blocked = _blocked_elementwise(graph, channels)
    nodes = _fuse_sums(_drop_dead(nodes, graph), blocked)
    if _num_reorders(nodes) >= num_before:
        return None
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    return bytes(model.SerializeToString())


def _polyphase(graph: bytes) -> bytes:
    """The graph with each ConvTranspose (stride s, kernel K) as one Conv of s phases, interleaved.

    Output sample q * s + r of a transposed convolution is the sum over j of
    x[q - j] @ W[r + j * s]: phase r is a plain convolution of x with J = ceil(K / s)
    taps. One Conv with s * C_out channels (channel co * s + r) computes every
    phase, on the blocked kernels; Reshape, Transpose and Reshape put the
    phases' samples in order and a Slice cuts the ConvTranspose's pads (and the
    phases' samples past its kernel). A
    ConvTranspose with any other attribute (groups, dilations, output padding)
    stays.
    """
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load_from_string(graph)
    weights = {init.name: init for init in model.graph.initializer}
    nodes: list[Any] = []
    for node in model.graph.node:
        attributes = _attributes(node)
        shape = attributes.get("kernel_shape", [])
        if (node.op_type != "ConvTranspose" or node.input[1] not in weights or len(shape) != 2
            or shape[0] != 1
                or len(node.input) > 2 and node.input[2] and node.input[2] not in weights
                or set(attributes) - {"kernel_shape", "strides", "pads", "dilations", "group",
                                      "output_padding"}
                or attributes.get("group", 1) != 1
            or list(attributes.get("dilations", [1, 1])) != [1, 1]
                or any(attributes.get("output_padding", [0, 0]))):
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(weights[node.input[1]])  # [C_in, C_out, 1, K]
        num_in, num_out, _, size = weight.shape
        stride = int(attributes.get("strides", [1, 1])[1])
        pads = list(attributes.get("pads", [0, 0, 0, 0]))
        if len(pads) != 4 or pads[0] or pads[2]:
            nodes.append(node)
            continue
        taps = -(-size // stride)
        padded = np.zeros((num_in, num_out, taps * stride), np.float32)
        padded[:, :, :size] = weight[:, :, 0, :]
        # phases[co * s + r, ci, 0, t] = W[ci, co, 0, r + (J - 1 - t) * s]: a correlation
        # over x padded by J - 1 each side gives x[q - j] @ W[r + j * s] summed over j.
        phases = padded.reshape(num_in, num_out, taps, stride)[:, :, ::-1, :]  # [C_in, C_out, J, s]
        phases = np.ascontiguousarray(phases.transpose(1, 3, 0, 2)).reshape(
            num_out * stride, num_in, 1, taps)
        bias = (numpy_helper.to_array(weights[node.input[2]]) if len(node.input) > 2
                and node.input[2]
                else np.zeros(num_out, np.float32))
        out = node.output[0]
        model.graph.initializer.extend([
            numpy_helper.from_array(phases.astype(np.float32), f"{out}/phase_weight"),
            numpy_helper.from_array(np.repeat(bias, stride).astype(np.float32),
                                    f"{out}/phase_bias"),
            numpy_helper.from_array(np.array([0, num_out, stride, -1], np.int64),
                                    f"{out}/by_phase"),
            numpy_helper.from_array(np.array([0, num_out, 1, -1], np.int64), f"{out}/in_order"),
            numpy_helper.from_array(np.array([pads[1]], np.int64), f"{out}/start"),
            # the phases cover (Q) * s = (T - 1) * s + J * s samples, the transpose (T - 1) * s + K
            numpy_helper.from_array(np.array([-cut if (cut := pads[3] + taps * stride - size) else
                                              np.iinfo(np.int64).max], np.int64), f"{out}/end"),
            numpy_helper.from_array(np.array([3], np.int64), f"{out}/axis"),
        ])
        nodes += [
            helper.make_node("Conv", [node.input[0], f"{out}/phase_weight", f"{out}/phase_bias"],
                             [f"{out}/phases"],
                             name=f"{out}/phases", kernel_shape=[1, taps],
                             pads=[0, taps - 1, 0, taps - 1]),
            # [B, C_out * s, 1, Q] -> [B, C_out, s, Q] -> [B, C_out, Q, s] -> [B, C_out, 1, Q * s]
            helper.make_node("Reshape", [f"{out}/phases", f"{out}/by_phase"],
                             [f"{out}/by_phase_out"], name=f"{out}/by_phase"),
            helper.make_node("Transpose", [f"{out}/by_phase_out"], [f"{out}/interleaved"],
                             name=f"{out}/interleaved", perm=[0, 1, 3, 2]),
            helper.make_node("Reshape", [f"{out}/interleaved", f"{out}/in_order"],
                             [f"{out}/in_order_out"], name=f"{out}/in_order"),
            helper.make_node("Slice",
                             [f"{out}/in_order_out", f"{out}/start", f"{out}/end", f"{out}/axis"],
                             [out], name=f"{out}/unpadded"),
        ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    for init in [init for init in model.graph.initializer if init.name not in read]:
        model.graph.initializer.remove(init)
    return bytes(model.SerializeToString())


def _optimized(graph: bytes) -> bytes:
    """onnxruntime's own optimized form of `graph` on one thread of this machine."""
    import onnxruntime

    with tempfile.TemporaryDirectory(prefix="voxgate-decoder-") as folder:
        path = os.path.join(folder, "optimized.onnx")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.optimized_model_filepath = path
        # It warns that the file holds this machine's layout: it is read back at once.
        options.log_severity_level = 3
        onnxruntime.InferenceSession(graph, sess_options=options,
                                     providers=["CPUExecutionProvider"])
        with open(path, "rb") as file:
            return file.read()


def _channels(model: Any, latent_channels: int) -> dict[str, int]:
    """Channels (dimension 1) of every tensor whose count shape inference knows."""
    import onnx

    shape = model.graph.input[0].type.tensor_type.shape
    shape.Clear()
    for dim in ("batch", latent_channels, "frames"):
        entry = shape.dim.add()
        if isinstance(dim, int):
            entry.dim_value = dim
        else:
            entry.dim_param = dim
    inferred = onnx.shape_inference.infer_shapes(model).graph
    channels: dict[str, int] = {}
    for value in [*inferred.value_info, *inferred.input, *inferred.output]:
        dims = value.type.tensor_type.shape.dim
        if len(dims) >= 2 and dims[1].HasField("dim_value"):
            channels[value.name] = dims[1].dim_value
    return channels


def _attributes(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {attr.name: helper.get_attribute_value(attr) for attr in node.attribute}


def _is_reorder(node: Any, op_type: str) -> bool:
    return bool(node.domain == _NCHWC and node.op_type == op_type
                and not _attributes(node).get("channels_last", 0))


def _num_reorders(nodes: Any) -> int:
    return sum(_is_reorder(node, "ReorderInput") or _is_reorder(node, "ReorderOutput")
               for node in nodes)


def _blocked_elementwise(graph: Any, channels: dict[str, int]) -> tuple[list[Any], set[str]]:
    """The nodes with elementwise operators moved onto blocked tensors (dead nodes left in),
    and the names of the blocked tensors.

    Walks the graph in order (it is topologically sorted), keeping for each plain
    tensor the blocked one that holds its values, where there is one.
    """
    import onnx
    from onnx import helper

    sizes = {init.name: int(np.prod(init.dims)) for init in graph.initializer}
    sizes.update({node.output[0]: int(np.prod(node.attribute[0].t.dims))
                  for node in graph.node if node.op_type == "Constant"})
    reordered = {node.input[0] for node in graph.node if _is_reorder(node, "ReorderInput")}
    blocked: dict[str, str] = {}  # plain tensor -> the blocked tensor with its values
    width: dict[str, int] = {}  # plain tensor -> its channels (a ReorderOutput needs them)
    same: dict[str, str] = {}  # a ReorderInput's output -> the blocked tensor it equals
    nodes: list[Any] = []
    for node in graph.node:
        if _is_reorder(node, "ReorderOutput"):
            blocked[node.output[0]] = node.input[0]
            width[node.output[0]] = _attributes(node)["channels"]
        elif _is_reorder(node, "ReorderInput") and node.input[0] in blocked:
            same[node.output[0]] = blocked[node.input[0]]
            continue
        elif node.domain == "" and node.op_type in _ELEMENTWISE:
            tensors = [name for name in node.input if sizes.get(name) != 1]
            counts = {width.get(name, channels.get(name)) for name in tensors}
            is_worth_it = any(name in blocked for name in tensors) or node.output[0] in reordered
            count = next(iter(counts)) if len(counts) == 1 else None
            if tensors and is_worth_it and count is not None:
                for name in tensors:
                    if name not in blocked:  # reordered once, for every reader
                        blocked[name], width[name] = f"{name}/blocked", count
                        nodes.append(helper.make_node("ReorderInput", [name], [blocked[name]],
                                                      name=f"{name}/to_blocked", domain=_NCHWC,
                                                      channels_last=0))
                moved = onnx.NodeProto()
                moved.CopyFrom(node)
                moved.name = f"{node.output[0]}/on_blocked"  # names must be unique; outputs are
                moved.input[:] = [blocked.get(name, name) for name in node.input]
                moved.output[:] = [f"{node.output[0]}/blocked"]
                nodes.append(moved)
                blocked[node.output[0]], width[node.output[0]] = moved.output[0], count
                # The plain tensor, for readers that need it (dropped if there are none).
                nodes.append(helper.make_node("ReorderOutput", [moved.output[0]], [node.output[0]],
                                              name=f"{node.output[0]}/to_plain", domain=_NCHWC,
                                              channels=count, channels_last=0))
                continue
        nodes.append(node)
    for node in nodes:
        node.input[:] = [same.get(name, name) for name in node.input]
    return nodes, set(blocked.values())


def _drop_dead(nodes: list[Any], graph: Any) -> list[Any]:
    """The nodes that the graph's outputs read, in order."""
    needed = {output.name for output in graph.output}
    kept: list[Any] = []
    for node in reversed(nodes):
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(node.input)
    return kept[::-1]


def _fuse_sums(nodes: list[Any], blocked: set[str]) -> list[Any]:
    """Each blocked Conv whose only reader is an Add of it and another blocked tensor
    takes that tensor as its `Sum`."""
    readers: dict[str, int] = {}
    for node in nodes:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    producers = {name: node for node in nodes for name in node.output}
    fused: set[int] = set()
    for node in nodes:
        if node.domain != "" or node.op_type != "Add" or len(node.input) != 2:
            continue
        for side in (0, 1):
            conv, other = producers.get(node.input[side]), node.input[1 - side]
            if (conv is None or other not in blocked or conv.domain != _NCHWC
                or conv.op_type != "Conv" or id(conv) in fused
                    or readers[conv.output[0]] != 1 or len(conv.input) > 3
                    or "activation" in _attributes(conv)):  # the Sum goes in before an activation
                continue
            while len(conv.input) < 3:
                conv.input.append("")  # no bias
            conv.input.append(other)
            conv.output[0] = node.output[0]
            fused.update((id(conv), id(node)))
            break
    return [node for node in nodes if not (node.op_type == "Add" and id(node) in fused)]
