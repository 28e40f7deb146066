"""``/v1/system``: operator and supervisor actions on the whole system.

``POST /v1/system/broker-restarted``: the supervisor (``flywheel.launcher.LocalSystem.check``) tells the
scheduler that the broker came back empty; the sampler re-creates the topics and re-issues every group in
flight at once (``Sampler.broker_restarted``) instead of waiting ``scheduler.group_deadline_s``.
"""

from fastapi import APIRouter, HTTPException, status
from pydantic import BaseModel, ConfigDict, Field

from scheduler_service.deps import StateDep
from shared.auth import AUTH, AUTH_RESPONSES
from shared.http import CheckedRoute

router = APIRouter(prefix="/v1/system", tags=["system"], route_class=CheckedRoute)


class BrokerRestart(BaseModel):
    """What the supervisor knows of a broker restart."""

    model_config = ConfigDict(extra="forbid")

    restarted_at: float | None = Field(None, ge=0, le=2**33)
    """When the new broker started listening (Unix s); groups issued after it are not re-issued. ``None``: now."""


class BrokerRestartDone(BaseModel):
    """What the scheduler did about it."""

    reissued: int
    """In-flight groups re-issued now."""
    broker_restarts: int
    """Broker restarts this scheduler process has handled (this one included)."""


@router.post("/broker-restarted", response_model=BrokerRestartDone, dependencies=AUTH,
             responses={**AUTH_RESPONSES, 503: {"description": "No sampler runs, or the broker is not back yet."}})
async def broker_restarted(state: StateDep, body: BrokerRestart | None = None) -> BrokerRestartDone:
    """The broker restarted with empty storage: re-create the topics and re-issue every in-flight group now.

    Idempotent for one restart: groups already re-issued after ``restarted_at`` are left alone.
    """
    sampler = state.sampler
    if sampler is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "no sampler runs in this scheduler")
    try:
        n = await sampler.broker_restarted(body.restarted_at if body else None, why="the supervisor's notice")
    except Exception as e:  # the topics could not be created: the supervisor retries
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"broker not reachable yet: {e!r}"[:500]) from e
    return BrokerRestartDone(reissued=n, broker_restarts=sampler.broker_restarts)
