"""Check before work, against real servers on loopback (issue 21, "Unbounded work before
checks"): an upload's header is checked before decoding, decodes are bounded (and a body on its
way takes no place), and a full disk still lets voices be deleted (a real size-limited tmpfs)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_voices import make_wav, register
from tests.support.server import ServerProcess, start_server

#: a few seconds of 655,350 Hz x 8 channels in FLAC: a small file that decodes to hundreds of MB
HUGE_FLAC = make_wav(3.0, rate=655350, channels=8, amplitude=0.0, container_format="flac",
                     codec="flac")


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("limits"),
                        env={"VOXGATE_VOICE_MAX_CONCURRENT_UPLOADS": "1"})
    yield proc
    proc.stop()


def test_a_small_file_claiming_655_khz_by_8_channels_is_refused_from_its_header(
        limited: ServerProcess) -> None:
    assert len(HUGE_FLAC) < 1_000_000
    before = limited.rss_mb()
    for _ in range(4):
        response = register(limited.url, "huge", audio=HUGE_FLAC)
        assert (response.status_code, response.json()["code"]) == (422, "sample_rate_too_high")

    async def eight_at_once() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=limited.url, timeout=60) as client:
            async def post() -> tuple[int, str]:
                files = {"audio": ("ref.flac", HUGE_FLAC, "audio/flac")}
                response = await client.post("/v1/voices", data={"id": "huge", "text": "Hi."},
                                             files=files)
                return response.status_code, response.json()["code"]

            return list(await asyncio.gather(*(post() for _ in range(8))))

    answers = asyncio.run(eight_at_once())
    assert set(answers) <= {(422, "sample_rate_too_high"), (429, "too_many_uploads")}
    assert (422, "sample_rate_too_high") in answers
    # decoding one would take 3 s x 655,350 x 8 x 4 bytes = 63 MB, before resampling
    assert limited.rss_mb() - before < 30


def test_an_upload_whose_body_trickles_in_holds_no_upload_place(limited: ServerProcess) -> None:
    """One upload place, taken when a body is complete (issue 44): a slow client whose body
    trickles in holds nothing, so another upload goes through meanwhile, and the slow one
    still succeeds once its body is whole. The place itself (429 when taken) is
    tests/unit/gateway/voices/test_service.py's."""
    files = {"audio": ("ref.wav", make_wav(1.5), "audio/wav")}
    body = httpx.Request("POST", "/", data={"id": "slow-one", "text": "Hello, this is me."},
                         files=files)
    payload = body.read()
    headers = {k: v for k, v in body.headers.items()
               if k.lower() in ("content-type", "content-length")}

    async def trickle() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", limited.port)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(
            f"POST /v1/voices HTTP/1.1\r\nHost: 127.0.0.1:{limited.port}\r\n{head}\r\n".encode())
        writer.write(payload[:100])
        await writer.drain()
        async with httpx.AsyncClient(base_url=limited.url, timeout=30) as client:
            files2 = {"audio": ("ref.wav", make_wav(1.5), "audio/wav")}
            second = await client.post("/v1/voices", data={"id": "fast-one", "text": "Hi."},
                                       files=files2)
        assert second.status_code == 201, second.text
        writer.write(payload[100:])
        await writer.drain()
        status = (await reader.readline()).split()[1]
        writer.close()
        return int(status)

    assert asyncio.run(trickle()) == 201
    for voice_id in ("slow-one", "fast-one"):
        assert httpx.delete(limited.url + f"/v1/voices/{voice_id}").status_code == 200


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int) -> Iterator[Path]:
    """A tmpfs of `size_mb` at `path` (root mounts it; see the skip below)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs",
                              str(path)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:  # root without CAP_SYS_ADMIN (some containers)
        pytest.skip(f"cannot mount a size-limited tmpfs here ({mounted.stderr.strip()}); the "
                    "full-disk delete is also covered by test_registry's simulated full disk")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> None:
    """Write until the disk is full (ENOSPC)."""
    with open(path / "filler", "wb", buffering=0) as file, contextlib.suppress(OSError):
        while True:
            file.write(b"\xff" * 4096)


@pytest.mark.skipif(os.geteuid() != 0,
                    reason="mounting a size-limited tmpfs takes root; the store's "
                    "reserve logic is also covered by test_registry's simulated full disk")
def test_with_the_disk_full_registering_says_507_and_deleting_still_works(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", 24) as disk:
        server = start_server(tmp_path, env={"VOXGATE_DATA_DIR": str(disk / "data")})
        try:
            for n in range(3):
                assert register(server.url, f"kept-{n}", audio=make_wav(8.0)).status_code == 201
            fill(disk)
            full = register(server.url, "one-more", audio=make_wav(8.0))
            assert (full.status_code, full.json()["code"]) == (507, "insufficient_storage")
            for n in range(3):
                assert httpx.delete(server.url + f"/v1/voices/kept-{n}",
                                    timeout=30).status_code == 200
            listed = httpx.get(server.url + "/v1/voices").json()["voices"]
            assert not {"kept-0", "kept-1", "kept-2"} & {v["id"] for v in listed}
            assert "released the" in server.log()  # the reserve went, as designed
        finally:
            server.stop()
        (disk / "filler").unlink()
        # the deletes landed
        again = start_server(tmp_path, env={"VOXGATE_DATA_DIR": str(disk / "data")})
        try:
            assert not any(v["id"].startswith("kept-")
                           for v in httpx.get(again.url + "/v1/voices").json()["voices"])
        finally:
            again.stop()
