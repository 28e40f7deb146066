"""The dashboard's training curves and throughput, built incrementally from the registry's reward rows.

``GET /v1/dashboard/data`` (``scheduler_service.routes.dashboard``) is polled every few seconds for the
life of a run, and the rewards table grows by one row per sample. Re-aggregating the table on every poll
would cost O(rows) under the registry lock that the sampler shares; instead :class:`RewardSeries` keeps
running sums and reads only the rows stored since its last read
(:meth:`scheduler_service.registry.Registry.reward_rows_after`), in chunks, so a poll costs O(new rows)
and a scheduler restart catches up over a few polls. Memory is bounded: one accumulator per (domain,
behaviour policy version), groups still filling (capped), and at most :data:`MAX_BINS` throughput bins.

Pure: no FastAPI, no Kafka; tested on its own (``tests/scheduler_service/test_dashboard.py``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

MAX_BINS = 240
"""Throughput bins kept; when the run outgrows them, the bin width doubles (adjacent bins merge)."""
MAX_VERSIONS = 1024
"""Accumulators kept per domain: when a run spans more policy versions, each accumulator covers a range of
versions whose width doubles (adjacent ranges merge, exactly)."""
MAX_OPEN_GROUPS = 50_000
"""Training groups still filling whose completion hashes are kept; beyond it the oldest is forgotten."""


@dataclass
class _Acc:
    """Running sums of one (domain, behaviour version): scored training samples and finished groups."""

    samples: int = 0
    reward: float = 0.0
    passed: int = 0
    length_n: int = 0
    length: float = 0.0
    groups: int = 0
    diversity: float = 0.0

    def merge(self, o: "_Acc") -> None:
        """Add ``o``'s sums to these."""
        for k in ("samples", "reward", "passed", "length_n", "length", "groups", "diversity"):
            setattr(self, k, getattr(self, k) + getattr(o, k))

    def point(self, version: int) -> dict[str, Any]:
        """The curve point: means over the samples (``None`` where nothing was measured)."""
        s = self.samples
        return {"policy_version": version, "samples": s, "groups": self.groups,
                "reward_mean": self.reward / s if s else None, "pass_rate": self.passed / s if s else None,
                "length_mean": self.length / self.length_n if self.length_n else None,
                "diversity": self.diversity / self.groups if self.groups else None}


@dataclass
class _Open:
    """A training group still filling: counted samples so far and the completion hashes of the scored ones."""

    domain: str
    version: int
    n: int
    received: int = 0
    hashes: list[str] = field(default_factory=list)
    unhashed: int = 0


class RewardSeries:
    """Per-domain training curves over behaviour policy versions, and scored throughput over time.

    Feed it reward rows in storage order (:meth:`add`); :attr:`cursor` is the last row id read. Curves
    count scored training samples (counted, not an infrastructure error) at the behaviour policy version
    that generated them:

    - ``reward_mean``, ``pass_rate``: means over the samples;
    - ``length_mean``: mean ``completion_tokens``;
    - ``diversity``: per finished group, distinct ``completion_hash`` values / scored samples (1 = every
      completion differs, 1/K = all K equal; the drift monitor's within-group diversity), averaged over the
      groups of that version (a group counts at its first sample's version; groups with a sample of unknown
      hash, or fewer than 2 scored samples, are left out).

    Throughput counts every scored sample (training and evaluation) in the bin of its receipt time, and every
    completed group in the bin of its last sample.

    Args:
        bin_s: initial throughput bin width (seconds); doubles whenever more than :data:`MAX_BINS` bins
            would be needed.
    """

    def __init__(self, bin_s: float = 5.0) -> None:
        self.cursor = 0
        self.scored = 0
        """Scored samples read (training and evaluation; infrastructure errors left out)."""
        self.bin_s = bin_s
        self._acc: dict[str, dict[int, _Acc]] = {}
        """Domain → first version of a range of :attr:`version_width` versions → its sums."""
        self.version_width = 1
        self._versions = (0, 0)
        """Lowest and highest policy version seen."""
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self._bins: dict[int, list[int]] = {}
        """Bin index (receipt time // bin_s) → [scored samples, completed groups]."""
        self._lo = self._hi = 0
        """Lowest and highest bin index in :attr:`_bins`."""

    def add(self, rows: Iterable[dict[str, Any]]) -> int:
        """Account reward rows (as :meth:`Registry.reward_rows_after` returns them, counted rows only).

        Returns:
            The number of rows read; :attr:`cursor` moves to the last one's ``rowid``.
        """
        k = 0
        for r in rows:
            k += 1
            self.cursor = max(self.cursor, int(r["rowid"]))
            scored = not r["infra_error"]
            if scored:
                self.scored += 1
                self._bin(r["received_at"])[0] += 1
            if r["purpose"] == "train" and r["domain"] is not None:
                self._train_row(r, scored)
            elif r["n"] <= 1:
                self._bin(r["received_at"])[1] += 1  # an eval group has one sample
        return k

    def _train_row(self, r: dict[str, Any], scored: bool) -> None:
        g = self._open.get(r["group_id"])
        if g is None:
            g = self._open[r["group_id"]] = _Open(r["domain"], int(r["policy_version"]), int(r["n"]))
            if len(self._open) > MAX_OPEN_GROUPS:
                self._open.popitem(last=False)
        g.received += 1
        if scored:
            a = self._acc_of(r["domain"], int(r["policy_version"]))
            a.samples += 1
            a.reward += float(r["reward"])
            a.passed += int(bool(r["passed"]))
            if r["completion_tokens"] is not None:
                a.length_n += 1
                a.length += float(r["completion_tokens"])
            if r["completion_hash"] is None:
                g.unhashed += 1
            else:
                g.hashes.append(r["completion_hash"])
        if g.received >= g.n:
            del self._open[r["group_id"]]
            self._bin(r["received_at"])[1] += 1
            if len(g.hashes) >= 2 and not g.unhashed:
                a = self._acc_of(g.domain, g.version)
                a.groups += 1
                a.diversity += len(set(g.hashes)) / len(g.hashes)

    def _acc_of(self, domain: str, version: int) -> _Acc:
        """The accumulator of ``version``'s range in ``domain`` (widening the ranges when needed)."""
        lo, hi = self._versions if self._acc else (version, version)
        self._versions = lo, hi = min(lo, version), max(hi, version)
        while (hi - lo) // self.version_width >= MAX_VERSIONS:
            self.version_width *= 2
            w = self.version_width
            for d, per in self._acc.items():
                merged: dict[int, _Acc] = {}
                for v, a in per.items():
                    merged.setdefault(v // w * w, _Acc()).merge(a)
                self._acc[d] = merged
        w = self.version_width
        return self._acc.setdefault(domain, {}).setdefault(version // w * w, _Acc())

    def _bin(self, t: float) -> list[int]:
        i = int(t // self.bin_s)
        b = self._bins.get(i)
        if b is not None:
            return b
        while self._bins and max(i, self._hi) - min(i, self._lo) >= MAX_BINS:
            self.bin_s *= 2
            merged: dict[int, list[int]] = {}
            for j, (s, g) in self._bins.items():
                m = merged.setdefault(j // 2, [0, 0])
                m[0] += s
                m[1] += g
            self._bins, self._lo, self._hi = merged, self._lo // 2, self._hi // 2
            i = int(t // self.bin_s)
        self._lo, self._hi = (min(i, self._lo), max(i, self._hi)) if self._bins else (i, i)
        return self._bins.setdefault(i, [0, 0])

    def curves(self, max_points: int = 300, max_domains: int = 20) -> dict[str, list[dict[str, Any]]]:
        """``{domain: [point, ...]}`` by policy version (see the class docstring for each value).

        A domain with more than ``max_points`` versions has them merged into consecutive ranges of equal
        width (exact sums: a point's means are over all of its range's samples; ``policy_version`` is the
        range's first). Only the ``max_domains`` domains with the most samples are returned.
        """
        top = sorted(self._acc, key=lambda d: -sum(a.samples for a in self._acc[d].values()))[:max_domains]
        out = {}
        for d in sorted(top):
            per = self._acc[d]
            lo, hi = min(per), max(per)
            width = max(1, math.ceil((hi - lo + 1) / max_points))
            merged: dict[int, _Acc] = {}
            for v in sorted(per):
                merged.setdefault(lo + (v - lo) // width * width, _Acc()).merge(per[v])
            out[d] = [a.point(v) for v, a in sorted(merged.items())]
        return out

    def throughput(self, now: float) -> list[dict[str, float]]:
        """Scored samples/s and completed groups/s per bin, oldest first, empty bins included: ``[{"t":
        bin start (Unix s), "samples_per_s", "groups_per_s"}]``. The newest bin's rate is over the part of it
        that has passed by ``now`` (Unix s)."""
        if not self._bins:
            return []
        out, last = [], self._hi
        for i in range(self._lo, last + 1):
            s, g = self._bins.get(i, (0, 0))
            start = i * self.bin_s
            span = self.bin_s if i < last else min(self.bin_s, max(now - start, 1.0))
            out.append({"t": start, "samples_per_s": s / span, "groups_per_s": g / span})
        return out
