"""FastAPI dependencies: the shared :class:`SchedulerState` of the app."""

from typing import Annotated

from fastapi import Depends, Request

from scheduler_service.state import SchedulerState


def get_state(request: Request) -> SchedulerState:
    """The state passed to ``create_app``."""
    return request.app.state.scheduler


StateDep = Annotated[SchedulerState, Depends(get_state)]
