"""Keys kept out of logs: every value a key can travel in replaced with `[redacted]`.

Browsers put a key or a session token in the socket URL (`?api_key=`,
`?token=`), and query strings reach the access log. A parameter's name is
judged as the app reads it, percent-decoded: `?api%5Fkey=` and `?%74oken=` are
the app's `api_key` and `token`, and so are redacted too. At `--log-level
debug` the WebSocket library also logs each handshake's headers
(`< authorization: Bearer ...`, `< xi-api-key: ...`, Deepgram's
`< sec-websocket-protocol: token, ...`) and the start of each text frame
(ElevenLabs' first message, `{"xi_api_key": "..."}`): header values and JSON
string fields with a key-like name go too. `RedactingFilter` applies `redact`
to each record's whole message, formatted, so a key passed as an argument of
its own is caught with the name beside it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from urllib.parse import unquote_plus

#: a query parameter as a log line shows it: its name (still percent-encoded) and its value
_QUERY_PARAM = re.compile(r"([?&;])([^=&;\s\"'?#]+)=([^&;\s\"'#]*)")
#: names whose values are secrets (api_key, token, key, access_token, ...), once decoded
_SECRET_NAME = re.compile(r"(?i)key|token|secret|password|passwd|auth|signature|sig|credential")


def _decoded(name: str) -> str:
    """The name as the app reads it; decoded again while it changes (at most thrice)."""
    for _ in range(3):
        decoded = unquote_plus(name)
        if decoded == name:
            break
        name = decoded
    return name


def _redact_param(match: re.Match[str]) -> str:
    if _SECRET_NAME.search(_decoded(match.group(2))) is None:
        return match.group(0)
    return f"{match.group(1)}{match.group(2)}=[redacted]"


#: a header line as the WebSocket library logs it ("< authorization: Bearer sk-1"), and a
#: header pair as uvicorn's trace shows it ((b'authorization', b'Bearer sk-1'))
_HEADER_LINE = re.compile(r"(?im)^([<>]\s*)([a-z0-9-]+)(:\s*)(.*)$")
_HEADER_PAIR = re.compile(r"(?i)(\(b'([a-z0-9-]+)',\s*b')([^']*)(')")
#: headers that carry a key whatever their name (a subprotocol pair "token, KEY")
_SECRET_HEADERS = frozenset({"cookie", "sec-websocket-protocol"})
#: a JSON string field ("xi_api_key": "sk-1"), its value cut short where a log truncates it
_JSON_FIELD = re.compile(r'("([^"\\]{1,64})"\s*:\s*")([^"]*)')


def _is_secret_header(name: str) -> bool:
    return name.lower() in _SECRET_HEADERS or _SECRET_NAME.search(name) is not None


def _redact_header_line(match: re.Match[str]) -> str:
    if not _is_secret_header(match.group(2)):
        return match.group(0)
    return f"{match.group(1)}{match.group(2)}{match.group(3)}[redacted]"


def _redact_header_pair(match: re.Match[str]) -> str:
    if not _is_secret_header(match.group(2)):
        return match.group(0)
    return f"{match.group(1)}[redacted]{match.group(4)}"


def _redact_json_field(match: re.Match[str]) -> str:
    if _SECRET_NAME.search(match.group(2)) is None:
        return match.group(0)
    return f"{match.group(1)}[redacted]"


def redact(text: str) -> str:
    """`text` with every key-like value replaced: "?api_key=sk-1" -> "?api_key=[redacted]",
    "?%74oken=vxt_1" -> "?%74oken=[redacted]", "< xi-api-key: sk-1" -> "< xi-api-key:
    [redacted]", '{"xi_api_key": "sk-1"}' -> '{"xi_api_key": "[redacted]"}'."""
    text = _QUERY_PARAM.sub(_redact_param, text)
    text = _HEADER_LINE.sub(_redact_header_line, text)
    text = _HEADER_PAIR.sub(_redact_header_pair, text)
    return _JSON_FIELD.sub(_redact_json_field, text)


class RedactingFilter(logging.Filter):
    """Redacts key-like values in a record's message and arguments, then in the whole line.

    uvicorn's access log prints the raw path with its query ("GET /v1/voices?api_key=..."),
    and its WebSocket lines ("WebSocket /v1/stream?api_key=..." [accepted]) do too: each
    argument is redacted in place, so its formatter still finds them. The WebSocket
    library's debug lines pass a header's name and value as two arguments ("< %s: %s")
    and a frame as an object: a line that still holds a key once formatted is kept
    formatted, redacted.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, Mapping):
            record.args = {k: redact(v) if isinstance(v, str) else v
                           for k, v in record.args.items()}
        if record.args:
            try:
                line = record.getMessage()
            except (TypeError, ValueError):  # a malformed record: logging reports it itself
                return True
            clean = redact(line)
            if clean != line:
                record.msg, record.args = clean, ()
        return True


_LOGGERS_WITH_QUERIES = ("uvicorn.access", "uvicorn.error", "uvicorn", "websockets.server",
                         "websockets", "voxgate")


def install_log_redaction() -> None:
    """Put the filter on the loggers that may print a query and on every handler they
    use (a logger's filter skips records propagated from its children; a handler's
    does not). Idempotent; call it after logging is configured (uvicorn.Config does)."""
    targets: list[logging.Filterer] = [logging.getLogger()]
    for name in _LOGGERS_WITH_QUERIES:
        targets.append(logging.getLogger(name))
    targets += [h for t in list(targets) if isinstance(t, logging.Logger) for h in t.handlers]
    for target in targets:
        if not any(isinstance(f, RedactingFilter) for f in target.filters):
            target.addFilter(RedactingFilter())
