"""``/v1/models`` (admin): the model registry per engine class, activation, and each class's drift."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path
from fastapi.concurrency import run_in_threadpool

from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import LedgerError
from llmvisor.service.deps import AdminKey, LedgerDep, MetricsDep, RegistryDep, check_name, to_datetime
from llmvisor.service.ingest import MAX_STRING_CHARS
from llmvisor.service.registry import RegistryError, model_class
from llmvisor.service.schemas import ActivationOut, ClassDriftOut, DriftOut, ModelAdd, ModelVersionOut

MODELS_PATH = "/v1/models"

router = APIRouter(tags=["models"])


def version_out(ledger, engine_class: str, version: int) -> ModelVersionOut:
    for item in ledger.list_models(engine_class):
        if item.version == version:
            return ModelVersionOut(engine_class=item.engine_class, version=item.version, source=item.source,
                                   created_at=to_datetime(item.created_at_us), active=item.active)
    raise HTTPException(404, f"no model version {version} of engine class {engine_class!r}")


@router.get(MODELS_PATH, response_model=list[ModelVersionOut], summary="Every stored model version by engine class (admin)")
def list_models(_principal: AdminKey, ledger: LedgerDep):
    return [
        ModelVersionOut(engine_class=m.engine_class, version=m.version, source=m.source, created_at=to_datetime(m.created_at_us),
                        active=m.active)
        for m in ledger.list_models()
    ]


@router.get(
    MODELS_PATH + "/{engine_class}/active",
    summary="The model that bills an engine class, for engines that attribute at the edge (admin)",
    description=(
        "The class's active version (`role` \"active\"), else the service's `--model` for the class it was fitted on "
        "(`role` \"default\") or its `--fallback-model` (`role` \"fallback\"): the model per-step ingest would bill the "
        "class's steps with. `version` is a stored version of the class in every case (the default and fallback models are "
        "stored, not activated, on the first request), so a window names the model that attributed it. `active` is true "
        "only for the class's active version."
    ),
    responses={404: {"description": "no model bills the class (its steps are stored pending until one is activated)"}},
)
def active_model(engine_class: Annotated[str, Path(max_length=MAX_STRING_CHARS)], _principal: AdminKey, registry: RegistryDep):
    check_name("engine_class", engine_class)
    found = registry.edge_model(engine_class)
    if found is None:
        raise HTTPException(404, f"engine class {engine_class!r} has no model: no active version, and neither --model nor "
                                 "--fallback-model bills it (its steps are stored pending)")
    return {"engine_class": engine_class, "version": found.version, "role": found.role, "active": found.role == "active",
            "model": json.loads(found.model_json)}


@router.post(MODELS_PATH, response_model=ModelVersionOut, status_code=201, summary="Add a model version (admin)")
async def add_model(body: ModelAdd, _principal: AdminKey, ledger: LedgerDep, registry: RegistryDep):
    check_name("engine_class", body.engine_class)
    try:
        model = StepLatencyModel.from_dict(body.model, source="model")
        engine_class = model_class(model, body.engine_class, source="model")
    except LlmvisorError as error:
        raise HTTPException(422, str(error)) from None
    version = await run_in_threadpool(ledger.add_model, engine_class, json.dumps(model.to_dict()), "POST /v1/models")
    if body.activate:
        await run_in_threadpool(registry.activate, engine_class, version)
    return version_out(ledger, engine_class, version)


@router.post(
    MODELS_PATH + "/{engine_class}/{version}/activate",
    response_model=ActivationOut,
    summary="Activate a version for its class and attribute the class's pending steps (admin)",
    responses={404: {"description": "no such version"}},
)
async def activate_model(
    engine_class: Annotated[str, Path(max_length=MAX_STRING_CHARS)],
    version: Annotated[int, Path(ge=1, lt=2**31)],
    _principal: AdminKey,
    registry: RegistryDep,
):
    check_name("engine_class", engine_class)
    try:
        result = await run_in_threadpool(registry.activate, engine_class, version)
    except (RegistryError, LedgerError) as error:
        raise HTTPException(404, str(error)) from None
    return ActivationOut(engine_class=engine_class, version=version, pending_steps_attributed=result.steps_attributed,
                         pending_attributed_ns=result.attributed_ns)


@router.get(MODELS_PATH + "/drift", response_model=DriftOut, summary="Residual quantiles and drift alarm per engine class (admin)")
def drift(_principal: AdminKey, metrics: MetricsDep, ledger: LedgerDep):
    settings = metrics.class_drift.settings
    active = ledger.active_versions()
    classes = sorted(set(metrics.class_drift.classes()) | set(active))
    return DriftOut(
        band=settings.band, window_steps=settings.window_steps, min_window_steps=settings.min_window_steps,
        alarm_after_steps=settings.alarm_after_steps,
        classes=[ClassDriftOut(active_version=active.get(c), **metrics.class_drift.state(c)) for c in classes],
    )
