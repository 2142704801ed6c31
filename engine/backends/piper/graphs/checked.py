"""The graph rewrites a piper voice loads with, each taken only where it equals the original.

The loader runs a voice's graphs in their fastest form, and a rewrite is only
faster, never different: the front part with its LayerNorms fused
(layernorm.py) and the decoder in 2-D (split.py) or in onnxruntime's blocked
layout (blocked.py). This module owns that choice. Each rewrite runs once at
load beside the original on fixed random inputs; one that does not convert,
fails, or differs by more than float rounding is not taken, and the voice
keeps the original (logged). Sessions are opened by the caller
(`loader.open_session`): the fused front part is checked on the session the
voice then keeps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.backends.piper.graphs.blocked import blocked_decoder
from engine.backends.piper.graphs.layernorm import fuse_layer_norms
from engine.backends.piper.graphs.split import decoder_as_2d, latent_channels

logger = logging.getLogger("voxgate.engine")

#: opens an onnxruntime session over a serialized graph (its threads chosen by the caller)
OpenSession = Callable[[bytes], Any]


def fused_front(front: bytes, piper_config: Any, voice_id: str, open_session: OpenSession,
                open_reference: OpenSession) -> tuple[bytes, Any]:
    """The front part with its LayerNorms fused (layernorm.py) where that equals the original,
    and its session (`open_session`: the voice's own, kept).

    Checked once at load on random phoneme ids with the noise off against the original
    on `open_reference`'s session: durations equal, every other output within 1e-4;
    otherwise the original runs (logged).
    """
    fused, count = fuse_layer_norms(front)
    if count == 0:
        return front, open_session(front)
    try:
        session = open_session(fused)  # the voice's own: checked, then kept
        rng = np.random.default_rng(0)
        feeds = {"input": rng.integers(1, max(2, piper_config.num_symbols), (1, 40),
                                       dtype=np.int64),
                 "input_lengths": np.array([40], dtype=np.int64),
                 "scales": np.array([0.0, 1.0, 0.0], dtype=np.float32)}  # noise off: deterministic
        if piper_config.num_speakers > 1:
            feeds["sid"] = np.zeros(1, dtype=np.int64)
        want = open_reference(front).run(None, feeds)
        got = session.run(None, feeds)
        if not np.array_equal(want[-1], got[-1]):
            raise ValueError("the durations differ")
        for a, b in zip(want[:-1], got[:-1], strict=True):
            difference = float(np.abs(np.asarray(a) - np.asarray(b)).max()) if np.size(a) else 0.0
            if np.shape(a) != np.shape(b) or difference > 1e-4:
                raise ValueError(f"an output differs by {difference:.2e}")
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types; the original stays
        logger.warning("piper voice %r: its LayerNorms stay unfused: %s", voice_id, exc)
        return front, open_session(front)
    logger.info("piper voice %r: %d LayerNorms fused in its text part", voice_id, count)
    return fused, session


def fastest_decoder(decoder: bytes, latent_name: str, open_session: OpenSession,
                    voice_id: str) -> bytes:
    """The decoder in its fastest form on one x86 thread that converts and equals the original.

    First its 2-D form (split.py's `decoder_as_2d`), then that form with its
    activations kept in onnxruntime's blocked layout between convolutions
    (blocked.py). `open_session` opens a graph on one thread. Each is checked once at load on a
    random latent; a form that does not convert, or differs by more than float rounding, is not
    taken (logged).
    """
    lifted = decoder_as_2d(decoder)
    if lifted is None:
        logger.info("piper voice %r: its decoder runs in 1-D (it does not convert to 2-D)",
                    voice_id)
        return decoder
    channels = latent_channels(decoder, latent_name)
    if channels is None:
        logger.warning("piper voice %r: its decoder runs in 1-D: no convolution reads the latent",
                       voice_id)
        return decoder
    latent = np.random.default_rng(0).standard_normal((1, channels, 40)).astype(np.float32)
    try:
        (want,) = open_session(decoder).run(None, {latent_name: latent})
        want = np.asarray(want).reshape(-1)
        _check_decoder(open_session(lifted), latent_name, latent, want, "2-D")
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types; the 1-D graph stays
        logger.warning("piper voice %r: its decoder runs in 1-D: %s", voice_id, exc)
        return decoder
    try:
        blocked = blocked_decoder(lifted, channels)
        if blocked is None:
            return lifted  # onnxruntime blocks nothing here (no NCHWc kernels on this CPU)
        _check_decoder(open_session(blocked), latent_name, latent, want, "blocked 2-D")
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types; the 2-D graph stays
        logger.warning("piper voice %r: its decoder keeps onnxruntime's layout reorders: %s",
                       voice_id, exc)
        return lifted
    logger.info("piper voice %r: its decoder runs in 2-D, in onnxruntime's blocked layout",
                voice_id)
    return blocked


def _check_decoder(session: Any, latent_name: str, latent: np.ndarray, want: np.ndarray,
                   form: str) -> None:
    """Raise ValueError where `session` decodes `latent` [1, C, T] other than `want` by over
    1e-4."""
    (got,) = session.run(None, {latent_name: latent})
    got = np.asarray(got).reshape(-1)
    if got.shape != want.shape:
        raise ValueError(
            f"the {form} decoder made {got.shape[0]} samples, expected {want.shape[0]}")
    difference = float(np.abs(want - got).max())
    if difference > 1e-4:
        raise ValueError(f"the {form} decoder differs by {difference:.2e}")
