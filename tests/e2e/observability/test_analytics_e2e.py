"""``flywheel analytics`` on the live toy system (the ``observed`` fixture), run as the CLI: the ingest, the
README's questions (``flywheel.analytics.queries.QUESTIONS``), a second ingest that duplicates nothing, and
``--follow`` stopped by SIGTERM while ``query`` reads the file."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import orjson
import pytest

from flywheel.analytics.queries import QUESTIONS
from flywheel.analytics.tables import TABLES

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parents[3]

COVERAGE = " UNION ALL ".join(
    f"SELECT DISTINCT kafka_topic, kafka_partition, kafka_offset FROM {t}" for t in (*(s.name for s in TABLES),
                                                                                   "rejected"))
GAPS = f"""WITH seen AS ({COVERAGE})
SELECT o.kafka_topic, o.kafka_partition, o.next_offset, count(s.kafka_offset) AS stored,
       count(DISTINCT s.kafka_offset) AS distinct_offsets, max(s.kafka_offset) AS last
FROM ingest_offsets o LEFT JOIN seen s USING (kafka_topic, kafka_partition)
GROUP BY ALL HAVING stored != o.next_offset OR distinct_offsets != stored OR last != o.next_offset - 1"""
"""Partitions where the offsets below the stored next offset are not each stored exactly once (in one table,
or ``rejected``): a loss or a duplicate. Empty when the ingest is exact."""


def cli(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "analytics", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout_s)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def ask(run_dir: Path, sql: str) -> list[dict]:
    return [orjson.loads(line) for line in cli("query", sql, "--run-dir", str(run_dir), "--json").stdout.splitlines()]


def snapshot(db: Path) -> dict:
    """Rows per table, the stored offsets, and the rows at or below them per table (what a rerun must keep)."""
    with duckdb.connect(str(db), read_only=True) as con:
        offsets = {(t, p): n for t, p, n in con.execute(
            "SELECT kafka_topic, kafka_partition, next_offset FROM ingest_offsets").fetchall()}
        counts = {s.name: con.execute(f"SELECT count(*) FROM {s.name}").fetchone()[0] for s in (*TABLES,)}
        counts["rejected"] = con.execute("SELECT count(*) FROM rejected").fetchone()[0]
        gaps = con.execute(GAPS).fetchall()
    return {"offsets": offsets, "counts": counts, "gaps": gaps}


def covered_rows(db: Path, offsets: dict) -> dict[str, int]:
    """Rows per table at coordinates below ``offsets`` (an earlier ingest's stored positions)."""
    cond = " OR ".join(f"(kafka_topic = '{t}' AND kafka_partition = {p} AND kafka_offset < {n})"
                       for (t, p), n in offsets.items()) or "false"
    with duckdb.connect(str(db), read_only=True) as con:
        return {s.name: con.execute(f"SELECT count(*) FROM {s.name} WHERE {cond}").fetchone()[0]
                for s in (*TABLES,)}


def test_the_questions_have_answers_and_a_second_ingest_duplicates_nothing(observed):
    run_dir, db = observed.run_dir, observed.run_dir / "analytics.duckdb"
    t0 = time.monotonic()
    out = cli("--run-dir", str(run_dir)).stdout
    first_s = time.monotonic() - t0
    # the scheduler publishes a round's eval records up to a second or more after REST calls the round done
    deadline = time.monotonic() + 60
    while not {r["eval_round"] for r in ask(run_dir, "heldout_accuracy")} >= set(observed.eval_rounds):
        assert time.monotonic() < deadline, ask(run_dir, "heldout_accuracy")
        time.sleep(1.0)
        out = cli("--run-dir", str(run_dir)).stdout
    first = snapshot(db)
    assert first["gaps"] == [], first["gaps"]
    counts = first["counts"]
    assert counts["rejected"] == 0, ask(run_dir, "SELECT kafka_topic, kafka_offset, error FROM rejected LIMIT 5")
    assert counts["tasks"] >= 64 and counts["rewards"] > 0 and counts["metrics"] > 0, out

    answers = {name: ask(run_dir, name) for name in QUESTIONS}
    for name, rows in answers.items():
        print(f"{name}: {len(rows)} rows, first {rows[:3]}")
    for name, rows in answers.items():
        assert rows, f"{name}: no rows"
    assert {r["domain"] for r in answers["pass_rate_by_version"]} == {"toy", "code"}
    assert max(r["policy_version"] for r in answers["pass_rate_by_version"]) >= 1
    code_cost = next(r for r in answers["cost_per_domain"] if r["domain"] == "code" and r["purpose"] == "train")
    assert code_cost["generated_tokens"] > 0 and code_cost["sandbox_seconds"] > 0, code_cost
    assert {r["eval_round"] for r in answers["heldout_accuracy"]} >= set(observed.eval_rounds)
    assert {r["domain"] for r in answers["heldout_accuracy"]} >= {"(all)", "toy", "code"}
    assert ask(run_dir, "SELECT count(*) AS n FROM rewards WHERE event_time IS NULL OR verifier_kind IS NULL")[0][
        "n"] == 0  # the verifier of this tree sends them

    cli("--run-dir", str(run_dir))  # the system goes on, so new records may come; none of the old twice
    second = snapshot(db)
    assert second["gaps"] == [], second["gaps"]
    assert covered_rows(db, first["offsets"]) == {k: v for k, v in counts.items() if k != "rejected"}
    assert all(second["offsets"][k] >= n for k, n in first["offsets"].items())
    print(f"first ingest {first_s:.1f} s: {counts}; second: {second['counts']}")


def test_follow_keeps_ingesting_until_sigterm_and_query_reads_meanwhile(observed):
    run_dir, db = observed.run_dir, observed.run_dir / "analytics.duckdb"
    before = snapshot(db)["counts"]["metrics"] if db.exists() else 0
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "analytics", "--run-dir", str(run_dir),
                             "--follow", "-v"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []

    def read() -> None:  # until the pipe closes
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90  # the child's start (imports, consumer) and its first batch
        while not any("batch 1:" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        # batch 1 caught up with what the earlier ingest left; a count above this one was ingested by --follow
        # later (the services publish metrics every few seconds); query opens the file while the ingest idles
        n = before = ask(run_dir, "SELECT count(*) AS n FROM metrics")[0]["n"]
        while n <= before:
            assert time.monotonic() < deadline, (before, n, "".join(lines)[-3000:])
            n = ask(run_dir, "SELECT count(*) AS n FROM metrics")[0]["n"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(10)
        output = "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, output[-3000:]
    assert "batch 1:" in output and "records read" in output, output[-3000:]
    after = snapshot(db)
    assert after["gaps"] == [] and after["counts"]["metrics"] >= n > before, (before, n, after["counts"])
