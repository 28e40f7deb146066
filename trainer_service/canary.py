"""The trainer's side of the canary check (``shared/canary.py``): is each engine serving what was published?

After every optimizer step (and at start, for the version resumed) the trainer scores the canary sequence under
the weights of its new version, in their dtype (float32 unless ``trainer.dtype``) without autocast, and keeps the last :attr:`CanaryCheck.keep` scorings.
Before a step takes groups, each ready group is checked: every sample's attestation (its engine's canary
scores for the versions it was generated with) must lie within ``shared.canary.tolerance(precision)`` of the
trainer's scoring of the same version, as a mean absolute log-prob difference per token. A group with any
sample outside is dropped (``canary``) and the engine is marked failing: a ``run/canary`` alert fires (critical)
and stays until every failing engine has passed again (or has not failed for ``keep`` versions: a replaced
replica never reports under its old id). Samples without an attestation (SGLang, the null engine)
or for a version the trainer no longer holds a scoring of (older than ``keep``, or from before a restart) are not
checked; they are counted (``canary/unchecked_samples``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from shared.canary import canary_diff, canary_logprobs, canary_tokens, tolerance
from trainer_service.groups import Group

log = logging.getLogger("trainer")


@dataclass
class Verdict:
    """The check of one group."""

    ok: bool
    worst: float | None = None
    """The largest mean |Δ log p| per token among its checked scores (``None``: nothing checked)."""
    engines: set[str] = field(default_factory=set)
    """Engines whose scores were outside tolerance."""
    unchecked: int = 0
    """Samples with no comparable score."""


class CanaryCheck:
    """Scores the canary per published version and checks the engines' attestations against it.

    Args:
        model: the policy (its current weights are scored by :meth:`record`).
        tokenizer: the tokenizer the engines use (same chat template, so the same canary ids).
        keep: scorings kept (the newest versions; η + 2 suffice, more cover slow engines).
    """

    def __init__(self, model, tokenizer, keep: int = 16) -> None:
        self.model = model
        self.ids = canary_tokens(tokenizer)
        self.keep = keep
        self.own_precision = str(next(model.parameters()).dtype).removeprefix("torch.")
        """The trainer's own weights' dtype: with ``trainer.dtype: bfloat16`` the canary is scored in bf16, and an
        engine is judged by the looser tolerance of the two kinds."""
        self.scores: OrderedDict[int, list[float]] = OrderedDict()
        self.failing: dict[str, float] = {}
        """Engine -> its worst difference, while it fails (cleared when a later check of it passes, or when it has
        not failed for :attr:`keep` versions: a replica that was replaced never passes under its old id)."""
        self._failed_at: dict[str, int] = {}
        self.last_worst: float = 0.0
        """The largest difference seen since :meth:`take_metrics` (nats per token)."""
        self.unchecked = 0

    def record(self, version: int) -> list[float]:
        """Score the canary under the model's weights now, as policy ``version``; returns the log-probs."""
        was_training = self.model.training
        self.model.eval()
        try:
            lp = canary_logprobs(self.model, *self.ids)
        finally:
            self.model.train(was_training)
        self.scores[version] = lp
        self.scores.move_to_end(version)
        while len(self.scores) > self.keep:
            self.scores.popitem(last=False)
        for engine, at in list(self._failed_at.items()):
            if version - at > self.keep:
                log.warning("engine %s has not failed the canary check for %d versions: no longer counted as failing",
                            engine, self.keep)
                self.failing.pop(engine, None)
                self._failed_at.pop(engine)
        return lp

    def check(self, group: Group) -> Verdict:
        """Check every sample of ``group`` (see the module docstring); updates :attr:`failing`."""
        verdict = Verdict(ok=True)
        passed: set[str] = set()
        for s in group.samples.values():
            att = s.trajectory.attestation
            checked = False
            for score in att.canary if att is not None else ():
                mine = self.scores.get(score.version)
                if mine is None:
                    continue
                try:
                    diff = canary_diff(score.logprobs, mine)
                except ValueError:  # another tokenizer's canary: nothing to compare
                    continue
                checked = True
                verdict.worst = diff if verdict.worst is None else max(verdict.worst, diff)
                if diff > max(tolerance(att.precision), tolerance(self.own_precision)):
                    verdict.ok = False
                    verdict.engines.add(att.engine)
                    self.failing[att.engine] = max(diff, self.failing.get(att.engine, 0.0))
                    self._failed_at[att.engine] = next(reversed(self.scores))
                else:
                    passed.add(att.engine)
            if not checked:
                verdict.unchecked += 1
        for engine in passed - verdict.engines:
            self._failed_at.pop(engine, None)
            if self.failing.pop(engine, None) is not None:
                log.warning("engine %s passes the canary check again", engine)
        self.unchecked += verdict.unchecked
        if verdict.worst is not None:
            self.last_worst = max(self.last_worst, verdict.worst)
        return verdict

    def take_metrics(self) -> dict[str, float]:
        """``canary/*`` values since the last call: the worst difference, the unchecked samples, the engines
        failing now."""
        out = {"canary/abs_logp_diff_max": self.last_worst, "canary/unchecked_samples": float(self.unchecked),
               "canary/failing_engines": float(len(self.failing))}
        self.last_worst, self.unchecked = 0.0, 0
        return out
