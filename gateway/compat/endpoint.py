"""The door of the vendor sockets: the one admission every socket passes, then the native I/O loop.

The key is taken where each vendor sends it (the adapter says where) and
checked with the native socket's own rules, in the same function
(gateway/access/admission.py): origin, shutdown, the session cap, the socket
cap per owner. Then the adapter's factory reads the socket's URL (output
format, voice...) and makes its session on the catalog as the socket's tenant
sees it (a key that comes in the first message moves the admission and that
view to its tenant), and the native I/O loop (`Connection`) runs it. A refusal at either
step is the vendor's error frame and a close code.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket

from gateway.access.admission import Refused, admit
from gateway.compat.core import VendorSession
from gateway.errors import CLOSE_POLICY_VIOLATION, ProtocolError
from gateway.state import AppState
from gateway.stream.endpoint import Connection, refuse, serve_session

#: makes the adapter's session from the keywords every session takes (session_id, catalog,
#: sample_rate, limits, admit, release, authorize, languages, encoders) and what it reads from
#: the socket's URL itself; raises ProtocolError for a URL it cannot serve
SessionFactory = Callable[..., VendorSession[Any, Any]]


async def serve(websocket: WebSocket, make_session: SessionFactory, *, protocol: str,
                key: str | None, key_hint: str, error_json: Callable[[str, str], str],
                defer_auth: bool = False, subprotocol: str | None = None) -> None:
    """Admit the socket and run the adapter's session on the native loop.

    `defer_auth`: with no valid key at the handshake, the session may still take
    one in its first message (ElevenLabs); it gets the admission's `rekey` to check it.
    `subprotocol`: the WebSocket subprotocol answered, refusals included (Deepgram's
    `token`, whose offer carried the key).
    """
    state: AppState = websocket.app.state.voxgate
    try:
        admission = admit(state, websocket, key, protocol=protocol, key_hint=key_hint,
                          defer_auth=defer_auth)
    except Refused as refusal:
        await refuse(websocket, error_json(refusal.code, refusal.message), refusal.close_code,
                     refusal.code, subprotocol=subprotocol)
        return
    with admission:
        engine = state.engine
        voices = state.catalog.view(admission.principal)  # its tenant's voices, and the shared ones

        def authorize(key: str | None) -> None:  # the key came in the first message
            admission.rekey(key)
            voices.rekey(admission.principal)

        try:
            session = make_session(session_id=uuid.uuid4().hex[:16], catalog=voices,
                                   sample_rate=engine.sample_rate, limits=state.config.limits,
                                   admit=admission.admit_context, release=admission.release_context,
                                   authorize=None if admission.is_authorized else authorize,
                                   languages=state.languages, encoders=state.encoders,
                                   defer_encode=True)
        except ProtocolError as exc:
            await refuse(websocket, error_json(exc.code, exc.message), CLOSE_POLICY_VIOLATION,
                         exc.code, subprotocol=subprotocol)
            return
        await serve_session(websocket, session, Connection(websocket, session, engine, state),
                            state, subprotocol=subprotocol)
