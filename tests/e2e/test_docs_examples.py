"""The client example in docs/protocol.md runs as written against a real server."""

from __future__ import annotations

import subprocess
import sys
import wave

from tests.support.server import REPO, ServerProcess


def test_stream_client_example_saves_speech(server: ServerProcess, tmp_path) -> None:
    out = tmp_path / "answer.wav"
    result = subprocess.run([sys.executable, str(REPO / "docs/examples/stream_client.py"),
                             server.ws_url, str(out)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "segment at 0 ms" in result.stdout
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 24000
        assert wav.getnframes() / 24000 > 3.0
