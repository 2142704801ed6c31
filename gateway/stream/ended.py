"""What a session remembers of the contexts it ended, for the messages that arrive late.

A client's tokens and cancels race the server's own end of a context: text can
still be on the wire for a context that just finished, and a listener barges
in on audio it is still playing long after the server sent the last of it.
`EndedContexts` keeps, bounded, the ids of ended contexts (so late text gets
`context_closed` once, then is dropped silently) and the last few finished
contexts whole (so a late `cancel` still splits their text at what was heard).
Plain Python: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.errors import ProtocolError, error_message
from gateway.stream.actions import Action, Observe, Send
from gateway.stream.context import Context

MAX_REMEMBERED_CLOSED = 4096
MAX_RECENT_DONE = 8


class EndedContexts:
    """Ended context ids (and whether late text was answered), and recent finished contexts."""

    def __init__(self) -> None:
        self._closed: OrderedDict[str, bool] = OrderedDict()  # id -> late text answered
        self._done: OrderedDict[str, Context] = OrderedDict()  # finished: for late cancels

    def __contains__(self, context_id: str) -> bool:
        return context_id in self._closed

    def add(self, context: Context, *, is_done: bool) -> None:
        """Remember an ended context; a finished one (`is_done`) is kept whole a while."""
        if is_done:
            self._done[context.context_id] = context
            while len(self._done) > MAX_RECENT_DONE:
                self._done.popitem(last=False)
        self._closed[context.context_id] = False
        while len(self._closed) > MAX_REMEMBERED_CLOSED:
            self._closed.popitem(last=False)

    def done(self, context_id: str) -> Context | None:
        """The finished context of that id, if it is one of the recent few."""
        return self._done.get(context_id)

    def take_done(self, context_id: str) -> Context | None:
        """The finished context, forgotten as a whole (its id stays closed)."""
        return self._done.pop(context_id, None)

    def late_text(self, context_id: str) -> list[Action]:
        """The answer to text for an ended context: `context_closed` once, then nothing."""
        if self._closed.get(context_id):
            return []  # answered once already: late tokens are dropped silently
        self._closed[context_id] = True
        return [Send(error_message(ProtocolError(
            "context_closed", f"context {context_id!r} is done or cancelled; its text is dropped",
            context_id=context_id))), Observe("error:context_closed", 1)]
