"""Decoding flywheel.trajectories without validating the same task K times.

The K trajectories of a group carry the same task (its prompt, verifier spec and any unit-test source).
:class:`TrajectoryDecoder` validates a task once and keeps it, keyed by its compact JSON, for the group's
other samples: each later trajectory validates only its own fields and reuses the task instance (pydantic
does not validate a model instance of the field's own class again). Errors are those of
:func:`shared.schemas.decode`, so a malformed record is dead-lettered with the same reason.
"""

from __future__ import annotations

from collections import OrderedDict

import orjson
from pydantic import ValidationError

from shared.schemas import DecodeError, Task, Trajectory, decode


class TrajectoryDecoder:
    """``decode(raw)`` → :class:`Trajectory`, each distinct task validated once while it stays among the
    ``max_tasks`` most recently seen (an LRU keyed by the task's compact JSON bytes).

    Args:
        max_tasks: tasks kept (a verifier batch holds the groups of a few hundred tasks at most).
    """

    def __init__(self, max_tasks: int = 1024) -> None:
        self.max_tasks = max_tasks
        self.tasks: OrderedDict[bytes, Task] = OrderedDict()
        self.hits = 0
        """Trajectories whose task was already validated."""

    def decode(self, raw: bytes | None) -> Trajectory:
        """The trajectory of one record value.

        Raises:
            shared.schemas.DecodeError: not a JSON object, or it fails validation (the reason names the field).
        """
        try:
            obj = orjson.loads(raw) if raw is not None else None
        except orjson.JSONDecodeError:
            obj = None
        task = obj.get("task") if isinstance(obj, dict) else None
        if not isinstance(task, dict):
            return decode(raw, Trajectory)  # whatever is wrong, the generic path names it
        key = orjson.dumps(task)
        known = self.tasks.get(key)
        if known is None:
            try:
                known = Task.model_validate(task)
            except ValidationError:
                return decode(raw, Trajectory)  # the reason as the generic path words it
            self.tasks[key] = known
            if len(self.tasks) > self.max_tasks:
                self.tasks.popitem(last=False)
        else:
            self.hits += 1
            self.tasks.move_to_end(key)
        obj["task"] = known
        try:
            return Trajectory.model_validate(obj)
        except ValidationError as e:
            errs = "; ".join(f"{'.'.join(map(str, er['loc'])) or '<root>'}: {er['msg']}" for er in e.errors()[:5])
            raise DecodeError(f"{Trajectory.SCHEMA} v{Trajectory.VERSION} validation failed: {errs}") from None
