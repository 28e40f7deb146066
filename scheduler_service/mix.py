"""Mix ratios: which domain gets the next training group.

Stride scheduling (Waldspurger & Weihl 1995, "Stride Scheduling: Deterministic Proportional-Share
Resource Management") with the eligibility rule of WF²Q+ (Bennett & Zhang 1997): every domain holds a
*pass* value that grows by its stride 1 / weight per group. Over any window of N decisions a domain with
weight w among eligible weights W gets N·w/W groups ± 1, not ± √N as a weighted random draw would. A domain that joins, changes weight or was not eligible (paused, out of tasks, over budget) starts
at the lowest pass of the others: it is due at once, banks no credit while away and gets no burst on
return; its share went to the others in proportion meanwhile.

With a cost order (``scheduler.issue_order: cost``) a domain due within the next ``lookahead``
decisions may go first when its groups take longer (learned wall seconds per group), so long multi-turn
groups start early and short ones fill around them. The most overdue domain is passed over at most
``lookahead`` times in a row, which bounds how far counts drift from the weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class StrideMix:
    """Deterministic weighted round-robin over domains (in memory; a restart starts every pass at 0).

    Stride scheduling with eligibility (WF²Q+, Bennett & Zhang 1997): a domain's *pass* is the virtual
    time its next group starts; a virtual clock advances 1 / Σ weights per decision; among the domains
    whose pass the clock has reached, the one whose group would finish first (pass + 1 / weight) goes
    next. Each domain stays within one group of its exact share over any window, and a new weight
    applies from the next decision (plain stride would first finish the round in progress).

    Args:
        lookahead: decisions a domain may be moved ahead by in :meth:`choose` with costs (≥ 1).
    """

    def __init__(self, lookahead: int = 4) -> None:
        self.lookahead = lookahead
        self.clock = 0.0
        self._pass: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._skips = 0
        self._last_eligible: frozenset[str] = frozenset()
        self._ready: list[str] = []
        self._total = 0.0
        self._last_head: str | None = None

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The configured weights of the domains that may be issued (others are dropped from the mix).

        A new domain, or one whose weight changed, starts at the clock: a new weight applies from the
        next decision, without credit or debt from the old one.
        """
        for d in [d for d in self._weight if d not in weights]:
            del self._weight[d]
        for d, w in weights.items():
            if self._weight.get(d) != w:
                self._pass[d] = self.clock
                self._weight[d] = float(w)

    def start(self, eligible: Iterable[str]) -> None:
        """Begin a pass over ``eligible`` domains (those with a positive weight count): a domain back after
        a pause, an empty pool or a budget stop starts at the clock (no banked credit); when every domain ran
        ahead, the clock jumps to the earliest."""
        ready = sorted(d for d in eligible if self._weight.get(d, 0.0) > 0.0)
        now = frozenset(ready)
        for d in now - self._last_eligible:
            self._pass[d] = max(self._pass[d], self.clock)
        self._last_eligible = now
        self._ready = ready
        self._total = sum(self._weight[d] for d in ready)
        if ready:
            self.clock = max(self.clock, min(self._pass[d] for d in ready))

    def drop(self, domain: str) -> None:
        """Leave ``domain`` out for the rest of the pass (it ran out of tasks or budget)."""
        self._last_head = None
        if domain in self._ready:
            self._ready.remove(domain)
            self._total -= self._weight[domain]
            self._last_eligible = frozenset(self._ready)
            if self._ready:
                self.clock = max(self.clock, min(self._pass[d] for d in self._ready))

    def _sync(self, eligible: Iterable[str] | None) -> None:
        if eligible is not None:
            self.start(eligible)

    def _head(self) -> str:
        best, key = None, None
        limit = self.clock + 1e-12
        for d in self._ready:
            p = self._pass[d]
            if p <= limit:
                k = p + 1.0 / self._weight[d]
                if key is None or k < key:
                    best, key = d, k
        return best

    def choose(self, eligible: Iterable[str] | None = None, cost: Mapping[str, float] | None = None) -> str | None:
        """The domain that should get the next group, without taking it (see :meth:`take`).

        Args:
            eligible: domains that can be issued now (``None``: those of the last :meth:`start`, less
                :meth:`drop`-ped ones).
            cost: expected wall seconds of one group per domain (``None``: strict fair order).

        Returns:
            A domain name, or ``None`` when no eligible domain has a positive weight.
        """
        self._sync(eligible)
        if not self._ready:
            return None
        head = self._last_head = self._head()
        if not cost or self._skips >= self.lookahead:
            return head
        horizon = self.clock + self.lookahead / self._total  # due within the next `lookahead` decisions
        best, key = head, (cost.get(head, 0.0), True)
        for d in self._ready:
            if self._pass[d] <= horizon and (cost.get(d, 0.0), d == head) > key:
                best, key = d, (cost.get(d, 0.0), d == head)
        return best

    def take(self, domain: str, eligible: Iterable[str] | None = None) -> None:
        """Record that ``domain`` got a group: its pass grows by its stride 1 / weight, the clock by
        1 / Σ eligible weights.

        Raises:
            KeyError: ``domain`` is not in the mix.
        """
        self._sync(eligible)
        if not self._ready:
            self.start([domain])
        head = self._last_head if eligible is None and self._last_head is not None else self._head()
        self._skips = 0 if domain == head else self._skips + 1
        self._last_head = None
        self._pass[domain] += 1.0 / self._weight[domain]
        self.clock += 1.0 / self._total

    def passes(self) -> dict[str, float]:
        """Pass value per domain in the mix (for status and tests)."""
        return {d: self._pass[d] for d in self._weight}
