"""The header timeout, on both of uvicorn's HTTP parsers, against a real uvicorn on loopback.

`voxgate serve` uses httptools when it is installed (tests/e2e/test_hardening.py
checks it through the CLI); h11 is the fallback, so it is served here too, by a
plain ASGI app so that only the protocol class is under test.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from gateway.http.timeouts import _h11_class, _httptools_class
from tests.support.server import free_port
from tests.support.wait import wait_until


async def hello(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=["httptools", "h11"])
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    make = _httptools_class if request.param == "httptools" else _h11_class
    number = free_port()
    server = uvicorn.Server(uvicorn.Config(hello, host="127.0.0.1", port=number, http=make(0.5),
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=20, interval=0.05, message="uvicorn did not start")
    yield number
    server.should_exit = True
    thread.join(10)


def closed_without_answer(sock: socket.socket) -> bool:
    sock.settimeout(15)  # a bound, not a timing assertion: the timeout is 0.5 s
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def test_a_silent_connection_is_closed(port: int) -> None:
    assert closed_without_answer(socket.create_connection(("127.0.0.1", port)))


def test_a_head_that_never_ends_is_closed(port: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
    assert closed_without_answer(sock)


def test_a_whole_request_is_answered_and_the_next_one_on_the_connection_too(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(15)
        for _ in range(2):
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = b""
            while not answer.endswith(b"ok"):
                answer += sock.recv(1024)
            assert answer.startswith(b"HTTP/1.1 200")
            # on purpose, the subject: twice the 0.5 s header timeout, which an idle keep-alive
            # connection is not timed by
            time.sleep(1.0)
