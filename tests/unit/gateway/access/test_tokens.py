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


def test_a_token_is_good_until_just_before_its_expiry() -> None:
    tokens = SessionTokens(ttl_s=2.0)
    issued = tokens.issue(KEY, now=1000.0)
    assert issued is not None and issued[1] == 1002.0
    assert tokens.redeem(issued[0], now=1001.999) == KEY


def test_a_token_redeemed_at_or_after_its_expiry_is_refused_and_gone() -> None:
    tokens = SessionTokens(ttl_s=2.0)
    at_expiry, after = tokens.issue(KEY, now=1000.0), tokens.issue(KEY, now=1000.0)
    assert at_expiry is not None and after is not None
    assert tokens.redeem(at_expiry[0], now=1002.0) is None
    assert tokens.redeem(after[0], now=5000.0) is None
    assert len(tokens) == 0  # an expired token is spent by the attempt: not kept, not retried
    assert tokens.redeem(after[0], now=1000.5) is None  # not even with a clock that went back


def test_an_expired_token_makes_room_for_a_new_one_only_once_it_has_expired() -> None:
    tokens = SessionTokens(ttl_s=2.0, max_per_key=1)
    assert tokens.issue(KEY, now=1000.0) is not None
    assert tokens.issue(KEY, now=1001.9) is None  # the first is still good: the key's cap holds
    assert tokens.issue(KEY, now=1002.0) is not None  # expired now: it gives way
    assert tokens.num_outstanding(KEY) == 1
