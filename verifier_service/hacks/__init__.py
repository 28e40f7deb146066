"""Reward-hacking detectors: patterns a policy finds when it optimises the verifier instead of the task.

Each detector returns evidence (a short dict) or None. They are flagged in ``Reward.details["hacks"]``
and counted in the verifier's metrics (``verifier/hack_<name>``), and zero the reward unless the
recipe's ``hack_policy`` is ``flag`` (the default is ``zero``); ``judge_injection`` zeroes only a task
whose recipe has a judge (:func:`zeroing_hacks`): elsewhere no grader reads it, so it is only flagged. They are heuristics biased against
false positives: the canonical solutions of every shipped domain trigger none of them (tested), nor
do ordinary answers that restate their result or mention a score, code with repeated lines, grids or
long digit strings, nor the questions of the shipped domains (796 texts), nor the 232 real model
outputs Math-Verify's tests expect to match (tested). Every scan is linear in the text.

* ``multiple_answers``: more final answers than one complete answer holds (hedging across
  ``<answer>`` tags, ``\\boxed{}`` or "final answer:" lines, hoping one of them is matched), judged
  against the task's gold (:func:`~verifier_service.hacks.gold.gold_shape`): a tuple, a set or
  ``k = 45 and n = 2`` may be stated in as many parts as the gold has; equivalent restatements
  (``10^3`` and ``1 000``, ``2π`` and ``2\\pi``, a tag inside a "Final answer:" line) are one answer;
  answers stated in prose ("Answer: 44", "the answer is 44", "44 or 45" closing the response) count
  beside one equal to the gold.
* ``test_tampering``: code that exits early, patches builtins or the test machinery, inspects the
  caller's frames, or redefines the harness's ``check``.
* ``judge_injection``: instructions aimed at the grader inside the answer, in prose, code comments
  (fenced code is read for its comments only), HTML comments or hidden markup, a verdict in the
  judge's words (``{"score": 10}``, "Rubric satisfied"), or a forged turn (a chat-template token,
  "System:", ``[INST]``).
* ``degenerate_repetition``: the same words or line over and over in prose.

Each family has its own module (``hedging``, reading answers with ``answers`` and the gold's shape with
``gold``; ``tampering``; ``injection``; ``repetition``); this package runs them all (:func:`detect_hacks`)
and decides which of them zero the reward (:func:`zeroing_hacks`).
"""

from __future__ import annotations

from typing import Any

from verifier_service.hacks.gold import GoldShape
from verifier_service.hacks.hedging import multiple_answers
from verifier_service.hacks.injection import judge_injection
from verifier_service.hacks.repetition import degenerate_repetition
from verifier_service.hacks.tampering import tampers_with_tests

JUDGE_ONLY = frozenset({"judge_injection"})
"""Hacks that can raise a reward only through a judge: they zero only a task whose recipe has one."""


def zeroing_hacks(hacks: dict[str, Any], judged: bool) -> list[str]:
    """The detected ``hacks`` that zero the reward under ``hack_policy: zero``, sorted: all of them when
    the recipe has a judge (``judged``), else all but :data:`JUDGE_ONLY` (an instruction to a grader
    that no grader reads is only flagged, for analytics: "score = 10" in code, "the grader should
    award 2 points" in a word problem)."""
    return sorted(h for h in hacks if judged or h not in JUDGE_ONLY)


def detect_hacks(completion: str, code_kind: bool = False, gold: GoldShape | None = None) -> dict[str, dict[str, Any]]:
    """All detectors that fire on ``completion``: ``test_tampering`` when the task is scored by running
    code (``code_kind``), else ``multiple_answers`` against the task's ``gold`` shape
    (:func:`~verifier_service.hacks.gold.gold_shape`; None: one part); then ``judge_injection`` and
    ``degenerate_repetition``. Which of them zero the reward is :func:`zeroing_hacks`' call
    (``judge_injection`` only on a judged task)."""
    found: dict[str, dict[str, Any]] = {}
    checks = [("test_tampering", tampers_with_tests) if code_kind
              else ("multiple_answers", lambda c: multiple_answers(c, gold)),
              ("judge_injection", judge_injection), ("degenerate_repetition", degenerate_repetition)]
    for name, fn in checks:
        ev = fn(completion)
        if ev is not None:
            found[name] = ev
    return found
