"""``/v1/status``, ``/v1/metrics/history`` and ``/healthz``."""

from fastapi import APIRouter, HTTPException

from scheduler_service.deps import StateDep
from scheduler_service.models import EvalRoundPublic, MetricsRecord, Staleness, StatusPublic

router = APIRouter(tags=["status"])


@router.get("/v1/status", response_model=StatusPublic)
def get_status(state: StateDep) -> StatusPublic:
    """System progress: policy version, groups per state, throughput, staleness, trainer metrics, evals."""
    reg, stats = state.registry, state.stats
    groups = reg.group_state_counts()
    history = stats.history()
    last = history[-1] if history else None
    return StatusPublic(
        policy_version=reg.policy_version,
        in_flight_groups=groups["issued"],
        pending_groups=groups["pending"],
        issued_groups=groups["issued"] + groups["complete"] + groups["abandoned"],
        completed_groups=groups["complete"],
        abandoned_groups=groups["abandoned"],
        dropped_groups=reg.dropped_counts(),
        samples_scored=reg.samples_scored(),
        throughput_samples_per_s=stats.throughput(),
        staleness=Staleness(**stats.staleness()),
        train_reward_mean=stats.reward_mean(),
        tasks=reg.task_counts(),
        trainer=last["values"] if last else {},
        trainer_step=last["step"] if last else None,
        evals=[EvalRoundPublic(**r) for r in reg.eval_rounds()],
        paused_domains={d: v["reason"] for d, v in reg.paused_domains().items()},
    )


@router.post("/v1/domains/{domain}/resume")
def resume_domain(domain: str, state: StateDep) -> dict[str, str]:
    """Issue a paused domain's training groups again (after its tasks were fixed).

    Raises:
        HTTPException: 404 when the domain is not paused.
    """
    if not state.registry.resume_domain(domain):
        raise HTTPException(404, f"domain {domain!r} is not paused")
    return {"domain": domain, "state": "resumed"}


@router.get("/v1/metrics/history", response_model=list[MetricsRecord])
def metrics_history(state: StateDep) -> list[MetricsRecord]:
    """Trainer Metrics records seen on flywheel.metrics, in step order."""
    return [MetricsRecord(**m) for m in state.stats.history()]


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness."""
    return {"status": "ok"}
