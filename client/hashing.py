"""Salted hashing of user ids: events carry ``user_hash``, never a raw id."""

from __future__ import annotations

import hashlib
import hmac


def hash_user(user_id: str, salt: str) -> str:
    """HMAC-SHA256 of ``user_id`` keyed by ``salt``, as 32 lower-case hex characters.

    Keyed (not a plain hash) so that ids cannot be recovered by hashing guesses without the salt.
    """
    if not user_id:
        raise ValueError("user_id must be a non-empty string")
    return hmac.new(salt.encode(), str(user_id).encode(), hashlib.sha256).hexdigest()[:32]
