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

from sqlalchemy import insert, select, update

from llmvisor.ledger.connection import LedgerConnection, now_us
from llmvisor.ledger.records import KeyInfo, LedgerError
from llmvisor.ledger.schema import api_keys

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


class KeyStore(LedgerConnection):
    """The API keys a ledger stores (their secrets' digests only) and checks; the part of `llmvisor.ledger.Ledger`
    that reads and writes ``api_keys``."""

    def create_key(self, tenant: str | None = None, *, is_admin: bool = False) -> str:
        """Store a new key and return it; it is not stored in the clear, so it cannot be shown again."""
        if is_admin == (tenant is not None):
            raise LedgerError("a key is either an admin key (no tenant) or a tenant key (with a tenant)")
        if tenant is not None and not tenant:
            raise LedgerError("the tenant name must not be empty")
        key_id, key, digest = new_key()
        with self.write_transaction() as conn:
            conn.execute(
                insert(api_keys).values(
                    key_id=key_id, secret_sha256=digest, tenant=tenant, is_admin=is_admin, created_at_us=now_us()
                )
            )
        return key

    def authenticate(self, key: str) -> Principal | None:
        """The principal of a valid, unrevoked key, else None."""
        parts = split_key(key)
        if parts is None:
            return None
        key_id, secret = parts
        with self._read() as conn:
            row = conn.execute(
                select(api_keys.c.secret_sha256, api_keys.c.tenant, api_keys.c.is_admin, api_keys.c.revoked_at_us).where(
                    api_keys.c.key_id == key_id
                )
            ).first()
        if not secret_matches(secret, None if row is None else row[0]):
            return None
        if row[3] is not None:
            return None
        return Principal(key_id=key_id, tenant=row[1], is_admin=bool(row[2]))

    def list_keys(self) -> list[KeyInfo]:
        query = select(
            api_keys.c.key_id, api_keys.c.tenant, api_keys.c.is_admin, api_keys.c.created_at_us, api_keys.c.revoked_at_us
        ).order_by(api_keys.c.created_at_us, api_keys.c.key_id)
        with self._read() as conn:
            return [KeyInfo(r[0], r[1], bool(r[2]), int(r[3]), None if r[4] is None else int(r[4])) for r in conn.execute(query)]

    def revoke_key(self, key_id: str) -> bool:
        """Revoke a key; False if there is no such unrevoked key."""
        with self.write_transaction() as conn:
            result = conn.execute(
                update(api_keys)
                .where(api_keys.c.key_id == key_id, api_keys.c.revoked_at_us.is_(None))
                .values(revoked_at_us=now_us())
            )
        return result.rowcount > 0
