"""The rollout engine interface: ``torch`` (rollout_service/torch_engine.py) implements it in process,
``sglang`` (rollout_service/sglang_engine.py) over an SGLang server's HTTP API.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.schemas import Attestation, SamplingParams, VersionSpan, WeightUpdate


@dataclass
class GenerationRequest:
    """``n`` samples of one prompt (token ids) with ``sampling``."""

    prompt_ids: list[int]
    n: int
    sampling: SamplingParams


@dataclass
class Sample:
    """One generated completion.

    ``logprobs[i]`` is the behaviour log-probability (natural log) of ``completion_ids[i]`` under the
    distribution it was sampled from (temperature applied; the raw model distribution when greedy).
    """

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    versions: list[VersionSpan] = field(default_factory=list)
    error: str | None = None


class Engine(abc.ABC):
    """A generator of samples with a known policy version."""

    policy_version: int = 0
    max_context: int | None = None
    """Most tokens (prompt + new) one sequence may hold; longer requests are refused, not generated."""
    receives_in_server: bool = False
    """True when a weight broadcast goes straight into a server's weights (SGLang), through
    :meth:`receive_broadcast`, instead of into tensors this process loads with :meth:`load_weights_state`."""
    broadcast_width: int = 1
    """Ranks this engine takes in a broadcast session (an SGLang server: its tensor-parallel size)."""

    @abc.abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """Generate ``r.n`` samples per request; blocking (call it from a worker thread).

        Returns one list of samples per request, in request order.
        """

    def weight_shapes(self) -> dict:
        """Tensors shaped and typed like the weights a broadcast delivers (tied ones once); engines that
        cannot take a broadcast return ``{}`` and always load the checkpoint."""
        return {}

    def load_weights_state(self, state: dict, version: int) -> None:
        """Load broadcast weights ``state`` and set ``policy_version``; blocking. Raises ValueError."""
        raise NotImplementedError

    def receive_broadcast(self, update: WeightUpdate, rank_offset: int, world_size: int, plan: list[list[str]],
                          master_address: str, master_port: int, backend: str, timeout_s: float) -> bool:
        """Engines with ``receives_in_server``: have the server join session ``v<update.version>`` (ranks
        ``rank_offset ..``), receive the buckets of ``plan`` and switch to that version; blocking. Returns
        True when it took the version by broadcast, False when it already held it.

        Raises:
            RuntimeError: the session failed (the server may hold partly updated weights: the caller loads
                the version's checkpoint).
        """
        raise NotImplementedError

    @abc.abstractmethod
    def update_weights(self, update: WeightUpdate) -> None:
        """Load the weights of ``update`` and set ``policy_version`` to its version; blocking.

        Raises:
            FileNotFoundError, ValueError: the version cannot be loaded (missing, bad checksum).
        """

    def interrupt_with(self, update: WeightUpdate) -> bool:
        """Load ``update`` between two decode steps of the running generation (or before the next one) and
        continue with it; returns False when the engine cannot (it then loads between batches)."""
        return False

    def attestation(self, versions: list[int]) -> Attestation | None:
        """The engine's canary scores for ``versions`` (those it generated with; ``shared/canary.py``), to ride
        on the trajectories; ``None`` (the default) for an engine that does not score the canary."""
        return None

    def close(self) -> None:
        """Release resources (default: nothing)."""


class EngineGate:
    """The one way the service's coroutines call :meth:`Engine.generate`: in a worker thread, one engine call
    at a time, with the engine's busy time measured; calls made while the engine is busy are served together.

    Engines are not safe for concurrent ``generate`` calls from two threads; with the gate the plain path and
    every tool or environment loop of a batch share the engine, and one of them generates while the others wait
    on the sandbox or their tools. The requests of every call that arrives while an engine call runs (or in the
    same event-loop turn as the first) go to the engine as *one* call, each caller getting its own samples back:
    the turns of many multi-turn rollouts (each of one sample, at different times) decode as one batch instead of
    one after another. A batch's rollouts each wait on at most one call, so a merged call holds no more
    sequences than the batch has samples. ``busy_s`` is the total of seconds spent inside ``generate`` (waiting
    not counted), also reported to ``on_busy``.
    """

    def __init__(self, engine: Engine, on_busy: Callable[[float], None] | None = None) -> None:
        self.engine = engine
        self.on_busy = on_busy
        """Called with the seconds of every finished engine call (e.g. ``RolloutStats.add_busy``)."""
        self.busy_s = 0.0
        """Seconds the engine spent in ``generate`` through this gate (monotonic clock)."""
        self.calls = 0
        """Engine calls made (fewer than the callers' calls when some were served together)."""
        self._pending: list[tuple[list[GenerationRequest], asyncio.Future]] = []
        self._serving: asyncio.Task | None = None

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """``engine.generate(requests)`` in a worker thread, alone or together with the calls waiting beside it.

        Raises:
            whatever ``engine.generate`` raises (every call served with it gets the same error).
        """
        return (await self.generate_timed(requests))[0]

    async def generate_timed(self, requests: list[GenerationRequest]) -> tuple[list[list[Sample]], float]:
        """As :meth:`generate`, with the seconds of the engine call that served these requests.

        The engine call runs to its end even when the caller is cancelled meanwhile (a running generation cannot
        be stopped from here), so two generations never overlap.

        Raises:
            whatever ``engine.generate`` raises.
        """
        done = asyncio.get_running_loop().create_future()
        self._pending.append((list(requests), done))
        if self._serving is None or self._serving.done():
            self._serving = asyncio.ensure_future(self._serve())
        return await asyncio.shield(done)

    async def _serve(self) -> None:
        """Engine calls until nothing waits: each takes every request that waits when it starts."""
        while self._pending:
            await asyncio.sleep(0)  # the callers of this event-loop turn join the first call too
            calls, self._pending = self._pending, []
            merged = [r for reqs, _ in calls for r in reqs]
            t0 = time.perf_counter()
            try:
                samples = await asyncio.to_thread(self.engine.generate, merged)
                error = None
            except Exception as e:  # noqa: BLE001 - handed to every caller of this engine call
                samples, error = None, e
            held = time.perf_counter() - t0
            self.calls += 1
            self.busy_s += held
            if self.on_busy is not None:
                self.on_busy(held)
            at = 0
            for reqs, fut in calls:
                if fut.done():  # its caller was cancelled
                    at += len(reqs)
                    continue
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result((samples[at:at + len(reqs)], held))
                at += len(reqs)
