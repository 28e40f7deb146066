"""``/v1/evals``: held-out evaluation rounds (one greedy sample per eval task)."""

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, status

from scheduler_service.deps import StateDep
from scheduler_service.models import EvalCreate, EvalRoundId, EvalRoundPublic
from shared.auth import AUTH, AUTH_RESPONSES
from shared.http import CheckedRoute

router = APIRouter(prefix="/v1/evals", tags=["evals"], route_class=CheckedRoute)


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=EvalRoundId, dependencies=AUTH,
             responses={**AUTH_RESPONSES, 409: {"description": "No eval-split task is registered."}})
def create_eval(body: EvalCreate, state: StateDep) -> EvalRoundId:
    """Create a round; the sampler sends its requests. Errors: 409 when no eval task is registered."""
    mpv = state.registry.policy_version if body.min_policy_version is None else body.min_policy_version
    rid = state.registry.create_eval_round(mpv)
    if rid is None:
        raise HTTPException(status.HTTP_409_CONFLICT, detail="no eval-split task is registered")
    return EvalRoundId(eval_round=rid)


@router.get("", response_model=list[EvalRoundPublic])
def list_evals(state: StateDep) -> list[EvalRoundPublic]:
    """Every eval round, oldest first."""
    return [EvalRoundPublic(**r) for r in state.registry.eval_rounds()]


@router.get("/{round_id}", response_model=EvalRoundPublic, responses={404: {"description": "Unknown eval round."}})
def get_eval(round_id: Annotated[int, Path(ge=0, le=2**62)], state: StateDep) -> EvalRoundPublic:
    """One eval round. Errors: 404 when unknown."""
    r = state.registry.eval_round(round_id)
    if r is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"unknown eval round {round_id}")
    return EvalRoundPublic(**r)
