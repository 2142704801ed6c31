"""Keys kept out of logs: key-like query values redacted, the rest of a line kept."""

from __future__ import annotations

import pytest

from gateway.access.redaction import redact

KEY = "sk-voxgate-0123456789"


@pytest.mark.parametrize("query", [
    "api_key={k}", "token={k}", "key={k}", "access_token={k}", "voice=joe&api_key={k}&codec=opus",
    "API_KEY={k}", "x-api-key={k}", "client_secret={k}",
])
def test_key_like_query_values_are_redacted_and_the_rest_is_kept(query: str) -> None:
    line = '127.0.0.1:5 - "GET /v1/stream?' + query.format(k=KEY) + ' HTTP/1.1" 101'
    redacted = redact(line)
    assert KEY not in redacted and "[redacted]" in redacted
    assert redacted.startswith('127.0.0.1:5 - "GET /v1/stream?') and redacted.endswith(' HTTP/1.1" 101')
    assert redact("/v1/stream?voice=joe&codec=opus") == "/v1/stream?voice=joe&codec=opus"
