"""``GET /metrics``: the scheduler's Prometheus metrics (:mod:`scheduler_service.metrics`)."""

from fastapi import APIRouter, Request
from fastapi.responses import Response

from scheduler_service.deps import StateDep
from shared.http import CheckedRoute
from shared.metrics import render

router = APIRouter(tags=["metrics"], route_class=CheckedRoute)


@router.get("/metrics", response_class=Response)
async def metrics(state: StateDep, request: Request) -> Response:
    """Every family in the Prometheus text format 0.0.4 (OpenMetrics when the ``Accept`` header asks). An
    ``async`` route: the gauges read the registry and the drift monitor on the event loop, where the sampler
    changes them, never concurrently."""
    body, content_type = render(state.metrics.registry, request.headers.get("accept"))
    return Response(body, media_type=content_type)
