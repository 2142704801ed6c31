"""Keys kept out of logs: key-like query values replaced with `[redacted]`.

Browsers put a key or a session token in the socket URL (`?api_key=`,
`?token=`), and query strings reach the access log; `redact` and
`RedactingFilter` replace every key-like query value there.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

#: query parameters whose values are secrets (api_key, token, key, access_token, ...)
_SECRET_QUERY = re.compile(r"(?i)([?&;](?:[a-z0-9_.-]*(?:key|token|secret|password|passwd|auth|"
                           r"signature|sig|credential)[a-z0-9_.-]*)=)[^&;\s\"']*")


def redact(text: str) -> str:
    """`text` with every key-like query value replaced: "?api_key=sk-1" -> "?api_key=[redacted]"."""
    return _SECRET_QUERY.sub(r"\1[redacted]", text)


class RedactingFilter(logging.Filter):
    """Redacts key-like query values in a record's message and arguments.

    uvicorn's access log prints the raw path with its query ("GET /v1/voices?api_key=..."),
    and its WebSocket lines ("WebSocket /v1/stream?api_key=..." [accepted]) do too.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, Mapping):
            record.args = {k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
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
