"""The voice service's upload places: bounded, refused at once when taken, given back on exit.

The service is built on the real engine with a scripted backend, not started:
the places need neither the store nor the engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.engine import Engine, EngineConfig
from gateway.voices.service import VoiceConfig, VoiceService
from gateway.voices.upload import VoiceUploadError
from tests.support.scripted_backend import ScriptedBackend


def test_an_upload_past_the_places_gets_429_at_once_and_a_place_comes_back_when_one_ends(
        tmp_path: Path) -> None:
    engine = Engine(ScriptedBackend(), EngineConfig(warmup_text=""))
    service = VoiceService(VoiceConfig(data_dir=tmp_path, max_concurrent_uploads=2), engine)
    with service.upload_slot(), service.upload_slot():
        with pytest.raises(VoiceUploadError) as refused, service.upload_slot():
            pass
        assert (refused.value.status, refused.value.code) == (429, "too_many_uploads")
        assert service.num_uploads == 2
    with pytest.raises(RuntimeError), service.upload_slot():  # a failed upload gives it back too
        raise RuntimeError("decoding failed")
    assert service.num_uploads == 0


def test_an_upload_deadline_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="upload_timeout_s must be > 0, got 0"):
        VoiceConfig(data_dir=tmp_path, upload_timeout_s=0)
