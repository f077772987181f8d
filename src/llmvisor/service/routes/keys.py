"""``/v1/whoami`` and key administration over HTTP (``/v1/keys``, admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Response

from llmvisor.service.deps import AdminKey, AnyKey, LedgerDep, check_name, to_datetime
from llmvisor.service.schemas import KeyCreate, KeyCreated, KeyDescription, WhoAmI

KEYS_PATH = "/v1/keys"

router = APIRouter(tags=["keys"])


@router.get("/v1/whoami", response_model=WhoAmI, summary="The key's identity")
def whoami(principal: AnyKey):
    return WhoAmI(key_id=principal.key_id, tenant=principal.tenant, is_admin=principal.is_admin)


@router.post(KEYS_PATH, response_model=KeyCreated, status_code=201, summary="Create a key (admin)")
def create_key(body: KeyCreate, _principal: AdminKey, ledger: LedgerDep):
    if body.admin == (body.tenant is not None):
        raise HTTPException(422, 'give either {"tenant": "T"} for a tenant key or {"admin": true}')
    check_name("tenant", body.tenant)
    key = ledger.create_key(body.tenant, is_admin=body.admin)
    return KeyCreated(key=key, key_id=key.split("_")[1], tenant=body.tenant, is_admin=body.admin)


@router.get(KEYS_PATH, response_model=list[KeyDescription], summary="List keys (admin; secrets are never shown)")
def list_keys(_principal: AdminKey, ledger: LedgerDep):
    return [
        KeyDescription(key_id=k.key_id, tenant=k.tenant, is_admin=k.is_admin, created_at=to_datetime(k.created_at_us),
                       revoked_at=None if k.revoked_at_us is None else to_datetime(k.revoked_at_us))
        for k in ledger.list_keys()
    ]


@router.delete(KEYS_PATH + "/{key_id}", status_code=204, summary="Revoke a key (admin)")
def revoke_key(key_id: Annotated[str, Path(max_length=64)], _principal: AdminKey, ledger: LedgerDep):
    if not ledger.revoke_key(check_name("key_id", key_id)):
        raise HTTPException(404, f"no active key {key_id!r}")
    return Response(status_code=204)
