"""``/v1/status``, ``/v1/metrics/history`` and ``/healthz``."""

from fastapi import APIRouter

from scheduler_service.deps import StateDep
from scheduler_service.models import EvalRoundPublic, MetricsRecord, Staleness, StatusPublic
from shared.http import CheckedRoute

router = APIRouter(tags=["status"], route_class=CheckedRoute)


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
        cost=_cost_totals(reg.spend()),
        domains=_domain_counts(state),
        paused_domains={d: v["reason"] for d, v in reg.paused_domains().items()},
        alerts=_alert_counts(state),
        breakers={d: b.state for d, b in state.guard.monitor.breakers.items() if b.state != "closed"},
        training_paused=reg.training_pause(),
        stalled=state.sampler.stall.public() if state.sampler is not None else None,
    )


def _alert_counts(state) -> dict:
    active = list(state.guard.monitor.active.values())
    out = {"active": len(active), "critical": 0, "warning": 0, "info": 0}
    for a in active:
        out[a.severity] += 1
    out["firing"] = [a.key for a in active]
    return out


def _cost_totals(spend: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Spend summed over domains, per purpose."""
    out: dict[str, dict[str, float]] = {}
    for per in spend.values():
        for purpose, vals in per.items():
            tot = out.setdefault(purpose, {})
            for k, v in vals.items():
                tot[k] = tot.get(k, 0.0) + v
    return out


def _domain_counts(state) -> dict[str, int]:
    from scheduler_service.routes.domains import domain_views

    out: dict[str, int] = {}
    for v in domain_views(state):
        out[v.status] = out.get(v.status, 0) + 1
    return out


@router.get("/v1/metrics/history", response_model=list[MetricsRecord])
def metrics_history(state: StateDep) -> list[MetricsRecord]:
    """Trainer Metrics records seen on flywheel.metrics, in step order."""
    return [MetricsRecord(**m) for m in state.stats.history()]


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness."""
    return {"status": "ok"}
