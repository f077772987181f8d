"""Billing: a price book per engine class, and exports of the ledger's usage as FOCUS rows and metering events."""

from llmvisor import extras

extras.require("llmvisor.billing", "service", modules=["sqlalchemy"])

from llmvisor.billing.charges import Charge, adjustment_charges, charges, tenant_cost, tenant_costs, usage_charges  # noqa: E402
from llmvisor.billing.prices import Price, PriceBook, PriceError, add_prices, cost_of, list_prices, read_price_file  # noqa: E402

__all__ = ["Charge", "Price", "PriceBook", "PriceError", "add_prices", "adjustment_charges", "charges", "cost_of",
           "list_prices", "read_price_file", "tenant_cost", "tenant_costs", "usage_charges"]
