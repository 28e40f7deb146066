"""The trainer's end of each group's trace: one ``train_group`` span per group it trains or drops.

A group's trace starts at the scheduler's ``issue_group`` span and reaches the trainer in the headers of
the group's flywheel.scored records (the verifier's ``verify`` span is current when it sends them).
:class:`GroupTraces` keeps the context of the first record of each training group it holds and, when
the group leaves the buffer, ends it with a ``train_group`` span parented on that context:

- ``outcome = "trained"``: spans the optimizer step that trained it; attributes ``step`` and
  ``policy_version`` (the version the step produced), ``behaviour_version``, ``samples``, ``reward_mean``;
- ``outcome = "dropped"``: a point span when its drop was announced on flywheel.group_drops; attributes
  ``reason`` (:data:`trainer_service.groups.DROP_REASONS`: ``stale``, ``failed``, ...), ``step`` and
  ``policy_version`` (the trainer's at the time), ``behaviour_version``, ``samples``.

Each optimizer step also gets a ``train_step`` span, the root of its own trace (a step mixes B groups
of B traces): attributes ``step``, ``policy_version``, ``groups`` (their ids) and its phase seconds.
Eval records are never trained, so eval traces end at the verifier.
"""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace

from shared.schemas import ScoredTrajectory
from shared.telemetry import extract_context
from trainer_service.groups import Drop, Group, GroupBuffer


class GroupTraces:
    """The trace context of each training group the trainer holds, and the spans that end them.

    Args:
        tracer: the trainer's tracer (``shared.telemetry.setup_tracing("trainer", ...)``).
    """

    def __init__(self, tracer: trace.Tracer | None = None) -> None:
        self.tracer = tracer or trace.get_tracer("trainer")
        self.contexts: dict[str, otel_context.Context] = {}
        """group_id -> the context from its first record's headers (dropped when the group ends)."""

    def remember(self, scored: ScoredTrajectory | None, headers, buffer: GroupBuffer) -> None:
        """Keep the trace context of ``scored``'s group from its record ``headers`` (Kafka ``(key, bytes)``
        pairs), if it is a training group the buffer has not finished. Call it before ``buffer.add``."""
        if scored is None or scored.trajectory.purpose != "train":
            return
        gid = scored.trajectory.group_id
        if gid in self.contexts or gid in buffer.done_groups or gid in buffer.in_flight:
            return
        self.contexts[gid] = extract_context(headers)

    def trained(self, groups: list[Group], step: int, version: int, start_ns: int, end_ns: int) -> None:
        """End the traces of ``groups``, trained by optimizer step ``step`` (producing ``version``) from
        ``start_ns`` to ``end_ns`` (Unix ns)."""
        for g in groups:
            rewards = [s.reward.total for s in g.samples.values()]
            attrs = {"group_id": g.group_id, "outcome": "trained", "step": step, "policy_version": version,
                     "samples": len(g.samples), "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0}
            if g.samples:
                attrs["domain"] = g.domain
                attrs["behaviour_version"] = g.behaviour_version
            span = self.tracer.start_span("train_group", context=self.contexts.pop(g.group_id, None),
                                          attributes=attrs, start_time=start_ns)
            span.end(end_time=end_ns)

    def dropped(self, drops: list[Drop], step: int, version: int) -> None:
        """End the traces of the groups in ``drops`` (announced at trainer step ``step``, version ``version``)."""
        for d in drops:
            attrs = {"group_id": d.group_id, "outcome": "dropped", "reason": d.reason, "step": step,
                     "policy_version": version, "samples": d.samples}
            if d.behaviour_version is not None:
                attrs["behaviour_version"] = d.behaviour_version
            self.tracer.start_span("train_group", context=self.contexts.pop(d.group_id, None),
                                   attributes=attrs).end()

    def step(self, groups: list[Group], step: int, version: int, start_ns: int, end_ns: int,
             seconds: dict[str, float]) -> None:
        """A ``train_step`` span (a root) for optimizer step ``step``: ``groups``' ids and the phase
        ``seconds`` (metric name -> seconds, e.g. ``time/train_step_s``) as attributes."""
        attrs: dict = {"step": step, "policy_version": version, "groups": [g.group_id for g in groups]}
        attrs.update({k: float(v) for k, v in seconds.items()})
        span = self.tracer.start_span("train_step", context=otel_context.Context(), attributes=attrs,
                                      start_time=start_ns)
        span.end(end_time=end_ns)
