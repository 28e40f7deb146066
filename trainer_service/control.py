"""What flywheel.control asks of the trainer: which domains' groups it drops, and whether it steps.

:class:`ControlState` is a pure fold of :class:`shared.schemas.Control` records (no Kafka): the latest
``domain_state`` per domain (the scheduler's word on whether a domain trains: its circuit breaker, or an
operator's ``pause_domain``) and the latest ``pause_training``/``resume_training``. Every other command
is the scheduler's business and changes nothing here.

The consumer has no group and starts from the earliest offset, so a restarted trainer rebuilds the state
from the whole topic; :func:`read_control_to_end` does that before the first step, then
:func:`poll_control` (non-blocking) once per pass of the train loop. Malformed records go to flywheel.dlq
(again after every restart: nothing is committed) and change nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from shared import kafka
from shared.schemas import Control

log = logging.getLogger("trainer.control")

BLOCK_REASONS = ("circuit_open", "domain_paused")
"""The ``reason`` of a ``domain_state`` with ``trainable: false``: what its dropped groups are announced as."""

DEFAULT_BLOCK_REASON = "domain_paused"
"""Used for a ``trainable: false`` whose reason is neither of :data:`BLOCK_REASONS` (logged)."""


@dataclass
class ControlState:
    """The trainer's fold of flywheel.control.

    Attributes:
        blocked: domain -> why its groups are dropped (``circuit_open`` or ``domain_paused``).
        training_paused: a run-wide ``pause_training`` is in force: no optimizer step.
    """

    blocked: dict[str, str] = field(default_factory=dict)
    training_paused: bool = False
    drop_groups: set[str] = field(default_factory=set)
    """Group ids dropped as ``circuit_open`` whatever their domain's state (a closed breaker's probe)."""

    def apply(self, ctrl: Control) -> bool:
        """Fold one record in (the latest record per domain, and run-wide, wins).

        ``domain_state`` adds its ``drop_groups`` to :attr:`drop_groups`; with ``trainable`` false it blocks ``ctrl.domain`` with ``ctrl.reason`` (a reason
        outside :data:`BLOCK_REASONS` blocks it as :data:`DEFAULT_BLOCK_REASON`), true unblocks it;
        ``pause_training``/``resume_training`` set :attr:`training_paused` whatever their origin. Other
        commands are ignored.

        Returns:
            Whether the state changed.
        """
        if ctrl.command == "domain_state":
            self.drop_groups.update(ctrl.drop_groups)
            if ctrl.trainable:
                return self.blocked.pop(ctrl.domain, None) is not None
            reason = ctrl.reason if ctrl.reason in BLOCK_REASONS else DEFAULT_BLOCK_REASON
            if reason != ctrl.reason:
                log.warning("domain_state for %s has reason %r, expected one of %s: blocking it as %s",
                            ctrl.domain, ctrl.reason, BLOCK_REASONS, reason)
            changed = self.blocked.get(ctrl.domain) != reason
            self.blocked[ctrl.domain] = reason
            return changed
        if ctrl.command in ("pause_training", "resume_training"):
            paused = ctrl.command == "pause_training"
            changed, self.training_paused = self.training_paused != paused, paused
            return changed
        return False


def _log_change(ctrl: Control, state: ControlState) -> None:
    why = f"{ctrl.origin}{': ' + ctrl.reason if ctrl.reason else ''}"
    if ctrl.command == "domain_state" and ctrl.domain in state.blocked:
        log.warning("domain %s blocked (%s, from %s): its ready groups are dropped", ctrl.domain,
                    state.blocked[ctrl.domain], ctrl.origin)
    elif ctrl.command == "domain_state":
        log.info("domain %s trainable again (from %s)", ctrl.domain, why)
    elif state.training_paused:
        log.warning("training paused (from %s): no optimizer step until resume_training", why)
    else:
        log.info("training resumed (from %s)", why)


async def poll_control(consumer, producer, state: ControlState, timeout_ms: int = 0) -> bool:
    """Fold what ``consumer`` (a started consumer of flywheel.control) has fetched into ``state``.

    Args:
        consumer: the control consumer (``getmany`` is called once, with ``timeout_ms``).
        producer: a started producer, for dead letters.
        state: updated in place; each change is logged.
        timeout_ms: how long to wait for records (0: take what is already fetched, do not block).

    Returns:
        Whether ``state`` changed.

    Raises:
        aiokafka.errors.KafkaError: a malformed record could not be dead-lettered.
    """
    changed = False
    batch = await consumer.getmany(timeout_ms=timeout_ms, max_records=1024)
    for msgs in batch.values():
        for msg in msgs:
            ctrl = await kafka.decode_or_dead_letter(producer, msg, Control, "trainer")
            if ctrl is not None and state.apply(ctrl):
                _log_change(ctrl, state)
                changed = True
    return changed


async def read_control_to_end(consumer, producer, state: ControlState, timeout_s: float = 30.0) -> None:
    """Fold the whole of flywheel.control, up to its end offsets at the call, into ``state``: at start-up,
    so the first step already obeys what was sent before (a restart rebuilds the state).

    Gives up after ``timeout_s`` seconds with a warning (the loop's polls then catch up).

    Raises:
        aiokafka.errors.KafkaError: the end offsets cannot be read, or a dead letter cannot be sent.
    """
    parts = list(consumer.assignment())
    ends = await consumer.end_offsets(parts) if parts else {}
    deadline = time.monotonic() + timeout_s
    while True:
        behind = [tp for tp in parts if await consumer.position(tp) < ends[tp]]
        if not behind:
            break
        if time.monotonic() > deadline:
            log.warning("flywheel.control not read to its end in %.0f s (behind on %s): going on", timeout_s,
                        sorted(behind))
            break
        await poll_control(consumer, producer, state, timeout_ms=200)
    log.info("flywheel.control read: %d domains blocked %s, training %s", len(state.blocked), state.blocked,
             "paused" if state.training_paused else "running")

