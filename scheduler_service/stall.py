"""A run that cannot go on says so.

When the sampler has room for training groups, issues none, and has none in flight, it asks the planner why
(:meth:`scheduler_service.issuing.IssuePlanner.stall_reasons`): every domain retired or paused, over budget,
without a live training task at its level, or with a generator that ran dry. Reasons that pass by themselves (an
open breaker waiting for its probe, a generator still making tasks) are waiting, not a stall. A stall that lasts
``scheduler.stall_after_s`` raises one critical ``run/stalled`` alert naming each domain's reason, and shows in
``GET /v1/status`` (``stalled``); ``flywheel run`` ends on it with that message and writes its report. Work that
can be issued again (tasks submitted, a domain resumed, a budget raised) resolves it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from shared.schemas import Alert


def stall_message(reasons: dict[str, str]) -> str:
    """One sentence: the run cannot go on, each domain's reason, what would let it go on."""
    per = "; ".join(f"{d}: {why}" for d, why in sorted(reasons.items()))
    return (f"the run cannot go on: no domain can issue training work ({per}). Submit tasks, resume or re-weight a "
            f"domain, or raise its budget; or stop the run.")[:4096]


class StallWatch:
    """Turns the sampler's per-pass answer (a stall's reasons, or None) into the ``run/stalled`` alert.

    Args:
        after_s: ``scheduler.stall_after_s``.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = after_s
        self.clock = clock
        self.since: float | None = None
        """Monotonic time the current stall began (None: not stalled)."""
        self.since_wall: float | None = None
        self.reasons: dict[str, str] | None = None
        self.alert: Alert | None = None
        """The firing ``run/stalled`` alert (None until the stall lasted ``after_s``)."""

    def observe(self, reasons: dict[str, str] | None, policy_version: int) -> list[Alert]:
        """Take one pass's answer; the alerts to emit (the firing one once, its resolution once)."""
        if reasons is None:
            self.since = self.since_wall = self.reasons = None
            if self.alert is None:
                return []
            old, self.alert = self.alert, None
            return [old.model_copy(update={"status": "resolved", "time": time.time(), "policy_version": policy_version,
                                           "message": "the run can go on: a domain has training work again."})]
        if self.since is None:
            self.since, self.since_wall = self.clock(), time.time()
        self.reasons = reasons
        if self.alert is not None or self.clock() - self.since < self.after_s:
            return []
        self.alert = Alert(domain=None, signal="stalled", severity="critical", value=float(len(reasons)),
                           window=0, window_unit="steps", policy_version=policy_version,
                           message=stall_message(reasons), details={"domains": dict(reasons)})
        return [self.alert]

    def public(self) -> dict[str, Any] | None:
        """``GET /v1/status``'s ``stalled``: ``since`` (Unix seconds), ``domains`` (reasons) and ``message``, once
        the alert fired; None otherwise."""
        if self.alert is None or self.reasons is None:
            return None
        return {"since": self.since_wall, "domains": dict(self.reasons), "message": stall_message(self.reasons)}
