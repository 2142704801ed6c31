"""The Deepgram adapter's idle close against the vendor's: no message, 1011 with `NET-0001` in the
reason.

Deepgram reports a socket closed for sending nothing in the close frame alone
(its "TTS Troubleshooting WebSocket, NET, and DATA Errors" guide: 1011,
NET-0001); its clients read the code and the reason, and reconnect.
"""

from __future__ import annotations

from gateway.compat.deepgram import DeepgramSession
from gateway.compat.formats import OutputFormat
from gateway.stream.actions import Close
from gateway.stream.options import Limits, SessionOptions
from gateway.voices.catalog import VoiceCatalog


def test_an_idle_socket_is_closed_1011_with_net_0001_and_no_message() -> None:
    session = DeepgramSession("s1", catalog=VoiceCatalog({"joe"}), sample_rate=22050,
                              options=SessionOptions(voice="joe"), limits=Limits(),
                              output=OutputFormat("pcm_s16le", 16000), admit=lambda key: None,
                              release=lambda key: None)
    (close,) = session.idle_close(300.0)
    assert isinstance(close, Close) and close.code == 1011
    assert close.reason.startswith("NET-0001") and "300 s" in close.reason
    assert len(close.reason.encode()) <= 123
