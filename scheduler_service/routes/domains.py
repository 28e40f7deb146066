"""``/v1/domains``: domains as first-class objects (weight, state, levels, samples, budget, pool).

A change is stored in the registry (durable) and takes effect on the sampler's next issue decision.
Bad input changes nothing: 404 for an unknown domain on PATCH, 422 naming the field for a value the
config refuses, a level whose generator does not build, or an ``environment`` that cannot be loaded (its
module, file or attribute missing, its dataset unreadable or lacking a column: the message names which).
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, HTTPException, Path, Query
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from scheduler_service.config import DOMAIN_PATTERN, DomainConfig, deep_merge
from scheduler_service.deps import StateDep
from scheduler_service.domains import DomainRow, spent_on
from scheduler_service.generate import check_levels
from scheduler_service.issuing import work_per_group
from scheduler_service.models import DomainDetail, DomainPublic
from scheduler_service.state import SchedulerState
from shared.auth import AUTH, AUTH_RESPONSES
from shared.http import CheckedRoute

router = APIRouter(prefix="/v1/domains", tags=["domains"], route_class=CheckedRoute)

NOT_FOUND = {404: {"description": "Unknown domain."}}

DomainName = Annotated[str, Path(pattern=DOMAIN_PATTERN)]
_SPEND_KEYS = ("samples", "generated_tokens", "tool_rounds", "sandbox_seconds", "judge_calls")


def _status(state: SchedulerState, row: DomainRow, live: int) -> str:
    c = row.config
    if row.pause_reason is not None or c.state != "active":
        return "paused" if c.state == "active" else c.state
    if c.weight == 0:
        return "zero_weight"
    planner = state.sampler.planner if state.sampler else None
    if planner is not None and row.name in planner.over_budget:
        return "over_budget"
    return "active" if live else "no_tasks"


def _budget_left(cfg: DomainConfig, train: dict[str, float]) -> dict[str, float]:
    return {key: cap - spent_on(key, train) for key, cap in cfg.budget.model_dump(exclude_none=True).items()}


def domain_views(state: SchedulerState, only: str | None = None) -> list[DomainPublic]:
    """The public view of every domain (or of ``only``), sorted by name."""
    reg = state.registry
    rows = reg.domain_rows()
    if only is not None:
        rows = {only: rows[only]} if only in rows else {}
    summary, spend = reg.task_summary(), reg.spend()
    total_issued = sum(s["groups_issued"] for s in summary.values()) or 0
    planner = state.sampler.planner if state.sampler else None
    maker = state.sampler.maker if state.sampler else None
    guard = state.guard
    out = []
    for name in sorted(rows):
        row, s = rows[name], summary.get(name, {})
        c = row.config
        sp = spend.get(name, {})
        train = sp.get("train", {})
        live = s.get("live_by_level", {})
        out.append(DomainPublic(
            domain=name, config=c, status=_status(state, row, live.get(c.level, 0)), pause_reason=row.pause_reason,
            over_budget=planner.over_budget.get(name) if planner else None, level=c.level,
            level_name=(c.levels[c.level].name if c.levels else None) or f"L{c.level}", levels=len(c.levels or [None]),
            recent_pass_rate=row.recent_pass, level_samples=row.level_samples,
            tasks={k: s.get(k, 0) for k in ("train", "eval", "retired", "flagged", "duplicates")},
            live_by_level=live, groups_issued=s.get("groups_issued", 0),
            share=s.get("groups_issued", 0) / total_issued if total_issued else None,
            seconds_per_group=train["group_seconds"] / train["groups"] if train.get("groups") else None,
            work_seconds_per_group=work_per_group(train),
            spend=sp, budget_left=_budget_left(c, train),
            generator_error=None if maker is None or name not in maker.failed else "the generator failed (see the log)",
            breaker=guard.monitor.breaker(name).to_dict(),
            alerts=[f"{a.signal}:{a.severity}" for k, a in guard.monitor.active.items() if a.domain == name],
        ))
    return out


@router.get("", response_model=list[DomainPublic])
def list_domains(state: StateDep) -> list[DomainPublic]:
    """Every domain: config, status, level, recent pass rate, tasks, share of the issued groups, spend
    against budget."""
    return domain_views(state)


@router.get("/{domain}", response_model=DomainDetail, responses=NOT_FOUND)
def get_domain(domain: DomainName, state: StateDep) -> DomainDetail:
    """One domain with its events and retired/flagged/duplicate task ids. Errors: 404 when unknown."""
    views = domain_views(state, domain)
    if not views:
        raise HTTPException(404, f"unknown domain {domain!r}")
    reg = state.registry
    return DomainDetail(**views[0].model_dump(), events=reg.domain_events(domain),
                        retired_tasks=reg.task_list(domain, "retired"), flagged_tasks=reg.task_list(domain, "flagged"),
                        duplicate_tasks=reg.task_list(domain, "duplicates"))


async def _store(state: SchedulerState, domain: str, data: dict[str, Any]) -> DomainPublic:
    """Validate ``data`` as a whole config, try each level's generator (or load its environment and rows), then
    store it.

    Raises:
        RequestValidationError: the config or a level is refused (422; the ``loc`` names the field).
    """
    try:  # strict (``"1"`` is no number, ``true`` none either), from JSON (where arrays are tuples)
        cfg = DomainConfig.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as e:
        raise RequestValidationError([{**er, "loc": ("body", *er["loc"])} for er in e.errors()]) from None
    problems = await asyncio.to_thread(check_levels, domain, cfg)
    if problems:
        raise RequestValidationError([{"type": "value_error", "loc": ("body", *loc), "msg": msg, "input": None}
                                      for loc, msg in problems])
    await asyncio.to_thread(state.registry.put_domain, domain, cfg)
    if state.sampler is not None:
        state.sampler.maker.failed.pop(domain, None)
        await state.guard.announce(domain)  # a state set to paused (or back) reaches the trainer
    return domain_views(state, domain)[0]


@router.put("/{domain}", response_model=DomainPublic, dependencies=AUTH, responses=AUTH_RESPONSES)
async def put_domain(domain: DomainName, body: Annotated[dict[str, Any], Body()], state: StateDep) -> DomainPublic:
    """Create or replace a domain's config (fields not given take their defaults). An ``environment`` is loaded
    and its dataset read here. Errors: 422 naming the field (nothing changes)."""
    return await _store(state, domain, body)


@router.patch("/{domain}", response_model=DomainPublic, dependencies=AUTH, responses={**AUTH_RESPONSES, **NOT_FOUND})
async def patch_domain(domain: DomainName, body: Annotated[dict[str, Any], Body()], state: StateDep) -> DomainPublic:
    """Change some fields of a domain's config; nested sections merge key by key (``{"budget":
    {"samples": 100}}`` keeps the other caps), but an ``environment`` given replaces the old one whole. Errors:
    404 when unknown, 422 naming the field (nothing changes)."""
    row = state.registry.domain(domain)
    if row is None:
        raise HTTPException(404, f"unknown domain {domain!r}")
    base = row.config.model_dump(mode="json")
    if "environment" in body:  # a reference is replaced whole: {module} merged over {path} would name both
        base["environment"] = None
    return await _store(state, domain, deep_merge(base, body))


@router.post("/{domain}/pause", response_model=DomainPublic, dependencies=AUTH,
             responses={**AUTH_RESPONSES, **NOT_FOUND})
async def pause_domain(domain: DomainName, state: StateDep) -> DomainPublic:
    """Stop issuing a domain's training groups (state ``paused``; evaluation goes on; the trainer drops its
    groups in flight). Errors: 404."""
    from scheduler_service.routes.monitor import run_control

    await run_control(state, {"command": "pause_domain", "domain": domain})
    return domain_views(state, domain)[0]


@router.post("/{domain}/resume", dependencies=AUTH,
             responses={**AUTH_RESPONSES, 404: {"description": "The domain is unknown or not paused."}})
async def resume_domain(domain: DomainName, state: StateDep) -> dict[str, str]:
    """Issue a paused domain's training groups again (after its tasks were fixed). Errors: 404 when the
    domain is not paused."""
    from scheduler_service.routes.monitor import run_control

    if state.registry.domain(domain) is None or not (await run_control(
            state, {"command": "resume_domain", "domain": domain}))["applied"]:
        raise HTTPException(404, f"domain {domain!r} is not paused")
    return {"domain": domain, "state": "resumed"}


@router.post("/{domain}/breaker/{action}", response_model=DomainPublic, dependencies=AUTH,
             responses={**AUTH_RESPONSES, **NOT_FOUND})
async def breaker(domain: DomainName, action: Literal["open", "close"], state: StateDep,
                  reason: Annotated[str, Query(max_length=1000)] = "") -> DomainPublic:
    """Force the domain's circuit breaker open (no automatic probe until closed) or close it now. Errors: 404."""
    from scheduler_service.routes.monitor import run_control

    await run_control(state, {"command": f"{action}_breaker", "domain": domain, "reason": reason})
    return domain_views(state, domain)[0]
