"""The ElevenLabs adapter's idle close against the vendor's own: the `input_timeout_exceeded` error,
1008.

ElevenLabs answers a socket that sent no text within `inactivity_timeout`
(20 s by default, up to 180) with {"message", "error": "input_timeout_exceeded",
"code": 1008} and closes it with 1008 (its help center, and the frames its
users report, e.g. livekit/agents#218, elevenlabs/elevenlabs-docs#426). The
ElevenLabs SDK raises that frame as the error's body, with the close code as
its status: a client reconnects on it.
"""

from __future__ import annotations

import json

from gateway.compat.elevenlabs import ElevenLabsMultiSession, ElevenLabsSession, parse_output_format
from gateway.stream.actions import Close, SendFrame
from gateway.stream.options import Limits, SessionOptions
from gateway.voices.catalog import VoiceCatalog


def _session(kind: type[ElevenLabsSession]) -> ElevenLabsSession:
    return kind("s1", catalog=VoiceCatalog({"joe"}), sample_rate=22050,
                options=SessionOptions(voice="joe"),
                limits=Limits(idle_timeout_s=20.0), output=parse_output_format("pcm_16000"),
                admit=lambda key: None, release=lambda key: None)


def test_an_idle_socket_gets_input_timeout_exceeded_and_a_1008_close_on_both_endpoints() -> None:
    for kind in (ElevenLabsSession, ElevenLabsMultiSession):
        frame, close = _session(kind).idle_close(20.0)
        assert isinstance(frame, SendFrame) and isinstance(frame.frame, str)
        message = json.loads(frame.frame)
        assert set(message) == {"message", "error", "code"}  # the socket's, no context id
        assert (message["error"], message["code"]) == ("input_timeout_exceeded", 1008)
        assert "20 s" in message["message"]
        assert isinstance(close, Close) and close.code == 1008
        assert close.reason.startswith("input_timeout_exceeded")
        assert len(close.reason.encode()) <= 123
