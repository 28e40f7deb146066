"""``/v1/tasks``: register tasks and read their state."""

import asyncio

from fastapi import APIRouter, HTTPException, status

from scheduler_service.deps import StateDep
from scheduler_service.models import Duplicate, TaskBatchCreate, TaskIds, TaskPublic
from scheduler_service.registry import TaskConflictError

router = APIRouter(prefix="/v1/tasks", tags=["tasks"])


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=TaskIds, response_model_exclude_unset=True)
async def create_tasks(body: TaskBatchCreate, state: StateDep) -> TaskIds:
    """Register a batch of 1..10000 tasks; 202 only after the batch is committed.

    A task with the content of a stored task of its domain (normalised prompt and verifier spec) is not
    stored again: it is listed in ``duplicates`` with the id of the task it duplicates.

    Errors: 422 for a malformed body (the detail names the field, nothing stored); 409 when a
    task id exists with different content (nothing of the batch stored).
    """
    tasks = [t.to_task() for t in body.tasks]
    try:
        reg = await asyncio.to_thread(state.registry.register, tasks)
    except TaskConflictError as e:
        raise HTTPException(status.HTTP_409_CONFLICT,
                            detail={"message": "task ids exist with different content", "task_ids": e.task_ids})
    state.publish_tasks(reg.new)
    out = TaskIds(task_ids=[t.task_id for t in tasks])
    if reg.duplicates:  # shown only when there are some
        out.duplicates = [Duplicate(task_id=a, duplicate_of=b) for a, b in reg.duplicates]
    return out


@router.get("/{task_id:path}", response_model=TaskPublic, response_model_exclude_unset=True)  # ids may contain "/"
def get_task(task_id: str, state: StateDep) -> TaskPublic:
    """State and pass rate of one task. Errors: 404 when unknown."""
    row = state.registry.get_task(task_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"unknown task {task_id!r}")
    return TaskPublic(**row)
