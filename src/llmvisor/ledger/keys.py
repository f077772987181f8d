"""API keys: a public id and a 256-bit random secret, of which only a SHA-256 digest is stored.

A key reads ``lvk_<key_id>_<secret>``. The id finds the row; the secret is checked by comparing digests
with ``hmac.compare_digest`` (constant time). A slow, salted KDF (scrypt, PBKDF2) protects low-entropy
passwords from offline guessing; these secrets are 256 bits from ``secrets``, so guessing is out of reach
whatever the hash and a salt adds nothing, while a KDF would cost tens of milliseconds on every request.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

KEY_PREFIX = "lvk"
_KEY_ID_BYTES = 8
_SECRET_BYTES = 32
_DUMMY_DIGEST = hashlib.sha256(b"no such key").digest()


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: an admin (ingest, keys, every tenant) or one tenant (its own usage)."""

    key_id: str
    tenant: str | None
    is_admin: bool


def new_key() -> tuple[str, str, bytes]:
    """A fresh key: (key_id, full key to hand out once, digest of its secret to store)."""
    key_id = secrets.token_hex(_KEY_ID_BYTES)
    secret = secrets.token_urlsafe(_SECRET_BYTES)
    return key_id, f"{KEY_PREFIX}_{key_id}_{secret}", secret_digest(secret)


def secret_digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def split_key(key: str) -> tuple[str, str] | None:
    """(key_id, secret) of a well-formed key, else None."""
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


def secret_matches(secret: str, stored_digest: bytes | None) -> bool:
    """Constant-time check; an unknown key id is compared against a dummy so timing does not tell."""
    expected = stored_digest if stored_digest is not None else _DUMMY_DIGEST
    ok = hmac.compare_digest(secret_digest(secret), bytes(expected))
    return ok and stored_digest is not None
