"""Keys kept out of logs: key-like query values redacted, the rest of a line kept."""

from __future__ import annotations

import pytest

from gateway.access.redaction import RedactingFilter, redact

KEY = "sk-voxgate-0123456789"


@pytest.mark.parametrize("query", [
    "api_key={k}", "token={k}", "key={k}", "access_token={k}", "voice=joe&api_key={k}&codec=opus",
    "API_KEY={k}", "x-api-key={k}", "client_secret={k}",
    # a percent-encoded name is judged as the app decodes it
    "api%5Fkey={k}", "%74oken={k}", "%61pi_key={k}", "xi%5Fapi%5Fkey={k}",
    "voice=joe&%74oken={k}&x=1", "api%255Fkey={k}", "access%5ftoken={k}", "api+key={k}",
])
def test_key_like_query_values_are_redacted_and_the_rest_is_kept(query: str) -> None:
    line = '127.0.0.1:5 - "GET /v1/stream?' + query.format(k=KEY) + ' HTTP/1.1" 101'
    redacted = redact(line)
    assert KEY not in redacted and "=[redacted]" in redacted
    assert redacted.startswith('127.0.0.1:5 - "GET /v1/stream?')
    assert redacted.endswith(' HTTP/1.1" 101')
    assert query.split("=")[0] in redacted  # the name is kept as the client wrote it


def test_a_query_without_a_key_like_name_is_kept_whole() -> None:
    assert redact("/v1/stream?voice=joe&codec=opus") == "/v1/stream?voice=joe&codec=opus"


@pytest.mark.parametrize("line", [
    "< authorization: Bearer {k}", "< Authorization: Token {k}", "< xi-api-key: {k}",
    "< x-api-key: {k}", "< sec-websocket-protocol: token, {k}", "< cookie: session={k}",
    """< TEXT '{{"text": " ", "xi_api_key": "{k}"}}' [55 bytes]""",
    """< TEXT '{{"text": " ", "authorization": "Bearer {k}", "flush": true}}' [80 bytes]""",
    "ASGI [3] Started scope={{'headers': [(b'host', b'localhost'), (b'authorization', b'Bearer "
    "{k}')]}}",
])
def test_handshake_headers_and_first_message_fields_of_a_debug_log_are_redacted(line: str) -> None:
    redacted = redact(line.format(k=KEY))
    assert KEY not in redacted and "[redacted]" in redacted


def test_a_debug_line_is_redacted_when_its_key_is_an_argument_of_its_own() -> None:
    import logging

    class Frame:  # the WebSocket library logs a frame object, formatted only when written
        def __str__(self) -> str:
            return f"TEXT '{{\"xi_api_key\": \"{KEY}\"}}' [40 bytes]"

    records = [logging.LogRecord("websockets.server", logging.DEBUG, __file__, 1, message, args,
                                 None)
               for message, args in [("< %s: %s", ("authorization", f"Bearer {KEY}")),
                                     ("< %s", (Frame(),)),
                                     ('%s - "%s %s HTTP/%s" %d',
                                      ("127.0.0.1:5", "GET", "/v1/x", "1.1", 200))]]
    for record in records:
        assert RedactingFilter().filter(record)
    assert [r.getMessage() for r in records] == [
        "< authorization: [redacted]", "< TEXT '{\"xi_api_key\": \"[redacted]\"}' [40 bytes]",
        '127.0.0.1:5 - "GET /v1/x HTTP/1.1" 200']
    assert records[2].args == ("127.0.0.1:5", "GET", "/v1/x", "1.1", 200)  # the access log's, kept
