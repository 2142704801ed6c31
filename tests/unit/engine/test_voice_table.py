"""Registered voices as both backends keep them (engine/voice_table.py): listed, retired,
removed."""

from __future__ import annotations

import pytest

from engine.errors import UnknownVoiceError
from engine.voice_table import VoiceTable


def test_a_retired_voice_is_unlisted_but_still_found_until_it_is_removed() -> None:
    table: VoiceTable[str] = VoiceTable()
    table.add("alice", "alice's prompt")
    table.add("bob", "bob's prompt")
    assert table.ids() == ["alice", "bob"] and table.listed() == ["alice's prompt", "bob's prompt"]
    table.retire("alice")
    assert table.ids() == ["bob"]
    assert table.get("alice") == "alice's prompt", "a session holding it could no longer speak"
    table.remove("alice")
    assert table.get("alice") is None
    table.remove("bob")  # a listed voice is removed as well
    assert table.ids() == [] and table.get("bob") is None


def test_adding_a_retired_id_again_lists_the_new_voice() -> None:
    table: VoiceTable[str] = VoiceTable()
    table.add("alice", "old")
    table.retire("alice")
    table.add("alice", "new")
    assert table.listed() == ["new"] and table.get("alice") == "new"
    table.retire("alice")
    table.remove("alice")
    assert table.get("alice") is None, "the old voice was left behind in the retired ones"


def test_unknown_ids_are_clear_errors() -> None:
    table: VoiceTable[str] = VoiceTable()
    table.add("alice", "prompt")
    table.retire("alice")
    with pytest.raises(UnknownVoiceError, match="unknown registered voice 'alice'"):
        table.retire("alice")  # retired already: not listed
    with pytest.raises(UnknownVoiceError, match="unknown registered voice 'nobody'"):
        table.remove("nobody")
