"""Shared fixtures: a real voxgate server (uvicorn subprocess on loopback)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.server import ServerProcess, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real voxgate (piper, joe voice) shared by the tests that only talk to it."""
    proc = start_server(tmp_path_factory.mktemp("server"))
    yield proc
    proc.stop()
