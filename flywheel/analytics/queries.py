"""The operators' questions of docs/guides/observability.md with their SQL (:data:`QUESTIONS`), and :func:`query`,
which runs SQL (or a question by name) on the analytics database read-only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flywheel.analytics.store import connect


@dataclass(frozen=True)
class Question:
    """An operator's question and the SQL that answers it (docs/guides/observability.md, "Analytics")."""

    title: str
    sql: str


QUESTIONS: dict[str, Question] = {
    "pass_rate_by_version": Question(
        "Per-domain pass rate by policy version (training samples, by the version that generated them)",
        """SELECT domain, policy_version, count(*) AS samples, round(avg(passed::INT), 3) AS pass_rate,
       round(avg(reward), 3) AS mean_reward
FROM samples WHERE purpose = 'train' AND NOT infra_error
GROUP BY domain, policy_version ORDER BY domain, policy_version"""),
    "reward_histogram": Question(
        "Reward histogram per domain (bins of 0.1)",
        """SELECT domain, floor(reward * 10) / 10 AS bin, count(*) AS samples,
       round(count(*) / sum(count(*)) OVER (PARTITION BY domain), 3) AS share
FROM samples WHERE NOT infra_error
GROUP BY domain, bin ORDER BY domain, bin"""),
    "length_inflation": Question(
        "Length inflation: mean completion tokens by policy version per domain, and the change since the first",
        """SELECT domain, policy_version, count(*) AS samples, round(avg(completion_tokens), 2) AS mean_tokens,
       round(avg(completion_tokens) - first_value(avg(completion_tokens))
             OVER (PARTITION BY domain ORDER BY policy_version), 2) AS vs_first,
       round(avg((finish_reason = 'length')::INT), 3) AS truncated
FROM samples WHERE purpose = 'train'
GROUP BY domain, policy_version ORDER BY domain, policy_version"""),
    "hack_rate": Question(
        "Hack rate per domain (samples a reward-hacking detector flagged) and which detectors fired",
        """SELECT domain, count(*) AS samples, count(*) FILTER (WHERE len(hacks) > 0) AS flagged,
       round(avg((len(hacks) > 0)::INT), 4) AS hack_rate,
       count(*) FILTER (WHERE len(hacks) > 0 AND passed) AS flagged_and_passed,
       list_sort(list_distinct(flatten(list(hacks)))) AS detectors
FROM samples GROUP BY domain ORDER BY domain"""),
    "cost_per_domain": Question(
        "Cost per domain and split: generated tokens, sandbox seconds, judge calls (RewardEvent.cost)",
        """SELECT domain, purpose, count(*) AS samples, sum(generated_tokens)::BIGINT AS generated_tokens,
       round(sum(sandbox_seconds), 2) AS sandbox_seconds, sum(judge_calls)::BIGINT AS judge_calls,
       round(sum(verify_seconds), 2) AS verify_seconds,
       round(sum(generated_tokens) / nullif(count(*) FILTER (WHERE passed), 0), 1) AS tokens_per_pass
FROM samples GROUP BY domain, purpose ORDER BY domain, purpose"""),
    "heldout_accuracy": Question(
        "Held-out greedy accuracy per eval round and domain (the eval records on flywheel.metrics)",
        """SELECT eval_round, policy_version, coalesce(domain, '(all)') AS domain, n, round(accuracy, 3) AS accuracy
FROM evals QUALIFY row_number() OVER (PARTITION BY eval_round, domain ORDER BY kafka_offset DESC) = 1
ORDER BY eval_round, domain NULLS FIRST"""),
}
"""The operator questions of docs/guides/observability.md (the first five), plus held-out accuracy; ``flywheel analytics query NAME``
runs one by name."""


def query(db: str | Path, sql: str, timeout_s: float = 10.0) -> tuple[list[str], list[tuple]]:
    """Run ``sql`` (or the :data:`QUESTIONS` entry of that name) on the database read-only; returns the column
    names and the rows. Retries for ``timeout_s`` seconds while an ingest holds the file.

    Raises:
        FileNotFoundError: no database at ``db``.
        duckdb.Error: the SQL is wrong (the message says where), or the file stays locked.
    """
    if not Path(db).exists():
        raise FileNotFoundError(f"no analytics database at {db} (run `flywheel analytics` first)")
    sql = QUESTIONS[sql].sql if sql in QUESTIONS else sql
    con = connect(db, read_only=True, lock_wait_s=timeout_s)
    try:
        cur = con.execute(sql)
        cols = [d[0] for d in cur.description] if cur.description else []
        return cols, cur.fetchall()
    finally:
        con.close()
