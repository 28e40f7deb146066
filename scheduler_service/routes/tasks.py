"""``/v1/tasks``: register tasks and read their state.

``POST /v1/tasks`` validates its body in a worker thread (:func:`validate_batch`), never on the event
loop: a batch's regex patterns, JSON Schemas and golds are compiled or parsed there (each bounded in size,
the batch in time by ``scheduler.validation_budget_s``), so ``/healthz`` and the sampler go on meanwhile.
Besides the models' own checks, each task's largest record must fit the broker's record limit and its
prompt the policy's context (:func:`record_bound`, :class:`PromptCounter`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scheduler_service.deps import StateDep
from scheduler_service.models import Duplicate, TaskBatchCreate, TaskCreate, TaskIds, TaskPublic
from scheduler_service.state import SchedulerState
from scheduler_service.task_store import TaskConflictError
from shared.auth import AUTH, AUTH_RESPONSES
from shared.envs import EnvironmentLoadError, cached_environment
from shared.http import BodyError, CheckedRoute, parse_json_body
from shared.schemas import Task

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/tasks", tags=["tasks"], route_class=CheckedRoute)

RECORD_BYTES_PER_TOKEN = 128
"""Bound on the bytes one completion token adds to a Trajectory (and its ScoredTrajectory) record: its id
(≤ 7 characters with the comma), log-probability (≤ 25: ``-1.2345678901234567e-05,``), loss mask (2), and
its text twice (``completion_text`` and the turn's ``text``: a byte-level BPE token decodes to at most a few
dozen bytes, ×6 when JSON escapes control characters, rare; 2 × 40 allowed)."""
PROMPT_ID_BYTES = 7
"""Bytes of one prompt token id in ``prompt_ids`` (≤ 6 digits and a comma); a prompt has at most as many
tokens as UTF-8 bytes plus :data:`TEMPLATE_TOKENS_PER_MESSAGE` per message."""
TEMPLATE_TOKENS_PER_MESSAGE = 16
"""Chat-template tokens around one message (role markers, separators), a generous bound."""
RECORD_OVERHEAD_BYTES = 64 * 1024
"""Bytes of a Trajectory or ScoredTrajectory beside the task, prompt and completion: ids, timings, cost,
turn records, the reward's components and details (per-test results, judge reply), the Kafka key and
headers."""
ERRORS_LISTED = 20
"""Per-task errors collected before a batch's validation stops (the 422 lists them)."""


class _Envelope(BaseModel):
    """The shape of ``POST /v1/tasks``'s body checked before any task is (cheap: no task is validated)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tasks: list[dict[str, Any]] = Field(min_length=1, max_length=10000)


def _loc(prefix: tuple, errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**er, "loc": (*prefix, *er["loc"])} for er in errors]


def effective_max_tokens(state: SchedulerState, domain: str) -> int:
    """``max_new_tokens`` the sampler will give the domain's requests: the stored domain's ``max_tokens``,
    else the configured domain's, else ``scheduler.max_tokens`` (the value at submission; a later change of
    the domain's ``max_tokens`` is not checked against the tasks already stored)."""
    row = state.registry.domain(domain)
    cfg = row.config if row is not None else state.config.domains.get(domain)
    return (cfg.max_tokens if cfg is not None and cfg.max_tokens else None) or state.config.scheduler.max_tokens


def record_bound(task: Task, max_tokens: int, prompt_bytes: int) -> tuple[int, int]:
    """Upper bounds (bytes) of the largest records the task makes: ``(rollout_request, scored_trajectory)``.

    A RolloutRequest holds the task once; a Trajectory (one per sample, not per group, so K does not
    multiply) and its ScoredTrajectory hold the task, the prompt's token ids and the completion:
    ``task + PROMPT_ID_BYTES × (prompt_bytes + 16 × messages) + RECORD_BYTES_PER_TOKEN × max_tokens +
    RECORD_OVERHEAD_BYTES``. ``max_tokens`` bounds a multi-turn completion too (generated and tool tokens;
    ``rollout_service.tool_loop``).
    """
    task_bytes = len(task.encode())
    prompt_tokens = prompt_bytes + TEMPLATE_TOKENS_PER_MESSAGE * len(task.prompt)
    request = task_bytes + 1024
    scored = (task_bytes + PROMPT_ID_BYTES * prompt_tokens + RECORD_BYTES_PER_TOKEN * max_tokens
              + RECORD_OVERHEAD_BYTES)
    return request, scored


def _largest_field(task: Task) -> str:
    sizes = {f: len(orjson.dumps(getattr(task, f).model_dump(mode="json") if f == "verifier"
                                 else [m.model_dump() for m in task.prompt] if f == "prompt" else getattr(task, f)))
             for f in ("prompt", "verifier", "metadata")}
    return max(sizes, key=sizes.get)


class PromptCounter:
    """Counts prompt tokens with the policy's tokenizer and knows its context window.

    The context: ``scheduler.context_tokens``, else ``max_position_embeddings`` of the model directory's
    ``config.json``. The tokenizer: the directory's ``tokenizer.json`` read with the ``tokenizers`` library
    (no transformers, no model weights; loading a 49,152-token byte-level BPE vocabulary, SmolLM2's size, took
    0.14 s and counting 1.2 M characters 0.55 s on the 2-core test machine, once and per batch, in a worker
    thread). The count is that of the messages' contents alone: a lower bound of the templated
    prompt, so a prompt refused is surely too long. No model directory (SmolLM2 not converted yet) and no
    configured context: no check (logged once).
    """

    def __init__(self, state: SchedulerState) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self.context: int | None = state.config.scheduler.context_tokens
        self.tokenizer = None
        self._model = state.config.model

    def _model_dir(self) -> Path | None:
        from shared.model import SMOLLM2

        m = self._model
        path = Path(m.cache_dir).expanduser() / SMOLLM2 if m.name == SMOLLM2 else Path(m.name).expanduser()
        return path if (path / "config.json").is_file() else None

    def load(self) -> None:
        """Read the context and the tokenizer once (blocking: from a worker thread)."""
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            d = self._model_dir()
            if d is None:
                if self.context is None:
                    log.warning("model %r has no directory yet and scheduler.context_tokens is unset: prompts "
                                "are not checked against the context", self._model.name)
                return
            if self.context is None:
                try:
                    self.context = int(orjson.loads((d / "config.json").read_bytes())["max_position_embeddings"])
                except (OSError, KeyError, ValueError, TypeError) as e:
                    log.warning("no max_position_embeddings in %s/config.json (%r): prompts not checked", d, e)
            if (d / "tokenizer.json").is_file():
                from tokenizers import Tokenizer

                t0 = time.perf_counter()
                self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
                log.info("prompt tokenizer of %s loaded in %.3f s (context %s)", d, time.perf_counter() - t0,
                         self.context)

    def count(self, contents: list[str]) -> int | None:
        """Tokens of the messages' contents (without template), or None when no tokenizer is known."""
        if self.tokenizer is None:
            return None
        return sum(len(e.ids) for e in self.tokenizer.encode_batch(contents, add_special_tokens=False))


def _counter(state: SchedulerState) -> PromptCounter:
    if state.prompt_counter is None:
        state.prompt_counter = PromptCounter(state)
    return state.prompt_counter


def validate_batch(raw: bytes, state: SchedulerState) -> list[Task]:
    """The tasks of a ``POST /v1/tasks`` body (blocking: run it in a worker thread).

    Raises:
        BodyError: 400 for a body that is not JSON (invalid UTF-8, too deep...), or 413 when validation
            ran past ``scheduler.validation_budget_s``.
        RequestValidationError: 422; each error's ``loc`` names the task index and field.
    """
    data = parse_json_body(raw)
    try:
        env = _Envelope.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(_loc(("body",), e.errors())) from None
    sc = state.config.scheduler
    deadline = time.monotonic() + sc.validation_budget_s
    limit = state.config.kafka.max_request_size
    counter = _counter(state)
    counter.load()
    errors: list[dict[str, Any]] = []
    tasks: list[Task] = []
    loaded: dict[str, str | None] = {}
    for i, item in enumerate(env.tasks):
        if time.monotonic() > deadline:
            raise BodyError(f"validating the batch took more than {sc.validation_budget_s} s "
                            f"(scheduler.validation_budget_s) after {i} tasks: send smaller batches", 413)
        where = ("body", "tasks", i)
        try:
            task = TaskCreate.model_validate(item, strict=True).to_task()  # strict: "1" is no number
        except ValidationError as e:
            errors.extend(_loc(where, e.errors()))
        except Exception as e:  # noqa: BLE001 - a validator failing unforeseen: client input, never a 500
            log.warning("validating task %d raised %s", i, type(e).__name__, exc_info=True)
            errors.append({"type": "value_error", "loc": where, "input": None,
                           "msg": f"the task could not be validated: {type(e).__name__}: {str(e)[:200]}"})
        else:
            errors.extend(_task_limits(task, where, state, limit, counter))
            errors.extend(_environment_errors(task, where, loaded))
            tasks.append(task)
        if len(errors) >= ERRORS_LISTED:
            break
    if errors:
        raise RequestValidationError(errors)
    return tasks


def _environment_errors(task: Task, where: tuple, loaded: dict[str, str | None]) -> list[dict[str, Any]]:
    """The error of a task scored by a user environment that cannot be imported here (the scheduler loads it as
    the verifier and the rollout will: the message names the id, module, file or attribute); ``loaded`` keeps
    each reference's outcome for the rest of the batch."""
    if task.verifier.kind != "environment":
        return []
    ref = task.verifier.environment
    key = ref.key()
    if key not in loaded:
        try:
            cached_environment(ref)
            loaded[key] = None
        except EnvironmentLoadError as e:
            loaded[key] = str(e)
        except Exception as e:  # noqa: BLE001 - whatever the reference does, the answer is a 422, never a 500
            loaded[key] = f"environment {ref.label()[:300]} cannot be loaded: {type(e).__name__}: {str(e)[:500]}"
    if loaded[key] is None:
        return []
    return [{"type": "environment_unloadable", "loc": (*where, "verifier", "environment"), "input": None,
             "msg": loaded[key][:1000]}]


def _task_limits(task: Task, where: tuple, state: SchedulerState, limit: int,
                 counter: PromptCounter) -> list[dict[str, Any]]:
    """Errors of a valid task that the pipeline could not carry: its largest record over the broker's
    record limit (``kafka.max_request_size``), its prompt plus ``max_new_tokens`` over the context."""
    out = []
    max_tokens = effective_max_tokens(state, task.domain)
    contents = [m.content for m in task.prompt]
    prompt_bytes = sum(len(c.encode()) for c in contents)
    request, scored = record_bound(task, max_tokens, prompt_bytes)
    worst = max(request, scored)
    if worst > limit:
        field = _largest_field(task)
        out.append({"type": "record_too_large", "loc": (*where, field), "input": None,
                    "msg": f"the task's largest record (a ScoredTrajectory of up to {worst} bytes: the task is "
                           f"{len(task.encode())} bytes, its largest field {field!r}, plus {max_tokens} "
                           f"completion tokens × {RECORD_BYTES_PER_TOKEN} bytes) would exceed the broker's "
                           f"record limit kafka.max_request_size = {limit} bytes"})
    if not out and counter.context is not None:  # one error per field; no tokenizing of an oversized prompt
        n = counter.count(contents)
        if n is not None and n + max_tokens > counter.context:
            out.append({"type": "prompt_too_long", "loc": (*where, "prompt"), "input": None,
                        "msg": f"the prompt holds at least {n} tokens; with max_new_tokens {max_tokens} it does "
                               f"not fit the policy's context of {counter.context} tokens"})
    return out


TASKS_BODY = {
    "required": True,
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TaskBatchCreate"}}},
}
"""OpenAPI request body of ``POST /v1/tasks`` (the route reads the raw body; ``scheduler_service.api`` adds
:class:`TaskBatchCreate`'s schema to the components)."""


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=TaskIds, response_model_exclude_unset=True,
             dependencies=AUTH, openapi_extra={"requestBody": TASKS_BODY},
             responses={**AUTH_RESPONSES,
                        400: {"description": "The body is not JSON (invalid UTF-8, invalid JSON, nested too "
                                             "deep); the detail says what and where."},
                        409: {"description": "Task ids exist with different content (nothing stored)."},
                        413: {"description": "The body is larger than scheduler.max_body_bytes, or its "
                                             "validation ran past scheduler.validation_budget_s."},
                        422: {"description": "Validation error (the loc names the task index and field; nothing "
                                             "stored).", "content": {"application/json": {"schema": {
                                                 "$ref": "#/components/schemas/HTTPValidationError"}}}}})
async def create_tasks(request: Request, state: StateDep) -> TaskIds:
    """Register a batch of 1..10000 tasks (body: ``TaskBatchCreate``); 202 only after the batch is committed.

    A task with the content of a stored task of its domain (normalised prompt and verifier spec) is not
    stored again: it is listed in ``duplicates`` with the id of the task it duplicates.

    Errors: 400 for a body that is not JSON; 413 for a body over ``scheduler.max_body_bytes``; 422 for a
    malformed task (the detail names the task index and field, nothing stored), a task scored by a user
    environment that cannot be imported (``verifier.environment``; the message names what is missing), a task
    whose largest record
    would not fit the broker's record limit, or whose prompt with ``max_new_tokens`` would not fit the
    policy's context; 409 when a task id exists with different content (nothing of the batch stored).
    """
    raw = await request.body()
    tasks = await asyncio.to_thread(validate_batch, raw, state)
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


def openapi_components() -> dict[str, Any]:
    """JSON Schemas to add to the app's ``components.schemas``: :class:`TaskBatchCreate` and its parts."""
    schema = TaskBatchCreate.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return {**defs, "TaskBatchCreate": schema}


@router.get("/{task_id:path}", response_model=TaskPublic, response_model_exclude_unset=True,
            responses={404: {"description": "Unknown task."}})  # ids may contain "/"
def get_task(task_id: str, state: StateDep) -> TaskPublic:
    """State and pass rate of one task. Errors: 404 when unknown."""
    row = state.registry.get_task(task_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"unknown task {task_id!r}")
    return TaskPublic(**row)
