"""The trainer obeys flywheel.control: blocked domains' groups are dropped, ``pause_training`` stops steps."""

import asyncio

import orjson
import pytest

from flywheel.broker import EmbeddedBroker
from flywheel.config import load_config
from shared import kafka, topics
from shared.checkpoint import CheckpointStore
from shared.model import build_tiny_model
from shared.schemas import Control, DeadLetter, GroupDropped, Metrics, Reward, ScoredTrajectory, Task, Trajectory, \
    WeightUpdate
from trainer_service.control import ControlState
from trainer_service.groups import GroupBuffer
from trainer_service.main import run

SETTLE_S = 1.5
"""How long a control record sent to a running trainer is given to be fetched before the records it must
govern are sent (two topics have no common order; the trainer's fetch long-poll is 20 ms)."""


def _task(domain):
    return Task(task_id=f"t-{domain}", domain=domain, prompt=[{"role": "user", "content": "q"}],
                verifier={"kind": "regex", "pattern": "^a"})


def _scored(gid, i, reward, domain="y", size=2, version=0):
    tr = Trajectory(trajectory_id=f"{gid}:1:{i}", group_id=gid, sample_index=i, group_size=size, task=_task(domain),
                    prompt_ids=[5, 6], completion_ids=[7, 8], completion_logprobs=[-4.0, -4.0], loss_mask=[1, 1],
                    completion_text="xy", finish_reason="stop",
                    policy_versions=[{"version": version, "start": 0, "end": 2}])
    return ScoredTrajectory(trajectory=tr, reward=Reward(total=reward))


def _group(gid, domain, version=0):
    return [_scored(gid, 0, 1.0, domain, version=version), _scored(gid, 1, 0.0, domain, version=version)]


def _state(domain, trainable, reason=""):
    return Control(command="domain_state", domain=domain, trainable=trainable, reason=reason, origin="scheduler")


# ---------------------------------------------------------------------------------------------- ControlState


def test_control_state_folds_domain_state_latest_wins():
    s = ControlState()
    assert s.apply(_state("x", False, "circuit_open")) and s.blocked == {"x": "circuit_open"}
    assert not s.apply(_state("x", False, "circuit_open"))  # same again: no change
    assert s.apply(_state("x", False, "domain_paused")) and s.blocked == {"x": "domain_paused"}
    assert s.apply(_state("z", False, "circuit_open")) and s.blocked == {"x": "domain_paused", "z": "circuit_open"}
    assert s.apply(_state("x", True)) and s.blocked == {"z": "circuit_open"}
    assert not s.apply(_state("x", True))  # unblocking an unblocked domain changes nothing
    assert not s.training_paused


def test_control_state_blocks_an_unknown_reason_as_domain_paused():
    s = ControlState()
    assert s.apply(_state("x", False, "because")) and s.blocked == {"x": "domain_paused"}


def test_control_state_pauses_and_resumes_training_from_any_origin_and_ignores_other_commands():
    s = ControlState()
    assert s.apply(Control(command="pause_training", origin="cli")) and s.training_paused
    assert not s.apply(Control(command="pause_training", origin="rest"))
    for other in (Control(command="pause_domain", domain="x"), Control(command="open_breaker", domain="x"),
                  Control(command="close_breaker", domain="x"), Control(command="resume_domain", domain="x"),
                  Control(command="set_threshold", signal="kl", threshold={"warning": 1.0})):
        assert not s.apply(other)  # the scheduler's business: it answers with domain_state
    assert s.blocked == {} and s.training_paused
    assert s.apply(Control(command="resume_training", origin="scheduler")) and not s.training_paused


# ---------------------------------------------------------------------------------------------- drop_blocked


def _fill(buf, gid, domain, n=2, offset=0):
    for i in range(n):
        buf.add(_scored(gid, i, float(i % 2), domain), ("s", 0), offset + i)


def test_drop_blocked_drops_ready_groups_of_blocked_domains_with_their_reason():
    buf = GroupBuffer(max_staleness=1)
    _fill(buf, "gx", "x", offset=0)
    _fill(buf, "gy", "y", offset=2)
    _fill(buf, "gz", "z", offset=4)
    assert buf.drop_blocked({"x": "circuit_open", "z": "domain_paused"}) == 2
    assert [g.group_id for g in buf.ready] == ["gy"]  # another domain is untouched
    drops = buf.take_drops()
    assert [(d.group_id, d.reason, d.samples, d.behaviour_version) for d in drops] == [
        ("gx", "circuit_open", 2, 0), ("gz", "domain_paused", 2, 0)]
    assert buf.counters["dropped_circuit_open"] == 1 and buf.counters["dropped_domain_paused"] == 1
    assert buf.commit_offsets() == {("s", 0): 2}  # the dropped groups' records are released
    _fill(buf, "gx", "x", offset=6)  # a redelivery of a dropped group is skipped
    assert buf.counters["duplicates_skipped"] == 2 and [g.group_id for g in buf.ready] == ["gy"]


def test_drop_blocked_drops_a_partial_group_when_it_completes_and_unblocking_lets_later_groups_train():
    buf = GroupBuffer(max_staleness=1)
    blocked = {"x": "circuit_open"}
    _fill(buf, "gx", "x", n=1)  # one of two samples
    assert buf.drop_blocked(blocked) == 0 and "gx" in buf.partial and not buf.has_drops
    buf.add(_scored("gx", 1, 0.0, "x"), ("s", 0), 1)
    assert buf.drop_blocked(blocked) == 1 and [d.group_id for d in buf.take_drops()] == ["gx"]
    blocked.pop("x")  # trainable again
    _fill(buf, "gx2", "x", offset=2)
    assert buf.drop_blocked(blocked) == 0 and [g.group_id for g in buf.take(1)] == ["gx2"]


def test_drop_blocked_leaves_groups_taken_for_a_step_and_rejects_unknown_reasons():
    buf = GroupBuffer(max_staleness=1)
    _fill(buf, "gx", "x")
    taken = buf.take(1)
    assert buf.drop_blocked({"x": "domain_paused"}) == 0 and not buf.has_drops
    buf.mark_trained(taken)
    assert buf.counters["trained_groups"] == 1
    _fill(buf, "gx2", "x", offset=2)
    with pytest.raises(ValueError, match="unknown block reasons"):
        buf.drop_blocked({"x": "stale"})
    assert [g.group_id for g in buf.ready] == ["gx2"]  # nothing was dropped


# ---------------------------------------------------------------------------------------------- the service


@pytest.fixture
def setup(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    with EmbeddedBroker.start() as b:
        cfg = load_config(model={"name": str(model)}, run={"dir": str(tmp_path / "run")},
                          kafka={"bootstrap_servers": b.bootstrap_servers, "partitions": 2},
                          budget={"batch_groups": 1, "max_steps": 10}, trainer={"lr": 1e-3})
        yield cfg


async def _with_trainer(cfg, body):
    stop = asyncio.Event()
    task = asyncio.create_task(run(cfg, stop))
    try:
        await body()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def _produce(cfg, records):
    """Send ScoredTrajectory (to flywheel.scored), Control, or ``(topic, raw bytes)`` records, acked in order."""
    p = kafka.make_producer(cfg)
    await p.start()
    try:
        for r in records:
            if isinstance(r, tuple):
                await (await p.send(r[0], r[1], key=b"run"))
            elif isinstance(r, Control):
                await (await kafka.send(p, topics.CONTROL, r, r.key))
            else:
                await (await kafka.send(p, topics.SCORED, r, r.trajectory.group_id))
    finally:
        await p.stop()


async def _weights(read_topic, cfg, want, timeout_s=60):
    return [w.version for w in await read_topic(cfg.kafka, topics.WEIGHTS, WeightUpdate, want, timeout_s=timeout_s)]


def _folds(monkeypatch) -> list[Control]:
    """Every control record the trainer (in this process) folds in, in order."""
    applied: list[Control] = []
    real = ControlState.apply

    def apply(self, ctrl: Control) -> bool:
        changed = real(self, ctrl)
        applied.append(ctrl)
        return changed

    monkeypatch.setattr(ControlState, "apply", apply)
    return applied


async def _folded(applied: list[Control], want, timeout_s: float = 30.0) -> None:
    """Wait until a folded record satisfies ``want`` (the records it governs may be sent after that: a turn
    folds control before it takes groups)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not any(want(c) for c in applied):
        assert asyncio.get_running_loop().time() < deadline, applied
        await asyncio.sleep(0.02)


@pytest.mark.kafka
async def test_a_blocked_domains_groups_are_dropped_as_circuit_open_until_it_is_trainable_again(setup, read_topic,
                                                                                               monkeypatch):
    cfg = setup
    applied = _folds(monkeypatch)

    async def body():
        await _produce(cfg.kafka, _group("gy0", "y"))
        assert await _weights(read_topic, cfg, 1) == [1]  # the trainer is up and polling
        await _produce(cfg.kafka, [_state("x", False, "circuit_open")])
        await _folded(applied, lambda c: c.domain == "x" and c.trainable is False)
        await _produce(cfg.kafka, _group("gx1", "x") + _group("gy1", "y"))
        drops = await read_topic(cfg.kafka, topics.GROUP_DROPS, GroupDropped, 1)
        assert [(d.group_id, d.reason, d.samples) for d in drops] == [("gx1", "circuit_open", 2)]
        assert await _weights(read_topic, cfg, 2) == [1, 2]
        await _produce(cfg.kafka, [_state("x", True)])
        await _folded(applied, lambda c: c.domain == "x" and c.trainable is True)
        await _produce(cfg.kafka, _group("gx2", "x", version=2))  # sampled by version 2: fresh
        assert await _weights(read_topic, cfg, 3) == [1, 2, 3]

    await _with_trainer(cfg, body)
    store = CheckpointStore(cfg.run.path(cfg.run.checkpoint_dir))
    assert [store.trained_groups(v) for v in (1, 2, 3)] == [{"gy0"}, {"gy1"}, {"gx2"}]  # gx1 never trained
    metrics = await read_topic(cfg.kafka, topics.METRICS, Metrics, 3, keep=lambda r: r.domain is None)  # run-wide
    assert metrics[-1].values["train/dropped_circuit_open_total"] == 1.0
    assert metrics[-1].values["train/dropped_domain_paused_total"] == 0.0
    assert metrics[-1].values["train/trained_groups_total"] == 3.0
    assert len(await read_topic(cfg.kafka, topics.GROUP_DROPS, GroupDropped, 2, expect=1)) == 1


@pytest.mark.kafka
async def test_pause_training_read_at_start_holds_steps_until_resume_training(setup, read_topic):
    """Sent before the trainer starts: it folds the whole topic before its first turn (as after a restart)."""
    cfg = setup
    await _produce(cfg.kafka, [Control(command="pause_training", origin="cli", reason="look at the KL")])

    async def body():
        await _produce(cfg.kafka, _group("g1", "y") + _group("g2", "y"))
        assert await _weights(read_topic, cfg, 1, timeout_s=5) == []  # two ready groups, no step
        await _produce(cfg.kafka, [Control(command="resume_training", origin="cli")])
        assert await _weights(read_topic, cfg, 2) == [1, 2]

    await _with_trainer(cfg, body)
    store = CheckpointStore(cfg.run.path(cfg.run.checkpoint_dir))
    assert store.trained_groups(1) | store.trained_groups(2) == {"g1", "g2"}


@pytest.mark.kafka
async def test_malformed_control_records_go_to_the_dlq_and_the_trainer_keeps_training(setup, read_topic):
    cfg = setup
    unknown = orjson.loads(Control(command="pause_training").encode())
    unknown["command"] = "self_destruct"

    async def body():
        await _produce(cfg.kafka, [(topics.CONTROL, b"{not json"), (topics.CONTROL, orjson.dumps(unknown))])
        await asyncio.sleep(SETTLE_S)
        await _produce(cfg.kafka, _group("g1", "y"))
        assert await _weights(read_topic, cfg, 1) == [1]
        dl = await read_topic(cfg.kafka, topics.DLQ, DeadLetter, 2)
        assert [(d.source_topic, d.consumer) for d in dl] == [(topics.CONTROL, "trainer")] * 2
        assert "self_destruct" in dl[1].payload and "command" in dl[1].reason

    await _with_trainer(cfg, body)


def test_a_closed_breakers_probe_groups_are_dropped_even_after_the_domain_trains_again():
    """The probe's last samples can reach the trainer after the ``trainable: true`` that its own rewards
    caused: the record names the probe's groups, and they are dropped whenever they complete."""
    s = ControlState()
    s.apply(_state("x", False, "circuit_open"))
    close = Control(command="domain_state", domain="x", trainable=True, origin="scheduler", drop_groups=["gp1", "gp2"])
    assert s.apply(close) and s.blocked == {} and s.drop_groups == {"gp1", "gp2"}
    buf = GroupBuffer(max_staleness=1)
    _fill(buf, "gp1", "x", offset=0)
    _fill(buf, "gx", "x", offset=2)
    _fill(buf, "gp2", "x", n=1, offset=4)  # still partial: dropped on the pass it completes
    assert buf.drop_blocked(s.blocked, s.drop_groups) == 1
    buf.add(_scored("gp2", 1, 0.0, "x"), ("s", 0), 5)
    assert buf.drop_blocked(s.blocked, s.drop_groups) == 1
    assert [(d.group_id, d.reason) for d in buf.take_drops()] == [("gp1", "circuit_open"), ("gp2", "circuit_open")]
    assert [g.group_id for g in buf.take(2)] == ["gx"]  # the domain's other groups train
