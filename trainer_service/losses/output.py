"""What a loss function returns, and how the trainer turns its summed statistics into metrics.

A loss of one micro-batch returns :class:`LossOutput`: its scalar share of the batch loss and, under
keys ending in ``_sum``, statistics summed over the micro-batch's unmasked tokens. The trainer adds
each key over the micro-batches and reports it as a mean over the tokens that went through the model
(:func:`token_means`), under the name its :class:`TokenMean` gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, NamedTuple

if TYPE_CHECKING:
    import torch


class LossOutput(NamedTuple):
    """The loss of one micro-batch (unpacks as ``loss, metrics``)."""

    loss: torch.Tensor
    """Scalar, the dtype of the log-probs, with a graph: this micro-batch's share of the batch loss (the
    micro-batches' losses add up to the batch loss, since the normaliser counts the whole batch)."""
    metrics: dict[str, float]
    """``loss/<statistic>_sum``: sums over the micro-batch's unmasked tokens (plain floats, no graph)."""


@dataclass(frozen=True)
class TokenMean:
    """How a ``_sum`` statistic is reported: ``sum / tokens`` under ``name``, ``empty`` when no token went
    through the model (no row had a non-zero advantage and there is no KL term)."""

    name: str
    """Metric name, prefixed by its area (``loss/``)."""
    empty: float = 0.0
    """Value when no token was seen (1.0 for importance ratios: the policy equals itself)."""


def token_means(sums: Mapping[str, float], specs: Mapping[str, TokenMean], n_tokens: float,
                any_tokens: bool) -> dict[str, float]:
    """Per-token means of summed statistics.

    Args:
        sums: ``key → sum`` over every micro-batch (keys that no micro-batch returned count as 0).
        specs: ``key → TokenMean`` of the keys to report even when no micro-batch ran, in report order.
        n_tokens: unmasked tokens that went through the model (≥ 1).
        any_tokens: whether any micro-batch ran.

    Returns:
        ``name → sum / n_tokens`` (``empty`` without tokens) for every key of ``specs``, then for every
        other key of ``sums`` ending in ``_sum``, reported as ``<key without _sum>_mean``.
    """
    out: dict[str, float] = {}
    for key, spec in specs.items():
        out[spec.name] = sums.get(key, 0.0) / n_tokens if any_tokens else spec.empty
    for key, value in sums.items():
        if key not in specs and key.endswith("_sum"):
            out[key.removesuffix("_sum") + "_mean"] = value / n_tokens
    return out
