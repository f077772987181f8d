"""``/v1/prices``: the price book per engine class (read with any key, added with an admin key)."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, HTTPException
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from llmvisor.billing.prices import PriceError, add_prices, list_prices, parse_prices
from llmvisor.service.deps import AdminKey, AnyKey, LedgerDep, to_datetime
from llmvisor.service.schemas import StrictBody

router = APIRouter(prefix="/v1/prices", tags=["billing"])


class PriceOut(BaseModel):
    engine_class: str
    version: int
    valid_from: datetime
    currency: str
    engine_hour_price: str = Field(description="per engine-hour, an exact decimal string")
    prompt_token_price: str | None
    output_token_price: str | None
    cached_token_discount: str | None
    gib_hour_price: str | None = Field(None, description="per GiB-hour of KV cache held (trace format 3), an exact decimal string")
    source: str
    created_at: datetime


class PricesIn(StrictBody):
    prices: list[dict] = Field(description="entries as in a JSON price file (`llmvisor prices add`)", min_length=1, max_length=1000)


def _out(price) -> PriceOut:
    data = price.to_dict()
    return PriceOut(**{k: v for k, v in data.items() if k not in ("valid_from_us", "created_at_us")},
                    valid_from=to_datetime(price.valid_from_us), created_at=to_datetime(price.created_at_us))


@router.get("", response_model=list[PriceOut], summary="Every stored price version by engine class")
def get_prices(_principal: AnyKey, ledger: LedgerDep):
    return [_out(p) for p in list_prices(ledger)]


@router.post("", response_model=list[PriceOut], status_code=201, summary="Add price versions (admin)")
async def post_prices(body: PricesIn, _principal: AdminKey, ledger: LedgerDep):
    """Each entry becomes the next version of its class, in force from its ``valid_from`` (a whole UTC hour)."""
    try:
        entries = parse_prices(body.prices, "body", source="POST /v1/prices")
        stored = await run_in_threadpool(add_prices, ledger, entries)
    except PriceError as error:
        raise HTTPException(422, str(error)) from None
    return [_out(p) for p in stored]
