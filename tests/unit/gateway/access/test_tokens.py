"""Session tokens: single use, short lived, bounded in number, per key."""

from __future__ import annotations

from gateway.access.tokens import SessionTokens

KEY = "sk-voxgate-0123456789"
OTHER = "sk-voxgate-9876543210"


def test_session_tokens_are_single_use_expire_and_stay_bounded() -> None:
    tokens = SessionTokens(ttl_s=60, max_tokens=2)
    issued = tokens.issue(KEY, now=100.0)
    assert issued is not None
    token, expires_at = issued
    assert expires_at == 160.0 and KEY not in token
    assert tokens.redeem(token, now=101.0) == KEY
    assert tokens.redeem(token, now=101.0) is None  # spent
    late = tokens.issue(KEY, now=100.0)
    assert late is not None and tokens.redeem(late[0], now=160.0) is None  # expired
    assert tokens.issue(KEY, now=200.0) and tokens.issue(KEY, now=200.0)
    assert tokens.issue(KEY, now=200.0) is None  # bounded: two outstanding
    assert tokens.issue(KEY, now=300.0) is not None  # the expired ones make room
    assert tokens.redeem("vxt_made-up", now=0.0) is None
    per_key = SessionTokens(ttl_s=60, max_per_key=2)
    assert per_key.issue(KEY, now=0.0) and per_key.issue(KEY, now=0.0)
    assert per_key.issue(KEY, now=1.0) is None and per_key.issue(OTHER, now=1.0) is not None
    assert per_key.issue(KEY, now=61.0) is not None  # its expired ones went
