"""Rollout service: turn rollout requests into trajectories with the newest policy available.

A replica serves one rollout pool (``rollout.pool``): it consumes only the pool's request topic,
``shared.topics.rollout_requests(pool)``, in consumer group ``rollout`` (the default pool) or
``rollout-<pool>``, so replicas of one pool share its requests and never take another pool's.

Loop: take a batch of at most ``max_batch_requests`` requests / ``max_batch_samples`` samples
(rollout_service/batching.py; the rest stay in Kafka for other replicas) → apply the newest announced
weight version (between batches only; rollout_service/weights.py) → wait until the engine's version
reaches every request's ``min_policy_version`` → generate in a worker thread, plain and through the tool
loop concurrently, one engine call at a time (rollout_service/generation.py) → produce one Trajectory
per sample and await the acks (rollout_service/emit.py) → commit. Every 10 s (once a sample was
produced) the running ``rollout/*`` (engine utilisation included: ``rollout/busy_s``, ``wall_s``,
``idle_fraction``) and ``weights/broadcast_*`` metrics go to flywheel.metrics. Prometheus metrics
(:mod:`rollout_service.metrics`) are served on ``telemetry.metrics_port`` when it is set.

Weight versions are read from flywheel.weights without a consumer group (every replica sees
every version, from the earliest offset), and at start-up from the checkpoint store's newest
manifest, so a replica that joins late or lost the broker still catches up.

This module builds the engine (:func:`build_engine`) and runs the loop (:func:`run`); the Kafka
clients, the engine, the weight intake's tasks and the tool loop's one sandbox client live for one
run and are closed when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from rollout_service.batching import Batch, take_batch
from rollout_service.config import RolloutSettings
from rollout_service.emit import RolloutStats
from rollout_service.engine import Engine
from rollout_service.generation import BatchGenerator
from rollout_service.metrics import RolloutMetrics
from rollout_service.tool_loop import ToolRunner
from rollout_service.weights import WeightIntake
from shared import kafka, topics
from shared.config import KafkaConfig
from shared.metrics import serve_metrics
from shared.model import load_model, load_tokenizer, resolve_model_dir
from shared.precision import choose
from shared.schemas import Metrics
from shared.telemetry import flush_tracing
from shared.threads import CoreBurst
from shared.threads import attach as attach_burst

log = logging.getLogger("rollout")

METRICS_EVERY_S = 10.0
"""Seconds between two metrics records."""


def build_engine(config: RolloutSettings):
    """The configured engine (``torch`` in process, ``sglang`` at ``rollout.sglang_url``, waited for until
    ready, or ``null``: no model, with a :class:`rollout_service.null_engine.NullTokenizer`) and the tokenizer,
    as ``(engine, tokenizer)``; blocking (model load, server wait).

    Raises:
        TimeoutError: the SGLang server is not ready within 10 minutes.
    """
    cfg = config.rollout
    if cfg.engine == "null":  # no model, no model directory: a benchmark engine (rollout_service/null_engine.py)
        from rollout_service.null_engine import NullEngine, NullTokenizer

        log.warning("rollout.engine: null: no model; completions of random ids at %s tokens/s per %s (a benchmark)",
                    cfg.null_tokens_per_s or "unbounded", cfg.null_rate_per)
        return NullEngine(cfg.null_vocab, cfg.null_tokens_per_s, cfg.null_rate_per, cfg.null_completion,
                          cfg.seed), NullTokenizer(cfg.null_vocab)
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
    dtype = choose("rollout.dtype", cfg.dtype, logger=log).dtype  # once per process, logged with its reason
    if cfg.quantization != "none":
        log.warning("rollout.quantization = %s: generation with int8 linear layers from a float32 master copy "
                    "(rollout.dtype %s ignored), log-probs far from the trainer's (rollout_service/quantize.py)",
                    cfg.quantization, dtype)
        dtype = "float32"  # torch.ao's dynamic int8 layers take float32 activations
    engine = TorchEngine(load_model(model_dir, dtype, cfg.attention), tok, seed=cfg.seed,
                         quantization=cfg.quantization)
    attach_burst(engine.model, CoreBurst(cfg.torch_threads, cfg.burst_threads))
    return engine, tok


def request_group(pool: str) -> str:
    """The consumer group of rollout ``pool``'s replicas: ``rollout`` for the default pool, else
    ``rollout-<pool>``."""
    return "rollout" if pool == topics.DEFAULT_POOL else f"rollout-{pool}"


def service_topics(pool: str) -> list[str]:
    """The topics a replica of ``pool`` makes sure exist at start: every shared topic and the pool's
    request topic."""
    return list(dict.fromkeys([*topics.ALL, topics.rollout_requests(pool)]))


@dataclass
class KafkaClients:
    """The service's producer, its group consumer of its pool's request topic (group
    :func:`request_group`, manual commits) and its group-less consumer of flywheel.weights."""

    producer: AIOKafkaProducer
    requests: AIOKafkaConsumer
    weights: AIOKafkaConsumer

    @classmethod
    def make(cls, cfg: KafkaConfig, pool: str = topics.DEFAULT_POOL) -> KafkaClients:
        """The three clients of a replica of rollout ``pool``, not started."""
        return cls(kafka.make_producer(cfg, "rollout"),
                   kafka.make_consumer(cfg, topics.rollout_requests(pool), group_id=request_group(pool),
                                       client_id="rollout"),
                   kafka.make_consumer(cfg, topics.WEIGHTS, group_id=None, client_id="rollout-weights"))

    async def start(self) -> None:
        for c in (self.producer, self.requests, self.weights):
            await c.start()

    async def stop(self) -> None:
        """Stop each client (10 s at most each); errors are logged, never raised
        (:func:`shared.kafka.stop_clients`)."""
        await kafka.stop_clients(self.requests, self.weights, self.producer, timeout_s=10)


async def _send_metrics(producer: AIOKafkaProducer, stats: RolloutStats, engine: Engine,
                        intake: WeightIntake) -> None:
    """One Metrics record (source ``rollout``): the running stats and the broadcast counters."""
    vals = dict(stats.metrics(engine.policy_version), **intake.stats)
    await kafka.send(producer, topics.METRICS, Metrics(source="rollout", values=vals), "rollout")


async def run(config: RolloutSettings, stop: asyncio.Event | None = None) -> None:
    """Run the rollout service until ``stop`` is set (SIGTERM/SIGINT set it when ``stop`` is None).

    Requests of a batch interrupted by ``stop`` are not committed: another replica (or this one after a
    restart) takes them.

    A broker outage never ends the service: a :class:`shared.kafka.BrokerWatch` notices the broker go
    away, the batch in progress is not committed (its requests were lost with an empty broker; the
    scheduler re-issues them), and once the broker answers the Kafka clients are rebuilt (topics
    re-created, the group re-joined, flywheel.weights read again from its start, the checkpoint store
    re-read for the newest version) while the engine keeps its weights. A request whose trajectory cannot
    be produced is dead-lettered (:func:`_dead_letter_unproducible`) and committed past.
    """
    stop, _ = kafka.prepare_service("rollout", config, stop)
    cfg = config.rollout
    engine, tok = await asyncio.to_thread(build_engine, config)
    intake = WeightIntake(config, engine)
    prom = RolloutMetrics()
    prom.watch_engine(lambda: engine.policy_version)
    intake.on_load = prom.weight_load_seconds.observe
    stats = RolloutStats(sink=prom)
    tools = ToolRunner(cfg.sandbox_url, cfg.tool_timeout_s)
    watch = kafka.BrokerWatch(config.kafka, "rollout")
    metrics_server = serve_metrics(config.telemetry, prom.registry)
    started = False
    try:
        attempt = 0
        while not stop.is_set():
            if not await watch.wait_up(stop):
                break
            clients = None
            try:
                epoch = watch.epoch
                await kafka.ensure_topics(config.kafka, service_topics(cfg.pool))
                clients = KafkaClients.make(config.kafka, cfg.pool)
                await clients.start()
                if not started:
                    intake.start(clients.weights, stop)
                    stats.start()
                    started = True
                else:
                    intake.follow(clients.weights, stop)
                gen = BatchGenerator(engine, tok, clients.producer, tools, stats, config.model.system_prompt,
                                     cfg.max_trajectory_tokens)
                log.info("%s rollout pool %r (%s, group %s)", "resumed" if epoch else "serving", cfg.pool,
                         topics.rollout_requests(cfg.pool), request_group(cfg.pool))
                attempt = 0
                await _serve(config, watch, epoch, clients, intake, gen, stats, prom, engine, stop)
            except (kafka.BrokerLost, *kafka.BROKER_ERRORS) as e:
                log.warning("broker unreachable, retrying (%r); the batch in progress is not committed", e)
                await kafka.reconnect_pause(config.kafka, attempt, stop)
                attempt += 1
            finally:
                await intake.stop_following()
                if clients is not None:
                    await clients.stop()
    finally:
        stop.set()
        flush_tracing()
        if metrics_server is not None:
            metrics_server.close()
        await watch.close()
        await intake.close()
        await tools.close()
        engine.close()


async def _serve(config: RolloutSettings, watch: kafka.BrokerWatch, epoch: int, clients: KafkaClients,
                 intake: WeightIntake, gen: BatchGenerator, stats: RolloutStats, prom: RolloutMetrics,
                 engine: Engine, stop: asyncio.Event) -> None:
    """The rollout loop on one set of Kafka clients, until ``stop``.

    Raises:
        shared.kafka.BrokerLost: the broker went away (checked before each batch and before each commit).
        aiokafka.errors.KafkaError: a broker error (:data:`shared.kafka.BROKER_ERRORS`).
    """
    cfg = config.rollout
    last_metrics = time.monotonic()
    while not stop.is_set():
        watch.check(epoch)
        batch = await take_batch(clients.requests, clients.producer, cfg.max_batch_requests, cfg.max_batch_samples)
        if dead := sum(map(len, batch.records.values())) - len(batch.requests):  # dead-lettered by take_batch
            prom.dlq.labels(topics.rollout_requests(cfg.pool)).inc(dead)
            prom.requests_dropped.labels("malformed").inc(dead)
        await intake.apply_newest()
        if batch.requests:
            await intake.wait_for(batch.min_policy_version, stop)
            if stop.is_set():
                prom.requests_dropped.labels("interrupted").inc(len(batch.requests))
                break  # uncommitted
            if (lag := intake.first_generation_lag()) is not None:  # announced → first token with it
                stats.publish_to_first_token_s = lag
            t0 = time.perf_counter()
            stats.unproducible.clear()
            await gen.run(batch)
            prom.batch_seconds.observe(time.perf_counter() - t0)
            await _dead_letter_unproducible(clients.producer, batch, stats, prom, cfg.pool)
        watch.check(epoch)  # never commit offsets of a broker that went away meanwhile
        await watch.guard(kafka.commit_batch(clients.requests, batch.records), epoch)
        if time.monotonic() - last_metrics > METRICS_EVERY_S and stats.samples:
            await _send_metrics(clients.producer, stats, engine, intake)
            last_metrics = time.monotonic()


async def _dead_letter_unproducible(producer: AIOKafkaProducer, batch: Batch, stats: RolloutStats,
                                    prom: RolloutMetrics, pool: str) -> None:
    """Dead-letter the request record of every request in ``stats.unproducible`` (one of its trajectories
    could not be produced; :func:`rollout_service.emit.publish` sent error stand-ins instead) with the
    reason, and count it (``flywheel_rollout_dlq_records_total``, requests dropped ``unproducible``); the
    batch is then committed as usual.

    Raises:
        aiokafka.errors.KafkaError: a dead letter was not acknowledged (nothing is committed).
    """
    for request, reason in stats.unproducible:
        msg = next((m for part in batch.records.values() for m in part
                    if m.key == request.group_id.encode() and request.group_id.encode() in (m.value or b"")), None)
        if msg is None:  # not keyed by group id: the first record whose value names the group
            msg = next((m for part in batch.records.values() for m in part
                        if request.group_id.encode() in (m.value or b"")), None)
        if msg is None:
            log.error("group %s: no source record found to dead-letter (%s)", request.group_id, reason)
            continue
        await kafka.dead_letter(producer, msg, "rollout", reason)
        prom.dlq.labels(topics.rollout_requests(pool)).inc()
        prom.requests_dropped.labels("unproducible").inc()
    stats.unproducible.clear()
