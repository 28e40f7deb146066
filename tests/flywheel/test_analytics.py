"""``flywheel analytics`` (flywheel/analytics/) on the session broker: records on per-test topics into a
DuckDB file; re-reads insert nothing; a crash (in a batch's transaction, or SIGKILL of the process) loses
and duplicates nothing; malformed records go to ``rejected``; a replaced log is refused."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import orjson
import pytest

from flywheel.analytics.ingest import IngestReport, LogChangedError, ingest
from flywheel.analytics.queries import QUESTIONS, query
from flywheel.analytics.store import Store
from flywheel.analytics.tables import TABLES
from shared.kafka import ensure_topics, make_producer
from shared.schemas import Alert, Control, GroupDropped, Metrics, RewardEvent, Task

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def names(kafka_cfg, unique) -> dict[str, str]:
    """This test's topic per table (created, 2 partitions each)."""
    out = {t.name: f"an-{unique}.{t.name}" for t in TABLES}
    asyncio.run(ensure_topics(kafka_cfg, out.values()))
    return out


def task(i: int) -> Task:
    return Task(task_id=f"t{i}", domain="toy", prompt=[{"role": "user", "content": f"say {i}"}],
                verifier={"kind": "regex", "pattern": "^a"}, samples_per_task=2, metadata={"i": i})


def reward(i: int, **kw) -> RewardEvent:
    fields = dict(task_id=f"t{i % 3}", group_id=f"g{i // 2}", trajectory_id=f"traj-{i}", sample_index=i % 2,
                  group_size=2, domain="toy" if i % 2 else "code", difficulty=0.0, purpose="train",
                  reward=float(i % 2), passed=bool(i % 2), completion_tokens=10 + i, finish_reason="stop",
                  policy_version=i // 4, cost={"generated_tokens": 10 + i, "sandbox_seconds": 0.5})
    return RewardEvent(**(fields | kw))


def send_all(cfg, items: list[tuple[str, bytes, str]]) -> None:
    """Produce ``(topic, value, key)`` records and wait for every ack."""
    async def go():
        p = make_producer(cfg)
        await p.start()
        try:
            futs = [await p.send(t, v, key=k.encode()) for t, v, k in items]
            await asyncio.gather(*futs)
        finally:
            await p.stop()
    asyncio.run(go())


def run_ingest(store: Store, cfg, names, **kw) -> IngestReport:
    try:
        return asyncio.run(ingest(store, cfg, topic_names=names, quiet_s=0.5, **kw))
    finally:
        store.close()


def rows(db: Path, sql: str) -> list[tuple]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(sql).fetchall()


def test_ingest_types_every_record_and_a_rerun_adds_nothing(kafka_cfg, names, tmp_path):
    old = reward(0).model_dump(mode="json", by_alias=True)
    for f in ("event_time", "verifier_kind", "components", "gates"):  # a record written before these fields
        old.pop(f, None)
    new = reward(1, event_time=1.7e9, verifier_kind="regex", components={"correctness": 1.0, "format": 0.5},
                 gates=["format"], hacks=["repeat"])
    items = [(names["tasks"], task(i).encode(), f"t{i}") for i in range(3)]
    items += [(names["rewards"], orjson.dumps(old), "t0"), (names["rewards"], new.encode(), "t1")]
    items += [(names["rewards"], reward(i).encode(), f"t{i}") for i in range(2, 20)]
    items += [(names["metrics"], Metrics(source="trainer", step=s, policy_version=s, values={
        "train/reward_mean": 0.5 * s, "loss/kl": 0.01, "time/step_seconds": 2.0}).encode(), "trainer")
        for s in (1, 2)]
    items += [(names["metrics"], Metrics(source="scheduler", policy_version=2, domain="toy", values={
        "eval/accuracy": 0.75, "eval/n": 8, "eval/round": 1}).encode(), "scheduler")]
    items += [(names["alerts"], Alert(domain="toy", signal="breaker", window=5, message="open").encode(), "toy/b"),
              (names["group_drops"], GroupDropped(group_id="g9", reason="stale", policy_version=3).encode(), "g9"),
              (names["control"], Control(command="pause_domain", domain="toy").encode(), "toy")]
    send_all(kafka_cfg, items)
    db = tmp_path / "a.duckdb"
    rep = run_ingest(Store(db), kafka_cfg, names)
    want = {"tasks": 3, "rewards": 20, "metrics": 9, "alerts": 1, "group_drops": 1, "control": 1}
    assert {k: v for k, v in rep.added.items() if v} == want and rep.records == len(items)
    assert rows(db, "SELECT trajectory_id, event_time, verifier_kind, components->>'format', gates, hacks, "
                    "generated_tokens, sandbox_seconds, judge_calls FROM rewards WHERE trajectory_id IN "
                    "('traj-0', 'traj-1') ORDER BY 1") == [
        ("traj-0", None, None, None, None, [], 10.0, 0.5, 0.0),
        ("traj-1", 1.7e9, "regex", "0.5", ["format"], ["repeat"], 11.0, 0.5, 0.0)]
    assert rows(db, "SELECT eval_round, domain, accuracy, n FROM evals") == [(1, "toy", 0.75, 8)]
    assert rows(db, 'SELECT step, "train/reward_mean" FROM metrics_wide WHERE source = \'trainer\' ORDER BY 1') == [
        (1, 0.5), (2, 1.0)]
    assert rows(db, "SELECT signal, window_size, key FROM alerts") == [("breaker", 5, "toy/breaker")]
    assert rows(db, "SELECT verifier_kind, metadata->>'i' FROM tasks ORDER BY task_id LIMIT 1") == [("regex", "0")]
    for q in QUESTIONS.values():  # every question runs on these tables and finds rows
        assert query(db, q.sql)[1], q.title

    again = run_ingest(Store(db), kafka_cfg, names)
    assert sum(again.added.values()) == 0  # it re-read only the last stored record of each partition:
    assert again.records == rows(db, "SELECT count(*) FROM ingest_offsets")[0][0] <= 2 * len(names)
    counts = rows(db, "SELECT count(*), count(DISTINCT trajectory_id) FROM rewards")
    assert counts == [(20, 20)]

    send_all(kafka_cfg, [(names["rewards"], reward(i).encode(), f"t{i}") for i in range(20, 25)])
    more = run_ingest(Store(db), kafka_cfg, names)
    assert {k: v for k, v in more.added.items() if v} == {"rewards": 5}
    assert rows(db, "SELECT count(*), count(DISTINCT trajectory_id) FROM rewards") == [(25, 25)]
    assert rows(db, f"SELECT sum(next_offset) FROM ingest_offsets WHERE kafka_topic = '{names['rewards']}'") == [(25,)]


def test_a_malformed_record_is_rejected_and_the_ingest_goes_on(kafka_cfg, names, tmp_path):
    bad_schema = reward(1).model_dump(mode="json", by_alias=True) | {"passed": "maybe"}
    send_all(kafka_cfg, [(names["rewards"], reward(0).encode(), "k"), (names["rewards"], b"\x00not json", "k"),
                         (names["rewards"], orjson.dumps(bad_schema), "k"), (names["rewards"], reward(2).encode(), "k"),
                         (names["metrics"], b'{"schema": "flywheel.Metrics", "values": 3}', "m")])
    db = tmp_path / "a.duckdb"
    rep = run_ingest(Store(db), kafka_cfg, names)
    assert rep.added.get("rewards") == 2 and rep.added.get("rejected") == 3
    got = rows(db, "SELECT kafka_topic, kafka_offset, error, payload FROM rejected ORDER BY kafka_topic, kafka_offset")
    assert [(t, o) for t, o, _, _ in got] == [(names["metrics"], 0), (names["rewards"], 1), (names["rewards"], 2)]
    assert "not JSON" in got[1][2] and "passed" in got[2][2] and "values" in got[0][2]
    assert got[1][3].endswith("not json")
    assert sum(run_ingest(Store(db), kafka_cfg, names).added.values()) == 0


class CrashingStore(Store):
    """A store whose transaction fails after the rows of its ``crash_at``-th batch are inserted, before the
    offsets are stored: what a crash between the two would leave if they were not one transaction."""

    def __init__(self, path, crash_at: int):
        super().__init__(path)
        self.crash_at, self.batches = crash_at, 0

    def _store_positions(self, positions):
        self.batches += 1
        if self.batches == self.crash_at:
            raise RuntimeError("crash between the rows and the offsets")
        super()._store_positions(positions)


def _offsets_match_rows(db: Path, topic: str) -> list[tuple]:
    """Partitions where the stored next offset differs from the rows stored (should be none)."""
    return rows(db, f"""SELECT o.kafka_partition, o.next_offset, count(r.kafka_offset) FROM ingest_offsets o
                        LEFT JOIN rewards r USING (kafka_topic, kafka_partition) WHERE kafka_topic = '{topic}'
                        GROUP BY ALL HAVING o.next_offset != count(r.kafka_offset)""")


def test_a_crash_inside_a_batch_keeps_neither_its_rows_nor_its_offsets(kafka_cfg, names, tmp_path):
    n = 200
    send_all(kafka_cfg, [(names["rewards"], reward(i).encode(), f"k{i}") for i in range(n)])
    db = tmp_path / "a.duckdb"
    with pytest.raises(RuntimeError, match="crash between"):
        run_ingest(CrashingStore(db, crash_at=3), kafka_cfg, names, batch_records=30)
    kept = rows(db, "SELECT count(*) FROM rewards")[0][0]
    assert 0 < kept <= 60 and _offsets_match_rows(db, names["rewards"]) == []
    rep = run_ingest(Store(db), kafka_cfg, names, batch_records=30)
    assert rep.added["rewards"] == n - kept
    assert rows(db, "SELECT count(*), count(DISTINCT trajectory_id) FROM rewards") == [(n, n)]


def test_a_run_without_follow_ends_while_records_keep_coming(kafka_cfg, names, tmp_path):
    """A live system never goes quiet: the ingest stops once past what was there at its start."""
    db = tmp_path / "a.duckdb"
    store = Store(db)
    send_all(kafka_cfg, [(names["rewards"], reward(i).encode(), f"k{i}") for i in range(100)])

    async def go():
        p = make_producer(kafka_cfg)
        await p.start()
        stop = asyncio.Event()

        async def produce():  # a record every 50 ms on both partitions, until the ingest is done
            i = 1000
            while not stop.is_set():
                await (await p.send(names["rewards"], reward(i).encode(), key=f"k{i}".encode()))
                i += 1
                await asyncio.sleep(0.05)

        task = asyncio.create_task(produce())
        try:
            return await asyncio.wait_for(ingest(store, kafka_cfg, topic_names=names, quiet_s=0.5), 60)
        finally:
            stop.set()
            await task
            await p.stop()

    try:
        rep = asyncio.run(go())
    finally:
        store.close()
    assert rep.added["rewards"] >= 100 and rep.seconds < 30
    assert _offsets_match_rows(db, names["rewards"]) == []


CHILD = """
import asyncio, sys, orjson
from flywheel.analytics.ingest import ingest
from flywheel.analytics.store import Store
from shared.config import KafkaConfig
store = Store(sys.argv[2])
asyncio.run(ingest(store, KafkaConfig(bootstrap_servers=sys.argv[1]), batch_records=10, quiet_s=0.5,
                             topic_names=orjson.loads(sys.argv[3]), on_batch=lambda r: print(r.batches, flush=True)))
print("done", flush=True)
"""


def test_a_killed_ingest_resumes_without_loss_or_duplicates(kafka_cfg, names, tmp_path):
    n = 3000
    send_all(kafka_cfg, [(names["rewards"], reward(i).encode(), f"k{i}") for i in range(n)])
    db = tmp_path / "a.duckdb"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, kafka_cfg.bootstrap_servers, str(db), orjson.dumps(names)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.strip() == "5":
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    kept = rows(db, "SELECT count(*) FROM rewards")[0][0]
    assert 50 <= kept < n, kept  # killed mid-ingest, after 5 batches of 10 were committed
    assert _offsets_match_rows(db, names["rewards"]) == []
    rep = run_ingest(Store(db), kafka_cfg, names)
    assert rep.added["rewards"] == n - kept
    assert rows(db, "SELECT count(*), count(DISTINCT trajectory_id) FROM rewards") == [(n, n)]


@pytest.mark.parametrize("change", ["digest", "offset"])
def test_a_replaced_log_is_refused_before_anything_is_written(kafka_cfg, names, tmp_path, change):
    send_all(kafka_cfg, [(names["rewards"], reward(i).encode(), "same") for i in range(4)])
    db = tmp_path / "a.duckdb"
    run_ingest(Store(db), kafka_cfg, names)
    with duckdb.connect(str(db)) as con:  # what a new broker's log at the same coordinates looks like to us
        con.execute("UPDATE ingest_offsets SET last_digest = '0000000000000000'" if change == "digest" else
                    "UPDATE ingest_offsets SET next_offset = next_offset + 100")
        con.execute("DELETE FROM rewards WHERE kafka_offset = 0")
    send_all(kafka_cfg, [(names["rewards"], reward(9).encode(), "same")])
    with pytest.raises(LogChangedError, match="replaced"):
        run_ingest(Store(db), kafka_cfg, names)
    assert rows(db, "SELECT count(*) FROM rewards") == [(3,)]


def test_a_database_from_before_a_field_existed_gets_its_column(tmp_path):
    db = tmp_path / "old.duckdb"
    with duckdb.connect(str(db)) as con:  # the rewards table as an older flywheel made it: no `gates` column
        con.execute("CREATE TABLE rewards (kafka_topic VARCHAR, kafka_partition INTEGER, kafka_offset BIGINT, "
                    "kafka_time DOUBLE, trajectory_id VARCHAR, "
                    "PRIMARY KEY (kafka_topic, kafka_partition, kafka_offset))")
        con.execute("INSERT INTO rewards VALUES ('flywheel.rewards', 0, 0, 1.0, 'traj-old')")
    store = Store(db).open()
    try:
        store.write({"rewards": [{"kafka_topic": "flywheel.rewards", "kafka_partition": 0, "kafka_offset": 1,
                                  "trajectory_id": "traj-new", "gates": ["format"]}]}, {})
        store.refresh_views()
        got = store.con.execute("SELECT trajectory_id, gates FROM samples ORDER BY kafka_offset").fetchall()
    finally:
        store.close()
    assert got == [("traj-old", None), ("traj-new", ["format"])]


def test_query_prints_a_table_or_json_lines_and_refuses_bad_or_writing_sql(tmp_path):
    from typer.testing import CliRunner

    from flywheel.cli import app

    db = tmp_path / "q.duckdb"
    store = Store(db).open()
    try:
        store.write({"rewards": [reward(i).model_dump(mode="json") | {
            "kafka_topic": "flywheel.rewards", "kafka_partition": 0, "kafka_offset": i} for i in range(4)]}, {})
        store.refresh_views()
    finally:
        store.close()

    def cli(*args):
        return CliRunner().invoke(app, ["analytics", "query", *args, "--db", str(db)])

    r = cli("hack_rate", "--json")
    assert r.exit_code == 0, r.output
    assert [orjson.loads(line)["samples"] for line in r.output.splitlines()] == [2, 2]
    r = cli("SELECT domain, count(*) AS n FROM samples GROUP BY domain ORDER BY domain")
    assert r.exit_code == 0 and "code" in r.output and "toy" in r.output and "2 rows" in r.output, r.output
    assert cli("SELEC 1").exit_code == 1 and cli("DELETE FROM rewards").exit_code == 1
    assert rows(db, "SELECT count(*) FROM rewards") == [(4,)]
    r = CliRunner().invoke(app, ["analytics", "query", "SELECT 1", "--db", str(tmp_path / "none.duckdb")])
    assert r.exit_code == 1 and "no analytics database" in r.output


def test_opening_the_store_waits_while_a_reader_holds_the_file(tmp_path):
    """A ``flywheel analytics query`` (read-only, another process) holds the file when a ``--follow`` ingest
    re-opens it after its pause: the ingest waits for the file instead of crashing; without a wait it raises."""
    import time

    db = tmp_path / "a.duckdb"
    Store(db).open().close()
    reader = subprocess.Popen([sys.executable, "-c", (
        "import duckdb, sys, time\n"
        f"con = duckdb.connect({str(db)!r}, read_only=True)\n"
        "print('held', flush=True); time.sleep(2.0); con.close()\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "held"
        with pytest.raises(duckdb.IOException):
            Store(db).open(lock_wait_s=0)
        t0 = time.monotonic()
        store = Store(db).open(lock_wait_s=30)
        waited = time.monotonic() - t0
        store.close()
    finally:
        reader.kill()
        reader.wait(10)
    assert waited > 0.5, waited  # it did wait for the reader, and then opened the file

    bad = tmp_path / "bad.duckdb"
    bad.write_bytes(b"not a database" * 100)
    t0 = time.monotonic()
    with pytest.raises(duckdb.IOException, match="not a valid DuckDB database"):
        Store(bad).open(lock_wait_s=30)
    assert time.monotonic() - t0 < 5  # only a held lock is waited for


def test_a_user_environments_reward_metrics_are_a_json_column_of_rewards():
    """``RewardEvent.metrics`` (each reward function's value and named metric) is ingested as JSON; a record
    written before the field existed gives NULL, not ``{}``."""
    from flywheel.analytics.tables import TABLES

    spec = next(t for t in TABLES if t.name == "rewards")
    assert ("metrics", "JSON") in spec.columns
    row = spec.rows(reward(0, metrics={"sorted_answer": 0.5, "brevity.chars": 7.0}))[0]
    assert row["metrics"] == {"sorted_answer": 0.5, "brevity.chars": 7.0}
    assert spec.rows(reward(1))[0]["metrics"] is None
