"""Rollout service: turn rollout requests into trajectories with the newest policy available.

Loop: ``getmany`` at most ``max_batch_requests`` requests (the rest stay in Kafka for other
replicas) → apply the newest announced weight version (between batches only) → wait until the
engine's version reaches every request's ``min_policy_version`` → generate in a worker thread →
produce one Trajectory per sample and await the acks → commit.

Weight versions are read from flywheel.weights without a consumer group (every replica sees
every version, from the earliest offset), and at start-up from the checkpoint store's newest
manifest, so a replica that joins late or lost the broker still catches up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path

import httpx
import torch
from opentelemetry import trace

from rollout_service.engine import Engine, GenerationRequest, Sample
from shared import kafka, topics
from shared.checkpoint import CheckpointStore
from rollout_service.config import RolloutSettings
from shared.model import encode_chat, load_model, load_tokenizer, resolve_model_dir
from shared.schemas import DecodeError, Metrics, RolloutRequest, Trajectory, VersionSpan, WeightUpdate, decode
from shared.telemetry import extract_context

log = logging.getLogger("rollout")


def build_engine(config: RolloutSettings):
    """The configured engine (``torch`` in process, or ``sglang`` at ``rollout.sglang_url``, waited for
    until ready) and the tokenizer.

    Raises:
        TimeoutError: the SGLang server is not ready within 10 minutes.
    """
    cfg = config.rollout
    model_dir = resolve_model_dir(config.model.name, config.model.cache_dir)
    tok = load_tokenizer(model_dir)  # prompts are encoded here either way: token in, token out
    if cfg.engine == "sglang":
        from rollout_service.sglang_engine import SGLangEngine

        engine = SGLangEngine(cfg.sglang_url, pause_mode=cfg.sglang_pause_mode)
        info = engine.wait_ready()
        log.info("SGLang at %s ready: %s", cfg.sglang_url, info)
        return engine, tok
    from rollout_service.torch_engine import TorchEngine

    torch.set_num_threads(cfg.torch_threads)
    return TorchEngine(load_model(model_dir, cfg.dtype), tok, seed=cfg.seed), tok


class WeightWatcher:
    """Every announced WeightUpdate by version, from flywheel.weights and the checkpoint store.

    A version that cannot be loaded (missing file, bad checksum, a path outside the checkpoint
    store) is marked bad and skipped, so one bad record never blocks the newer good ones.
    """

    def __init__(self, store_root: Path | None = None) -> None:
        self.updates: dict[int, WeightUpdate] = {}
        self.bad: set[int] = set()
        self.store_root = store_root.resolve() if store_root else None
        self.changed = asyncio.Event()

    @property
    def newest(self) -> WeightUpdate | None:
        """The highest version not marked bad."""
        good = [v for v in self.updates if v not in self.bad]
        return self.updates[max(good)] if good else None

    def offer(self, update: WeightUpdate | None) -> None:
        if update is None or update.version in self.updates:
            return
        if self.store_root is not None and (
            update.path is None or not Path(update.path).resolve().is_relative_to(self.store_root)
        ):
            log.error("ignoring weight version %d: path %s is outside the checkpoint store %s", update.version,
                      update.path, self.store_root)
            return
        self.updates[update.version] = update
        self.changed.set()

    async def follow(self, consumer, stop: asyncio.Event) -> None:
        """Read every weight record (no group, all partitions, from earliest) until ``stop``."""
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=200)
            for msgs in batch.values():
                for msg in msgs:
                    try:
                        self.offer(decode(msg.value, WeightUpdate))
                    except DecodeError as e:
                        log.warning("ignoring malformed weight record at offset %d: %s", msg.offset, e.reason)


class BroadcastFollower:
    """Transport ``distributed``: registers with the trainer's store and joins each version's broadcast
    session as soon as the version is announced (while the engine keeps generating). A torch engine's
    weights are staged for :func:`apply_newest` to load between batches (or between decode steps); an
    SGLang server receives them into its own weights at once (paused in ``rollout.sglang_pause_mode``, so
    requests in flight continue under the new version, their spans tagged). A failed session leaves the
    version to the checkpoint file."""

    def __init__(self, config: RolloutSettings, engine: Engine, watcher: WeightWatcher) -> None:
        self.wc = config.weights
        self.engine, self.watcher = engine, watcher
        self.id = f"rollout-{socket.gethostname()}-{os.getpid()}"
        self.staged: tuple[int, dict] | None = None
        self.receiving: int | None = None
        self.received = asyncio.Event()
        self.stats = {"weights/broadcast_received": 0.0, "weights/broadcast_failed": 0.0}
        self._seen: set[int] = set()
        self.registered = False

    def member(self, update: WeightUpdate) -> bool:
        """Whether this engine is in ``update``'s broadcast session."""
        return self.registered and update.transport == "distributed" and self.id in update.receivers

    async def run(self, stop: asyncio.Event) -> None:
        """Register (retrying until the trainer's store is up), then receive each announced session
        this engine belongs to, until ``stop``."""
        from shared.weight_sync import WeightReceiver

        receiver = None
        while receiver is None and not stop.is_set():
            try:  # the trainer may start after us
                receiver = await asyncio.to_thread(WeightReceiver, self.wc.broadcast_host, self.wc.broadcast_port,
                                                   self.id, self.wc.broadcast_timeout_s, self.wc.broadcast_backend,
                                                   width=self.engine.broadcast_width)
            except (RuntimeError, OSError) as e:
                log.info("weight broadcast store not reachable yet (%s); retrying", e)
                await asyncio.sleep(1.0)
        if receiver is None:
            return
        in_server = self.engine.receives_in_server
        like = {} if in_server else await asyncio.to_thread(self.engine.weight_shapes)
        self.registered = True
        log.info("registered for weight broadcasts as %s", self.id)
        try:
            while not stop.is_set():
                todo = sorted(v for v, u in self.watcher.updates.items()
                              if v not in self._seen and self.member(u) and v > self.engine.policy_version)
                if not todo:
                    await asyncio.sleep(0.02)
                    continue
                v = todo[-1]  # the newest; older sessions fail for want of us and fall back, harmlessly
                self.receiving = v
                self._seen.update(todo)
                t0 = time.perf_counter()
                try:
                    took = True
                    if in_server:
                        rank, world = await asyncio.to_thread(receiver.session, v)
                        plan = await asyncio.to_thread(receiver.plan, v)
                        took = await asyncio.to_thread(self.engine.receive_broadcast, self.watcher.updates[v], rank,
                                                       world, plan, self.wc.broadcast_host, self.wc.broadcast_port,
                                                       self.wc.broadcast_backend, self.wc.broadcast_timeout_s)
                    else:
                        self.staged = (v, await asyncio.to_thread(receiver.receive, v, like))
                    if took:
                        self.stats["weights/broadcast_received"] += 1
                        log.info("received policy version %d by broadcast in %.2f s", v, time.perf_counter() - t0)
                    else:
                        log.info("policy version %d was already loaded from its checkpoint", v)
                except (RuntimeError, ValueError, OSError, httpx.HTTPError) as e:
                    self.stats["weights/broadcast_failed"] += 1
                    log.warning("broadcast of policy version %d failed (%s); loading it from the checkpoint", v, e)
                except Exception as e:  # noqa: BLE001 - the follower must outlive any one session
                    self.stats["weights/broadcast_failed"] += 1
                    log.exception("broadcast of policy version %d failed unexpectedly (%s); loading it from the "
                                  "checkpoint", v, e)
                finally:
                    self.receiving = None
                    self.received.set()
        finally:
            self.registered = False
            receiver.close()

    async def take(self, update: WeightUpdate) -> dict | None:
        """The staged broadcast weights of ``update`` once its session is over (waiting for it, at most the
        broadcast timeout); None when there are none: this engine is not in the session, the session
        failed, or the server received them in place (its ``policy_version`` then says so)."""
        v = update.version
        deadline = time.monotonic() + self.wc.broadcast_timeout_s + 5
        while self.member(update) and (v not in self._seen or self.receiving == v) and time.monotonic() < deadline:
            self.received.clear()
            try:
                await asyncio.wait_for(self.received.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        if self.staged is not None and self.staged[0] == v:
            state, self.staged = self.staged[1], None
            return state
        return None


async def apply_newest(engine: Engine, watcher: WeightWatcher, follower: BroadcastFollower | None = None) -> None:
    """Load the newest good version if it is newer than the engine's (in a worker thread): from its
    broadcast when this engine received it, else from its checkpoint file."""
    while (upd := watcher.newest) is not None and upd.version > engine.policy_version:
        t0 = time.perf_counter()
        try:
            state = await follower.take(upd) if follower is not None else None
            if engine.policy_version >= upd.version:
                return  # the server received it in place
            if state is not None:
                await asyncio.to_thread(engine.load_weights_state, state, upd.version)
                how = "broadcast"
            else:
                await asyncio.to_thread(engine.update_weights, upd)
                how = "checkpoint"
            log.info("loaded policy version %d (%s) in %.2f s", upd.version, how, time.perf_counter() - t0)
            return
        except (OSError, ValueError, RuntimeError, httpx.HTTPError) as e:
            log.error("cannot load policy version %d, skipping it: %s", upd.version, e)
            watcher.bad.add(upd.version)


def make_trajectory(req: RolloutRequest, i: int, prompt_ids: list[int], ids: list[int], logprobs: list[float],
                    mask: list[int], finish_reason: str, versions: list[VersionSpan], tokenizer, timings: dict,
                    error: str | None = None, turns: list | None = None, cost: dict | None = None) -> Trajectory:
    """Sample ``i`` of ``req`` as a Trajectory (``cost`` defaults to its generated tokens, no tools)."""
    return Trajectory(
        trajectory_id=f"{req.group_id}:{req.attempt}:{i}", group_id=req.group_id, sample_index=i,
        group_size=req.n, task=req.task, purpose=req.purpose, attempt=req.attempt, eval_round=req.eval_round,
        prompt_ids=prompt_ids, completion_ids=ids, completion_logprobs=logprobs, loss_mask=mask,
        completion_text=tokenizer.decode(ids, skip_special_tokens=True), finish_reason=finish_reason, error=error,
        policy_versions=versions, temperature=req.sampling.temperature, timings=timings, turns=turns or [],
        cost=cost or {"generated_tokens": float(len(ids)), "tool_rounds": 0.0, "tool_seconds": 0.0},
    )


def to_trajectories(req: RolloutRequest, prompt_ids: list[int], samples, tokenizer, timings) -> list[Trajectory]:
    """One Trajectory per sample of ``req``."""
    return [make_trajectory(req, i, prompt_ids, s.completion_ids, s.logprobs, [1] * len(s.completion_ids),
                            s.finish_reason, s.versions, tokenizer, timings, error=s.error)
            for i, s in enumerate(samples)]


def prompt_messages(req: RolloutRequest, system_prompt: str | None) -> list[dict[str, str]]:
    msgs = [m.model_dump() for m in req.task.prompt]
    if system_prompt and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


async def run(config: RolloutSettings, stop: asyncio.Event | None = None) -> None:
    """Run the rollout service until ``stop`` is set (SIGTERM/SIGINT set it when ``stop`` is None)."""
    stop, _ = kafka.prepare_service("rollout", config, stop)
    cfg = config.rollout
    engine, tok = await asyncio.to_thread(build_engine, config)
    store_root = config.run.path(config.run.checkpoint_dir)
    watcher = WeightWatcher(store_root)
    watcher.offer(CheckpointStore(store_root).newest_published())
    await kafka.ensure_topics(config.kafka)
    producer = kafka.make_producer(config.kafka, "rollout")
    requests = kafka.make_consumer(config.kafka, topics.ROLLOUT_REQUESTS, group_id="rollout", client_id="rollout")
    weights = kafka.make_consumer(config.kafka, topics.WEIGHTS, group_id=None, client_id="rollout-weights")
    await producer.start()
    await requests.start()
    await weights.start()
    follower = asyncio.create_task(watcher.follow(weights, stop))
    bfollow = BroadcastFollower(config, engine, watcher) if config.weights.transport == "distributed" else None
    bcast = asyncio.create_task(bfollow.run(stop)) if bfollow is not None else None
    if engine.receives_in_server and bfollow is not None and cfg.weight_update_policy == "finish":
        log.warning("rollout.weight_update_policy=finish: an SGLang server takes a broadcast version as it "
                    "arrives (paused in rollout.sglang_pause_mode: requests in flight continue under it, their "
                    "spans tagged)")
    interrupter = (asyncio.create_task(_interrupt_on_new_weights(engine, watcher, stop, bfollow))
                   if cfg.weight_update_policy == "interrupt" else None)
    stats = {"rollout/samples": 0.0, "rollout/tokens": 0.0, "rollout/generate_s": 0.0, "rollout/tool_rounds": 0.0,
             "rollout/tool_seconds": 0.0}
    first_token_version = engine.policy_version
    last_metrics = time.monotonic()
    try:
        while not stop.is_set():
            batch, reqs, headers = await _take_requests(requests, producer, cfg.max_batch_requests, cfg.max_batch_samples)
            await apply_newest(engine, watcher, bfollow)
            if reqs:
                await _wait_for_version(engine, watcher, max(r.min_policy_version for r in reqs), stop, cfg.weight_poll_s,
                                        bfollow)
                if stop.is_set():
                    break  # uncommitted: another replica (or this one after restart) takes them
                if engine.policy_version != first_token_version and engine.policy_version in watcher.updates:
                    # announced → first token generated with it (the batch starts now)
                    lag = time.time() - watcher.updates[engine.policy_version].created_at
                    stats["rollout/publish_to_first_token_s"] = lag
                    log.info("policy version %d: %.3f s from its announcement to its first generation",
                             engine.policy_version, lag)
                    first_token_version = engine.policy_version
                await _generate_and_send(config, engine, tok, reqs, headers, producer, stats)
            await kafka.commit_batch(requests, batch)
            if time.monotonic() - last_metrics > 10 and stats["rollout/samples"]:
                n = stats["rollout/samples"]
                vals = dict(stats, **{"rollout/tokens_per_s": stats["rollout/tokens"] / max(stats["rollout/generate_s"], 1e-9),
                                      "rollout/policy_version": float(engine.policy_version),
                                      # running cost per sample: the inference line of a training budget
                                      "rollout/tokens_per_sample": stats["rollout/tokens"] / n,
                                      "rollout/tool_rounds_per_sample": stats["rollout/tool_rounds"] / n,
                                      "rollout/tool_seconds_per_sample": stats["rollout/tool_seconds"] / n},
                            **(bfollow.stats if bfollow is not None else {}))
                await kafka.send(producer, topics.METRICS, Metrics(source="rollout", values=vals), "rollout")
                last_metrics = time.monotonic()
    except asyncio.CancelledError:
        raise
    finally:
        stop.set()
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        for t in (bcast, interrupter):
            if t is not None:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        for c in (requests, weights, producer):
            try:
                await asyncio.wait_for(c.stop(), 10)
            except Exception:  # noqa: BLE001 - best effort
                log.exception("error closing %s", c)
        engine.close()


async def _interrupt_on_new_weights(engine: Engine, watcher: WeightWatcher, stop: asyncio.Event,
                                    follower: BroadcastFollower | None = None) -> None:
    """``weight_update_policy: interrupt``: hand every newer announced version to the engine at once, to
    be loaded between two decode steps of the running batch (the loop's :func:`apply_newest` still loads
    it between batches if the engine cannot). A version an SGLang server receives by broadcast is left to
    the follower, which interrupts in the server."""
    asked = engine.policy_version
    while not stop.is_set():
        upd = watcher.newest
        if upd is not None and engine.receives_in_server and follower is not None and follower.member(upd):
            asked = max(asked, upd.version)
        if upd is not None and upd.version > max(asked, engine.policy_version):
            try:
                if await asyncio.to_thread(engine.interrupt_with, upd):
                    log.info("policy version %d: interrupting generation to load it", upd.version)
            except (OSError, ValueError, RuntimeError, httpx.HTTPError) as e:
                log.warning("policy version %d: could not interrupt generation for it (%s); it loads between "
                            "batches", upd.version, e)
            asked = upd.version
        await asyncio.sleep(0.05)  # polls: the loop's own waits own watcher.changed


async def _take_requests(consumer, producer, max_requests: int, max_samples: int):
    """Take requests one record at a time until ``max_samples`` samples or ``max_requests`` requests.

    Returns the raw records per partition (for the commit), the decoded requests and their record
    headers (trace context); malformed
    records are dead-lettered (and still committed).
    """
    taken: dict = {}
    reqs: list[RolloutRequest] = []
    headers: list = []
    samples = 0
    while samples < max_samples and len(reqs) < max_requests:
        if reqs:  # peek: would the next one fit?
            batch = await consumer.getmany(timeout_ms=0, max_records=1)
        else:
            batch = await consumer.getmany(timeout_ms=200, max_records=1)
        if not batch:
            break
        for tp, msgs in batch.items():
            for msg in msgs:
                r = await kafka.decode_or_dead_letter(producer, msg, RolloutRequest, "rollout")
                if r is not None and reqs and samples + r.n > max_samples:
                    consumer.seek(tp, msg.offset)  # does not fit: leave it for the next batch
                    return taken, reqs, headers
                taken.setdefault(tp, []).append(msg)
                if r is not None:
                    reqs.append(r)
                    headers.append(msg.headers)
                    samples += r.n
    return taken, reqs, headers


async def _wait_for_version(engine: Engine, watcher: WeightWatcher, version: int, stop: asyncio.Event,
                            poll_s: float, bfollow: BroadcastFollower | None = None) -> None:
    while engine.policy_version < version and not stop.is_set():
        log.info("waiting for policy version %d (have %d)", version, engine.policy_version)
        watcher.changed.clear()
        try:
            await asyncio.wait_for(watcher.changed.wait(), poll_s * 10)
        except asyncio.TimeoutError:
            pass
        await apply_newest(engine, watcher, bfollow)


def _uses_tools(r: RolloutRequest) -> bool:
    return bool(r.task.tools) and r.task.max_turns > 1


async def _generate_and_send(config, engine: Engine, tok, reqs: list[RolloutRequest], headers: list, producer,
                             stats) -> None:
    tool_reqs = [(r, h) for r, h in zip(reqs, headers) if _uses_tools(r)]
    plain = [(r, h) for r, h in zip(reqs, headers) if not _uses_tools(r)]
    if tool_reqs:
        await _tool_groups(config, engine, tok, tool_reqs, producer, stats)
    if not plain:
        return
    reqs, headers = [r for r, _ in plain], [h for _, h in plain]
    picked = time.time()
    prompts = [encode_chat(tok, prompt_messages(r, config.model.system_prompt)) for r in reqs]
    fits = [engine.max_context is None or len(p) + r.sampling.max_new_tokens <= engine.max_context
            for p, r in zip(prompts, reqs)]
    gens = [GenerationRequest(p, r.n, r.sampling) for p, r, ok in zip(prompts, reqs, fits) if ok]
    t0 = time.perf_counter()
    generated = iter(await asyncio.to_thread(engine.generate, gens) if gens else [])
    gen_s = time.perf_counter() - t0
    results = []
    for p, r, ok in zip(prompts, reqs, fits):
        if ok:
            results.append(next(generated))
        else:  # refused, not generated: the verifier flags it and the trainer never trains it
            msg = f"prompt of {len(p)} tokens + {r.sampling.max_new_tokens} new exceeds the context ({engine.max_context})"
            log.warning("group %s: %s", r.group_id, msg)
            results.append([Sample([], [], "error", [VersionSpan(version=engine.policy_version, start=0, end=0)], msg)
                            for _ in range(r.n)])
    futures = []
    tracer = trace.get_tracer("rollout")
    for r, h, p, samples in zip(reqs, headers, prompts, results):
        timings = {"queue": max(0.0, picked - r.issued_at), "generate": gen_s}
        with tracer.start_as_current_span("rollout", context=extract_context(h),
                                          attributes={"group_id": r.group_id, "n": r.n,
                                                      "policy_version": engine.policy_version}):
            for tr in to_trajectories(r, p, samples, tok, timings):
                futures.append(await kafka.send(producer, topics.TRAJECTORIES, tr, r.group_id))
                stats["rollout/tokens"] += len(tr.completion_ids)
                stats["rollout/samples"] += 1
    await asyncio.gather(*futures)
    stats["rollout/generate_s"] += gen_s
    log.info("generated %d requests (%d samples) at policy version %d in %.2f s", len(reqs),
             sum(r.n for r in reqs), engine.policy_version, gen_s)


async def _tool_groups(config, engine: Engine, tok, items: list, producer, stats) -> None:
    """Groups whose task allows tools: the multi-turn loop per group (groups run concurrently, so one's
    tool calls overlap another's generation), then one Trajectory per sample."""
    from rollout_service.tool_loop import ToolRunner, run_tool_loop

    cfg = config.rollout
    runner = ToolRunner(cfg.sandbox_url, cfg.tool_timeout_s)
    try:
        async def one(r: RolloutRequest, h) -> None:
            picked, t0 = time.time(), time.perf_counter()
            prompt = encode_chat(tok, prompt_messages(r, config.model.system_prompt))
            rollouts = await run_tool_loop(engine, tok, runner, r.task, prompt, r.n, r.sampling,
                                           cfg.max_trajectory_tokens)
            timings = {"queue": max(0.0, picked - r.issued_at), "generate": time.perf_counter() - t0}
            futures = []
            with trace.get_tracer("rollout").start_as_current_span(
                    "rollout", context=extract_context(h),
                    attributes={"group_id": r.group_id, "n": r.n, "policy_version": engine.policy_version}):
                for i, ro in enumerate(rollouts):
                    tr = make_trajectory(
                        r, i, prompt, ro.ids, ro.logprobs, ro.mask, ro.finish_reason,
                        ro.versions or [VersionSpan(version=engine.policy_version, start=0, end=0)], tok, timings,
                        turns=ro.turns, cost={"generated_tokens": float(ro.generated_tokens),
                                              "tool_rounds": float(ro.tool_rounds), "tool_seconds": ro.tool_seconds})
                    futures.append(await kafka.send(producer, topics.TRAJECTORIES, tr, r.group_id))
                    stats["rollout/tokens"] += ro.generated_tokens
                    stats["rollout/samples"] += 1
                    stats["rollout/tool_rounds"] += ro.tool_rounds
                    stats["rollout/tool_seconds"] += ro.tool_seconds
            await asyncio.gather(*futures)
            stats["rollout/generate_s"] += time.perf_counter() - t0
            log.info("group %s: %d samples, %d tool rounds, %d tokens generated", r.group_id, r.n,
                     sum(ro.tool_rounds for ro in rollouts), sum(ro.generated_tokens for ro in rollouts))

        await asyncio.gather(*(one(r, h) for r, h in items))
    finally:
        await runner.close()
