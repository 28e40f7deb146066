"""``/v1/alerts``, ``/v1/monitor``, ``/v1/control`` and ``/v1/training/{pause,resume}``: the drift monitor's
alerts and breakers, and operator control (each command is applied at once, stored, and published on
flywheel.control as a ``shared.schemas.Control`` record, like one sent there by any Kafka client)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from scheduler_service.config import SIGNALS
from scheduler_service.deps import StateDep
from scheduler_service.guard import ControlError
from scheduler_service.models import AlertsPublic, ControlBody
from scheduler_service.state import SchedulerState
from shared.auth import AUTH, AUTH_RESPONSES
from shared.http import CheckedRoute
from shared.schemas import Control

router = APIRouter(tags=["monitor"], route_class=CheckedRoute)


def _alert_json(a) -> dict[str, Any]:
    return {**a.model_dump(mode="json", by_alias=True), "key": a.key}


@router.get("/v1/alerts", response_model=AlertsPublic)
def get_alerts(state: StateDep, domain: Annotated[str | None, Query(max_length=256)] = None,
               severity: Literal["info", "warning", "critical"] | None = None,
               signal: Annotated[str | None, Query(max_length=64)] = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 100) -> AlertsPublic:
    """Alerts firing now (``active``) and the newest ``limit`` records (``recent``, firing and resolved,
    newest first), optionally of one domain, severity or signal."""
    reg = state.registry
    active = [a for a in reg.active_alerts() if (domain is None or a.domain == domain)
              and (severity is None or a.severity == severity) and (signal is None or a.signal == signal)]
    recent = reg.alert_history(domain, severity, signal, limit)
    return AlertsPublic(active=[_alert_json(a) for a in active], recent=[_alert_json(a) for a in recent])


@router.get("/v1/monitor")
def get_monitor(state: StateDep) -> dict[str, Any]:
    """The monitor's settings and state: run-wide effective thresholds per signal (with what each measures),
    the run-wide overrides, every breaker that ever opened, the run-wide training pause, and per domain the
    samples in its windows and every signal's current value."""
    guard = state.guard
    return {
        "enabled": state.config.monitor.enabled,
        "windows": state.config.monitor.model_dump(include={"window", "reference", "min_samples", "group_window"}),
        "breaker": state.config.monitor.breaker.model_dump(),
        "signals": {s: {"measures": SIGNALS[s], **t.model_dump()} for s, t in guard.monitor.thresholds(None).items()},
        "run_overrides": state.registry.run_overrides(),
        "breakers": {d: b.to_dict() for d, b in guard.monitor.breakers.items()},
        "training_paused": state.registry.training_pause(),
        "domains": {d: {"samples": len(w.samples), "readings": {s: {"value": r.value, "reference": r.reference, "n": r.n}
                                                                for s, r in guard.monitor.readings(d).items()}}
                    for d, w in sorted(guard.monitor.watches.items())},
    }


async def run_control(state: SchedulerState, body: dict[str, Any]) -> dict[str, Any]:
    """Validate ``body`` as a Control command, apply and publish it.

    Raises:
        RequestValidationError: the command is refused (422 naming the field).
        HTTPException: 404 for an unknown domain.
    """
    try:
        ctrl = Control(**body, origin="rest")
    except ValidationError as e:
        errs = [{**er, "loc": ("body", *(er["loc"] or ()))} for er in e.errors()]
        for er in errs:  # the model-level checks name their field first in the message
            if er["loc"] == ("body",) and ":" in er["msg"]:
                er["loc"] = ("body", er["msg"].split("Value error, ")[-1].split(":")[0].split(" and ")[0])
        raise RequestValidationError(errs) from None
    try:
        return await state.control(ctrl)
    except ControlError as e:
        if str(e).startswith("unknown domain"):
            raise HTTPException(404, str(e)) from None
        raise RequestValidationError([{"type": "value_error", "loc": ("body", "threshold"), "msg": str(e),
                                       "input": body.get("threshold")}]) from None


@router.post("/v1/control", dependencies=AUTH, responses={**AUTH_RESPONSES, 404: {"description": "Unknown domain."}})
async def post_control(body: ControlBody, state: StateDep) -> dict[str, Any]:
    """Apply one operator command (``pause_domain``, ``resume_domain``, ``open_breaker``, ``close_breaker``,
    ``set_threshold``, ``pause_training``, ``resume_training``) and publish it on flywheel.control.
    Errors: 404 unknown domain, 422 naming the field (nothing changes)."""
    return await run_control(state, body.model_dump(exclude_none=True))


@router.post("/v1/training/{action}", dependencies=AUTH, responses=AUTH_RESPONSES)
async def training(action: Literal["pause", "resume"], state: StateDep,
                   reason: Annotated[str, Query(max_length=1000)] = "") -> dict[str, Any]:
    """Pause training run-wide (no training groups issued, the trainer takes no step, so its newest
    checkpoint is the last good one; evaluation goes on) or resume it."""
    return await run_control(state, {"command": f"{action}_training", "reason": reason})
