"""The wheel: every package and the browser client ship in it, and an installed copy serves the
page."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.support.server import REPO, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools leaves build/ in the tree it builds, and reuses what it finds
    # there.
    source = out / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", "test-artifacts", ".*_cache",
        ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                    "--no-build-isolation", "--quiet", "-w", str(out)], check=True, timeout=300)
    (built,) = out.glob("voxgate-*.whl")
    return built


def test_the_wheel_holds_every_package_the_web_client_and_the_load_corpus(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    homes = {"gateway": REPO, "engine": REPO, "loadtest": REPO,
             "voxgate_client": REPO / "clients/python"}  # the client ships inside voxgate too
    for root, home in homes.items():
        for init in (home / root).rglob("__init__.py"):
            # a new subpackage must join pyproject's list
            assert str(init.relative_to(home)) in names
    web = {f"gateway/web/{p.name}" for p in (REPO / "web").iterdir()
           if p.suffix in (".html", ".js", ".css")}
    assert "gateway/web/index.html" in web and web <= names
    assert "loadtest/data/corpus.jsonl" in names and "gateway/py.typed" in names
    assert "voxgate_client/session.py" in names and "voxgate_client/py.typed" in names
    # the default voice's reference
    assert "engine/backends/cosyvoice/assets/default_voice.wav" in names
    assert not any(n.startswith(("tests/", "bench/", "web/", "clients/")) for n in names)


def test_an_installed_wheel_serves_the_web_client_without_the_source_tree(
        wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target",
                    str(site), str(wheel)], check=True, timeout=300)
    # PYTHONSAFEPATH: `python -m` does not put the working directory (the source tree) on the path,
    # so the installed copy is the one imported; its dependencies come from this environment.
    env = {"PYTHONSAFEPATH": "1",
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    server = start_server(tmp_path, env=env)
    try:
        page = httpx.get(server.url + "/", timeout=10)
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert httpx.get(server.url + "/app.js", timeout=10).status_code == 200
        probe = subprocess.run([sys.executable, "-c", "import gateway.app as a; print(a.WEB_DIR)"],
                               env={**os.environ, **env}, cwd=tmp_path, capture_output=True,
                               text=True, check=True)
        assert Path(probe.stdout.strip()) == site / "gateway" / "web"
    finally:
        server.stop()
