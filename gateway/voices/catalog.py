"""The voices sessions may choose, and who holds each: one catalog per process.

Sessions and HTTP requests validate a voice id against `listed` (instead of
each keeping a copy of the list) and `hold` the voices they speak with: a
session its current voice and each open context's voice, an HTTP speech
request its voice until its body ends. They `release` them on change, at a
context's end and on disconnect, as they `admit` and `release_context`
engine capacity.

A deleted voice is `retire`d: it leaves the listing at once (new choices get
`unknown_voice`), but whoever holds it keeps speaking with it. It is removed
from the engine when its last holder lets go: the catalog calls `on_unheld`
with its id, and the voice service removes it (gateway/voices/service.py). A voice in
use is a reference count, not a sweep.

Each voice has an owner: the tenant that registered it, or "" for the
operator's and the built-in ones. A caller chooses among the voices it may see
(gateway/voices/policy.py `is_visible`): its own tenant's, then the built-in
and shared ones, every tenant's for an admin. `view(principal)` is the catalog
as one caller sees it, and what its session or request validates against and
holds through: another tenant's id is unknown there, as one that does not
exist, and `unknown_voice_message` names the id asked for, never the listing
(a client lists what it may use with `GET /v1/voices`).

Plain Python, no I/O and no engine: `VoiceService` keeps the listing in step
with the engine's, and unit tests drive the catalog directly.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Protocol

from gateway.access.keys import OPERATOR, Principal
from gateway.voices.policy import is_visible


def unknown_voice_message(voice_id: str) -> str:
    """The `unknown_voice` message on every route: the id asked for, and where the list is."""
    return f"unknown voice {voice_id[:64]!r}; GET /v1/voices lists the voices this key may use"


class VoiceChoices(Protocol):
    """What a session or request needs of the catalog: a `VoiceCatalog` (every voice, the
    operator's view) or a `CatalogView` (one caller's)."""

    @property
    def listed(self) -> Collection[str]: ...

    def hold(self, voice_id: str) -> None: ...

    def release(self, voice_id: str) -> None: ...


class VoiceCatalog:
    """Listed voices, hold counts, and retired voices waiting for their last holder."""

    def __init__(self, voice_ids: Iterable[str] = (),
                 on_unheld: Callable[[str], None] | None = None,
                 owners: Mapping[str, str] | None = None) -> None:
        self._listed = frozenset(voice_ids)
        # voice id -> tenant ("": none)
        self._owners = {k: v for k, v in (owners or {}).items() if v}
        self._holds: dict[str, int] = {}  # voice id -> holders (entries > 0 only)
        self._retired: set[str] = set()
        self.on_unheld = on_unheld

    # -- the listing ---------------------------------------------------------

    @property
    def listed(self) -> frozenset[str]:
        """Every voice that may be chosen now, whoever owns it (a caller's: `view`)."""
        return self._listed

    def set_listed(self, voice_ids: Iterable[str], owners: Mapping[str, str] | None = None) -> None:
        """Replace the listing (start-up: the engine's voices) and who owns them."""
        self._listed = frozenset(voice_ids)
        self._retired -= self._listed
        if owners is not None:
            self._owners = {k: v for k, v in owners.items() if v}

    def add(self, voice_id: str, owner: str = "") -> None:
        """List a voice (registered, or registered again after a delete) for its owner."""
        self._listed |= {voice_id}
        self._retired.discard(voice_id)
        if owner:
            self._owners[voice_id] = owner
        else:
            self._owners.pop(voice_id, None)

    def owner(self, voice_id: str) -> str:
        """The tenant that registered it; "" for the operator's and the built-in voices."""
        return self._owners.get(voice_id, "")

    def may_choose(self, voice_id: str, principal: Principal) -> bool:
        """Listed, and `principal` may see it (its own, the shared ones; all for an admin)."""
        return voice_id in self._listed and is_visible(self.owner(voice_id), principal)

    def view(self, principal: Principal) -> CatalogView:
        """The catalog as `principal` sees it (see the module doc)."""
        return CatalogView(self, principal)

    def retire(self, voice_id: str) -> bool:
        """Unlist a deleted voice; True when nobody holds it (the caller removes it now).

        Otherwise it waits for its last holder, and `on_unheld` fires then.
        """
        self._listed -= {voice_id}
        self._owners.pop(voice_id, None)  # unlisted: nobody chooses it any more
        if self._holds.get(voice_id, 0) == 0:
            return True
        self._retired.add(voice_id)
        return False

    def is_retired(self, voice_id: str) -> bool:
        """Deleted, and still held or not yet removed from the engine."""
        return voice_id in self._retired

    def forget(self, voice_id: str) -> None:
        """A retired voice is gone from the engine: stop tracking it."""
        self._retired.discard(voice_id)

    # -- holders ---------------------------------------------------------------

    def hold(self, voice_id: str) -> None:
        """One more holder. Validating the choice is the caller's (against `listed`)."""
        self._holds[voice_id] = self._holds.get(voice_id, 0) + 1

    def release(self, voice_id: str) -> None:
        """One holder fewer; the last holder of a retired voice triggers `on_unheld`."""
        count = self._holds.get(voice_id, 0)
        if count <= 0:
            raise ValueError(f"expected a held voice, got {voice_id!r}, which nobody holds")
        if count > 1:
            self._holds[voice_id] = count - 1
            return
        del self._holds[voice_id]
        if voice_id in self._retired and self.on_unheld is not None:
            self.on_unheld(voice_id)

    def num_holders(self, voice_id: str) -> int:
        return self._holds.get(voice_id, 0)


class _Choosable(Collection[str]):
    """The listed voices one principal may choose; membership is one lookup, not a copy."""

    def __init__(self, catalog: VoiceCatalog, principal: Principal) -> None:
        self._catalog = catalog
        self._principal = principal

    def __contains__(self, voice_id: object) -> bool:
        return isinstance(voice_id, str) and self._catalog.may_choose(voice_id, self._principal)

    def __iter__(self) -> Iterator[str]:
        return (v for v in self._catalog.listed if self._catalog.may_choose(v, self._principal))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class CatalogView:
    """One caller's catalog: it chooses among the voices its principal may see and holds
    them in the shared catalog. `rekey` moves it to another principal (a socket whose key
    came in its first message)."""

    def __init__(self, catalog: VoiceCatalog, principal: Principal = OPERATOR) -> None:
        self.catalog = catalog
        self.principal = principal

    @property
    def listed(self) -> Collection[str]:
        return _Choosable(self.catalog, self.principal)

    def rekey(self, principal: Principal) -> None:
        self.principal = principal

    def hold(self, voice_id: str) -> None:
        self.catalog.hold(voice_id)

    def release(self, voice_id: str) -> None:
        self.catalog.release(voice_id)

    def num_holders(self, voice_id: str) -> int:
        return self.catalog.num_holders(voice_id)
