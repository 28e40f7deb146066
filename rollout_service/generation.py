"""Generation of one batch of rollout requests, plain and multi-turn, published through one emit path.

A request whose task names ``tools`` and allows ``max_turns > 1`` runs the tool loop
(rollout_service/tool_loop.py), one concurrent loop per request; the other requests are generated
together in one engine call, concurrently with the tool loops. Every engine call goes through the
one :class:`rollout_service.engine.EngineGate` (one generation at a time, the calls waiting for it served
together, busy time measured), so
while a tool group waits on the sandbox the engine generates the plain groups or another tool group's
turn instead of standing idle. Each group is published as soon as it is done, through
:func:`rollout_service.emit.publish`. A plain prompt that cannot fit the engine's context (prompt +
``max_new_tokens`` > ``engine.max_context``) is refused, not generated: its samples are ``error``
samples, which the verifier flags and the trainer never trains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer
from opentelemetry import trace

from rollout_service.batching import Batch, Headers
from rollout_service.emit import Completion, Group, RolloutStats, publish
from rollout_service.engine import Engine, EngineGate, GenerationRequest, Sample
from rollout_service.env_loop import encode_with_tools, run_env_loop
from rollout_service.tool_loop import Rollout, ToolRunner, run_tool_loop
from shared.envs import Environment, EnvironmentLoadError, cached_environment
from shared.model import encode_chat
from shared.schemas import RolloutRequest, VersionSpan
from shared.telemetry import extract_context

log = logging.getLogger("rollout")


def prompt_messages(req: RolloutRequest, system_prompt: str | None) -> list[dict[str, str]]:
    """The chat messages of ``req``'s prompt, with ``system_prompt`` first unless the task has its own."""
    msgs = [m.model_dump() for m in req.task.prompt]
    if system_prompt and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def uses_tools(r: RolloutRequest) -> bool:
    """Whether ``r`` runs the multi-turn tool loop: its task names tools and allows more than one turn."""
    return bool(r.task.tools) and r.task.max_turns > 1


def environment_loop(r: RolloutRequest) -> Environment | str | None:
    """The user environment whose loop ``r`` runs (its verifier is an environment with tools, an
    ``env_response``, a ``setup``/``cleanup`` hook or a workspace: :attr:`Environment.runs_loop`); the load
    error's text when that environment cannot be imported; None otherwise."""
    if r.task.verifier.kind != "environment":
        return None
    try:
        env = cached_environment(r.task.verifier.environment)
    except EnvironmentLoadError as e:
        return str(e)
    return env if env.runs_loop else None


@dataclass
class BatchGenerator:
    """What a batch needs, built once per service run: the engine and its tokenizer, the producer the
    trajectories go to, the one :class:`ToolRunner` (closed by the service at shutdown), the running
    stats, the ``model.system_prompt`` and the tool loop's ``rollout.max_trajectory_tokens`` budget.
    ``gate`` (made here) serialises every engine call and adds its seconds to ``stats.busy_s``."""

    engine: Engine
    tokenizer: Any
    producer: AIOKafkaProducer
    tools: ToolRunner
    stats: RolloutStats
    system_prompt: str | None = None
    max_trajectory_tokens: int = 1024
    gate: EngineGate = field(init=False)

    def __post_init__(self) -> None:
        self.gate = EngineGate(self.engine, on_busy=self.stats.add_busy)

    def encode(self, r: RolloutRequest) -> list[int]:
        """The prompt ids of ``r`` (chat template + generation prompt)."""
        return encode_chat(self.tokenizer, prompt_messages(r, self.system_prompt))

    async def run(self, batch: Batch) -> None:
        """Generate every request of ``batch`` and publish its trajectories (acks awaited), the tool
        groups and the plain ones concurrently; returns when every group is published.

        The tool and environment groups' first turns and the plain groups' call reach the engine gate in one
        event-loop turn and go to the engine together; while a group waits on the sandbox or its tools, the
        others' later turns decode.

        Raises:
            the first error of any group (aiokafka.errors.KafkaError: a trajectory was not acknowledged);
            the other groups are cancelled then, and nothing of the batch is committed.
        """
        pairs = list(zip(batch.requests, batch.headers))
        envs = [environment_loop(r) for r, _ in pairs]
        jobs = [self._env_group(r, h, env) for (r, h), env in zip(pairs, envs) if env is not None]
        jobs += [self._tool_group(r, h) for (r, h), env in zip(pairs, envs) if env is None and uses_tools(r)]
        plain = [(r, h) for (r, h), env in zip(pairs, envs) if env is None and not uses_tools(r)]
        if plain:
            jobs.append(self._plain([r for r, _ in plain], [h for _, h in plain]))
        tasks = [asyncio.ensure_future(j) for j in jobs]  # in this order: the gate's lock is first come first served
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _plain(self, reqs: list[RolloutRequest], headers: list[Headers]) -> None:
        """One engine call for every request whose prompt fits the context; error samples for the others."""
        engine = self.engine
        picked = time.time()
        prompts = [self.encode(r) for r in reqs]
        fits = [engine.max_context is None or len(p) + r.sampling.max_new_tokens <= engine.max_context
                for p, r in zip(prompts, reqs)]
        gens = [GenerationRequest(p, r.n, r.sampling) for p, r, ok in zip(prompts, reqs, fits) if ok]
        outs, gen_s = await self.gate.generate_timed(gens) if gens else ([], 0.0)  # gen_s: engine seconds
        generated = iter(outs)
        groups = []
        for r, h, p, ok in zip(reqs, headers, prompts, fits):
            samples = next(generated) if ok else self._refused(r, len(p))
            groups.append(Group(r, h, p, [Completion.from_sample(s) for s in samples],
                                {"queue": max(0.0, picked - r.issued_at), "generate": gen_s}))
        await publish(self.producer, self.tokenizer, groups, engine.policy_version, self.stats, engine.attestation)
        self.stats.generate_s += gen_s
        log.info("generated %d requests (%d samples) at policy version %d in %.2f s", len(reqs),
                 sum(r.n for r in reqs), engine.policy_version, gen_s)

    def _refused(self, r: RolloutRequest, prompt_tokens: int) -> list[Sample]:
        """``r.n`` empty ``error`` samples for a prompt of ``prompt_tokens`` that cannot fit the context."""
        msg = (f"prompt of {prompt_tokens} tokens + {r.sampling.max_new_tokens} new exceeds the context "
               f"({self.engine.max_context})")
        log.warning("group %s: %s", r.group_id, msg)
        if self.stats.sink is not None:
            self.stats.sink.requests_dropped.labels("context_overflow").inc()
        return [Sample([], [], "error", [VersionSpan(version=self.engine.policy_version, start=0, end=0)], msg)
                for _ in range(r.n)]

    async def _tool_group(self, r: RolloutRequest, headers: Headers) -> None:
        """The multi-turn loop for one request (``r.n`` trajectories), then its trajectories.

        The loop runs in a ``tool_loop`` span (a child of the request's trace context, attribute
        ``group_id``), so the sandbox's spans for its tool calls join the group's trace."""
        picked, t0 = time.time(), time.perf_counter()
        prompt = self.encode(r)
        with trace.get_tracer("rollout").start_as_current_span(
                "tool_loop", context=extract_context(headers), attributes={"group_id": r.group_id, "n": r.n}):
            rollouts = await run_tool_loop(self.gate, self.tokenizer, self.tools, r.task, prompt, r.n, r.sampling,
                                           self.max_trajectory_tokens)
        timings = {"queue": max(0.0, picked - r.issued_at), "generate": time.perf_counter() - t0}
        version = self.engine.policy_version
        group = Group(r, headers, prompt, [Completion.from_rollout(ro, version) for ro in rollouts], timings)
        await publish(self.producer, self.tokenizer, [group], version, self.stats, self.engine.attestation)
        self.stats.generate_s += time.perf_counter() - t0
        log.info("group %s: %d samples, %d tool rounds, %d tokens generated", r.group_id, r.n,
                 sum(ro.tool_rounds for ro in rollouts), sum(ro.generated_tokens for ro in rollouts))

    async def _env_group(self, r: RolloutRequest, headers: Headers, env: Environment | str) -> None:
        """A user environment's loop for one request (:mod:`rollout_service.env_loop`), then its trajectories; an
        environment that cannot be imported (``env`` is the error's text) gives ``error`` samples."""
        picked, t0 = time.time(), time.perf_counter()
        version = self.engine.policy_version
        if isinstance(env, str):
            prompt = self.encode(r)
            log.warning("group %s: %s", r.group_id, env)
            completions = [Completion.from_rollout(Rollout(), version, error=env) for _ in range(r.n)]
        else:
            prompt = encode_with_tools(self.tokenizer, prompt_messages(r, self.system_prompt), env.tool_schemas(),
                                       env.tool_parser)
            with trace.get_tracer("rollout").start_as_current_span(
                    "env_loop", context=extract_context(headers), attributes={"group_id": r.group_id, "n": r.n}):
                runs = await run_env_loop(self.gate, self.tokenizer, env, r.task, prompt, r.n, r.sampling,
                                          self.max_trajectory_tokens, self.tools.http)
            version = self.engine.policy_version
            completions = [Completion.from_rollout(ro.rollout, version, ro.state_record(), ro.error) for ro in runs]
        timings = {"queue": max(0.0, picked - r.issued_at), "generate": time.perf_counter() - t0}
        group = Group(r, headers, prompt, completions, timings)
        await publish(self.producer, self.tokenizer, [group], version, self.stats, self.engine.attestation)
        self.stats.generate_s += time.perf_counter() - t0
        log.info("group %s: %d environment rollouts, %d observations, %d tokens generated", r.group_id, r.n,
                 sum(c.tool_rounds for c in completions), sum(c.generated_tokens for c in completions))
