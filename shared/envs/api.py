"""What a user's environment is: a dataset, an optional system prompt, and a rubric of reward functions.

The surface other people's code depends on, kept small: :class:`Environment`, :class:`Rubric`, and the calling
convention of a reward function. A reward function is a plain ``def`` or ``async def`` whose parameter names pick
what it is given (the convention of TRL's ``reward_funcs`` and of the ``verifiers`` library's rubrics):

=============== ======================================================================================
``prompt``      the messages the model saw (``list[dict]``, chat format)
``completion``  the model's answer (``str``)
``answer``      the dataset row's answer (any JSON value; ``None`` when the row has none)
``info``        the row's ``info`` dict (``{}`` when none)
``state``       the rollout's state (``{}`` for a single-turn rollout)
``task``        the whole dataset row, normalised (see :func:`shared.envs.datasets.normalise_row`)
``tool_calls``  the tool calls the model made, ``[{name, arguments, error}]`` (``[]`` for a single-turn rollout)
``turns``       a multi-turn rollout's turns, ``[{role, text}]``; its ``completion`` is the last assistant turn
=============== ======================================================================================

A function with ``**kwargs`` gets all of them. It returns a float, ``None`` (not applicable to this task: left
out of the weighted mean), or a dict with ``score`` (float or None) and named metrics (floats) that are reported
with the reward.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from shared.envs.workspace import Workspace, pack_workspace
from shared.envs.tools import tool_schema
from shared.tools import PARSERS

REWARD_ARGS = ("prompt", "completion", "answer", "info", "state", "task", "tool_calls", "turns")
"""Names a reward function may take."""

MAX_METRICS = 32
"""Most named metrics one reward call may report (more is a misconfigured reward)."""


class RewardError(Exception):
    """A reward function failed: it raised, returned something other than a number, ``None`` or a dict with
    ``score``, returned NaN or infinity, or the rubric's weighted mean fell outside [0, 1]. The verifier reports
    it as an infrastructure error (retried, counted in the domain's ``infra_error_rate``), never as a 0."""


@dataclass(frozen=True)
class RubricScore:
    """One completion's outcome under a rubric.

    Attributes:
        score: weighted mean of the applicable rewards, in [0, 1] (1.0 is a pass).
        rewards: each function's value by name (``None``: not applicable).
        metrics: named metrics the functions reported, ``<function>.<metric>`` -> float.
    """

    score: float
    rewards: dict[str, float | None]
    metrics: dict[str, float]


def _check_signature(func: Callable) -> frozenset[str] | None:
    """The argument names ``func`` takes (``None``: all of them, it takes ``**kwargs``).

    Raises:
        TypeError: ``func`` is not callable, or names a required parameter outside :data:`REWARD_ARGS`.
    """
    if not callable(func):
        raise TypeError(f"reward {func!r} is not callable")
    params = inspect.signature(func).parameters.values()
    unknown = [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
               and p.name not in REWARD_ARGS and p.default is p.empty]
    if unknown:
        raise TypeError(f"reward {getattr(func, '__name__', func)!r} takes {unknown}, which Flywheel does not "
                        f"pass; a reward may take {list(REWARD_ARGS)} (or **kwargs)")
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.name in REWARD_ARGS)


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"reward {name!r} returned {type(value).__name__} {str(value)[:80]!r}, not a number, "
                          "None or a dict with 'score'")
    if not math.isfinite(value):
        raise RewardError(f"reward {name!r} returned {value}")
    return float(value)


@dataclass
class Rubric:
    """Reward functions and their weights; the score is the weighted mean of the functions that apply.

    Args:
        funcs: reward functions (see the module docstring for what they take and return).
        weights: one per function (default 1.0 each); a weight of 0 reports the function's value without
            counting it (a logged metric).

    Raises:
        TypeError: a function is not callable or takes an argument Flywheel does not pass.
        ValueError: no function, weights of another length, or a negative or non-finite weight.
    """

    funcs: Sequence[Callable[..., Any]]
    weights: Sequence[float] | None = None
    _takes: list[frozenset[str] | None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.funcs = list(self.funcs)
        if not self.funcs:
            raise ValueError("a rubric needs at least one reward function")
        self.weights = [1.0] * len(self.funcs) if self.weights is None else [float(w) for w in self.weights]
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"{len(self.weights)} weights for {len(self.funcs)} reward functions")
        if any(not math.isfinite(w) or w < 0 for w in self.weights):
            raise ValueError(f"rubric weights must be finite and >= 0: {self.weights}")
        self._takes = [_check_signature(f) for f in self.funcs]

    @property
    def names(self) -> list[str]:
        return [getattr(f, "__name__", f"reward_{i}") for i, f in enumerate(self.funcs)]

    def _call(self, i: int, context: dict[str, Any]) -> Any:
        takes = self._takes[i]
        out = self.funcs[i](**(context if takes is None else {k: v for k, v in context.items() if k in takes}))
        return asyncio.run(out) if inspect.isawaitable(out) else out

    def score(self, **context: Any) -> RubricScore:
        """Run every function on ``context`` (the names of :data:`REWARD_ARGS`) and combine them.

        Async functions are run to completion here, so call it from a worker thread or process, not from a
        running event loop.

        Raises:
            RewardError: a function raised or returned a bad value, every function returned None, or the
                weighted mean is outside [0, 1].
        """
        rewards: dict[str, float | None] = {}
        metrics: dict[str, float] = {}
        for i, name in enumerate(self.names):
            try:
                out = self._call(i, context)
            except RewardError:
                raise
            except Exception as e:  # noqa: BLE001 - the user's code: any failure is the reward's error
                raise RewardError(f"reward {name!r} raised {type(e).__name__}: {str(e)[:300]}") from e
            if isinstance(out, dict):
                if "score" not in out:
                    raise RewardError(f"reward {name!r} returned a dict without 'score': {sorted(out)[:10]}")
                extra = {k: v for k, v in out.items() if k != "score"}
                if len(extra) > MAX_METRICS:
                    raise RewardError(f"reward {name!r} reported {len(extra)} metrics (at most {MAX_METRICS})")
                metrics |= {f"{name}.{k}": _number(v, f"{name}.{k}") for k, v in extra.items()}
                out = out["score"]
            rewards[name] = None if out is None else _number(out, name)
        applied = [(w, rewards[n]) for n, w in zip(self.names, self.weights) if rewards[n] is not None and w > 0]
        if not applied:
            raise RewardError("no reward function applied to this task (all returned None or weigh 0)")
        total = sum(w * r for w, r in applied) / sum(w for w, _ in applied)
        if not -1e-9 <= total <= 1 + 1e-9:
            raise RewardError(f"the rubric's weighted mean {total:.4g} is outside [0, 1] ({rewards}); Flywheel "
                              "rewards are in [0, 1] with 1.0 a pass: scale the functions' values")
        return RubricScore(min(1.0, max(0.0, total)), rewards, metrics)


@dataclass
class Environment:
    """A domain a user brings: tasks, how they are asked, how the model may act, and how answers are scored.

    Args:
        dataset: the training rows: a list of dicts, or a path (JSONL, JSON, Parquet, CSV, or a Hugging Face
            ``datasets`` folder saved with ``save_to_disk``); see :func:`shared.envs.datasets.load_rows` for the
            columns each row needs (``prompt`` or ``question``; ``answer`` and ``info`` optional).
        rubric: a :class:`Rubric`, or one reward function, or a list of them (weight 1 each).
        system_prompt: system message put before every prompt given as text (``None``: none).
        eval_dataset: held-out rows (same forms as ``dataset``); ``None``: held-out tasks are drawn from
            ``dataset`` and kept disjoint from training ones.
        columns: column mapping applied to both datasets, ``{flywheel_name: dataset_column}``, e.g.
            ``{"question": "problem", "answer": "solution"}``.
        name: the domain's default name (the driver falls back to the reference's id, module or file stem).
        tools: Python functions the model may call (:mod:`shared.envs.tools`: schema from type hints and a
            Google-style docstring; ``state``, ``task`` and ``sandbox`` parameters are injected).
        workspace: a directory each rollout's sandbox session starts from as its own copy (``/work``, kept
            across the rollout's turns, with snapshots and rollback); tools and hooks reach it through their
            ``sandbox`` parameter (:class:`shared.envs.sandbox.Sandbox`). ``None``: the session's ``/work``
            starts empty. Give it relative to your module (``Path(__file__).parent / "repo"``): a relative
            path is read from the service's working directory (the run directory).
        setup: called once per rollout before the first turn, to fill ``state`` (takes any of ``state``,
            ``task``, ``prompt``, ``answer``, ``info``, ``sandbox``).
        env_response: called after an assistant turn that makes no tool call: returns the next user message, or
            ``None`` when the rollout is done (takes any of ``completion``, ``state``, ``task``, ``turn``,
            ``answer``, ``info``, ``prompt``, ``sandbox``). Without it such a turn ends the rollout.
        cleanup: called once per rollout at its end, whatever happened, before its sandbox session ends (takes
            ``completion``, the last assistant turn, and the rest as ``setup``): the place to read the
            workspace's final state into ``state`` for the rewards.
        tool_parser: how the model writes calls: ``hermes`` (``<tool_call>{...}</tool_call>``, the default) or
            ``llama3_json`` (a bare ``{"name", "parameters"}`` object); :data:`shared.tools.PARSERS`.
        max_turns: assistant turns per rollout (default 1, or 4 with tools or ``env_response``).
        hook_timeout_s: bound on each tool call and each ``setup``/``env_response``/``cleanup`` call (seconds).

    Raises:
        TypeError, ValueError: as :class:`Rubric` for a bad rubric; a tool whose schema cannot be built; a
            hook that is not callable; ``max_turns`` < 1; a ``workspace`` that is not a directory of regular
            files and directories.
    """

    dataset: Any
    rubric: Rubric | Callable[..., Any] | Sequence[Callable[..., Any]]
    system_prompt: str | None = None
    eval_dataset: Any = None
    columns: dict[str, str] = field(default_factory=dict)
    name: str | None = None
    tools: Sequence[Callable[..., Any]] = ()
    setup: Callable[..., Any] | None = None
    env_response: Callable[..., Any] | None = None
    cleanup: Callable[..., Any] | None = None
    max_turns: int | None = None
    hook_timeout_s: float = 10.0
    tool_parser: str = "hermes"
    workspace: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rubric, Rubric):
            self.rubric = Rubric(list(self.rubric) if isinstance(self.rubric, (list, tuple)) else [self.rubric])
        self.tools = list(self.tools)
        for t in self.tools:
            tool_schema(t)
        for hook in ("setup", "env_response", "cleanup"):
            if getattr(self, hook) is not None and not callable(getattr(self, hook)):
                raise TypeError(f"{hook} must be callable")
        if self.tool_parser not in PARSERS:
            raise ValueError(f"unknown tool_parser {self.tool_parser!r}; known: {sorted(PARSERS)}")
        if self.max_turns is None:
            self.max_turns = 4 if self.multi_turn else 1
        if self.max_turns < 1 or not math.isfinite(self.hook_timeout_s) or self.hook_timeout_s <= 0:
            raise ValueError(f"max_turns must be >= 1 and hook_timeout_s > 0 ({self.max_turns}, {self.hook_timeout_s})")
        if self.workspace is not None:
            self.workspace = os.path.abspath(self.workspace)
            pack_workspace(self.workspace)  # refused now, with the path, rather than at a rollout

    def packed_workspace(self) -> Workspace | None:
        """The workspace as the sandbox receives it (packed once per process), or ``None``."""
        return None if self.workspace is None else pack_workspace(str(self.workspace))

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts of this environment run its loop (it has tools or an ``env_response``)."""
        return bool(self.tools) or self.env_response is not None

    @property
    def runs_loop(self) -> bool:
        """Whether rollouts of this environment go through the rollout's environment loop: multi-turn, or with a
        ``setup``/``cleanup`` hook or a ``workspace`` (a single turn whose state or workspace the rewards read)."""
        return (self.multi_turn or self.setup is not None or self.cleanup is not None
                or self.workspace is not None)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(t) for t in self.tools]
