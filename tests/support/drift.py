"""The harness of ``tests/e2e/test_drift.py``: a tiny model taught a mixture of answers, four domains (one
per fault), a scripted judge, the system's YAML, and readers of what the run left behind (registry,
checkpoint store, flywheel.alerts).

The model (:func:`teach`): for each of the three colour prompts the four answers of :data:`MIX` (``red``
twice as likely as each of the others), each followed by EOS, so at temperature 1 the K samples of a group
differ, stop after a few tokens and pass at ~0.2 (each domain's right answer is one of the light three); at
temperature → 0 every sample is ``red``, the wrong mode. For the code prompt one correct function.

The domains (:data:`DOMAINS`), one fault each:

- ``judged``: a regex spec whose recipe scores only a judge rubric (``weights: {judge: 1}``) with the right
  answer as the reference, against :class:`ScriptedJudge`: honest (10 when the response holds the
  reference, else 0) until :attr:`ScriptedJudge.credit_all` is set (10 for everything).
- ``long``: plain regex; the fault is ``temperature`` patched to :data:`HOT`: the taught model no longer
  emits EOS and the completions run to the token budget.
- ``same``: plain regex; the fault is ``temperature`` patched to :data:`COLD`: every sample is ``red``.
- ``code``: ``unit_tests`` in the sandbox, 8 samples per group; the fault is SIGSTOP of the sandbox process
  (its requests time out in the verifier, ``code_timeout_s`` + 30 s later: infra errors).

Every task of a domain has the domain's prompt and its own verifier text (a regex comment ``(?#t<i>)``, or
another test value), so none is stored as a duplicate.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

OPT_OUT = {"reason": "no truncation gate: the token budgets here are a few tokens by design, so most completions hit them"}
"""The verifier recipe of these tasks: an explicit opt-out of the verifier's default truncation gate."""

MIX = {"red": 2.0, "blue": 1.0, "green": 1.0, "yellow": 1.0}
"""Answers taught for every colour prompt, with their weights (the model learns these odds)."""
CODE = "def f(x): return 2*x"
"""The taught answer of the code prompt (correct: the tests check ``f(i) == 2 * i``)."""
HOT = 5.0
"""The ``long`` fault's temperature: near-uniform over ~100 characters, EOS ~1 % per token."""
COLD = 0.01
"""The ``same`` fault's temperature: the argmax (``red``, wrong) every time."""


@dataclass(frozen=True)
class DomainSpec:
    prompt: str
    right: str | None
    """The right colour (``None``: the code domain)."""
    max_tokens: int
    k: int = 4
    """Samples per group."""


DOMAINS: dict[str, DomainSpec] = {
    "judged": DomainSpec("sky?", "blue", 8),
    "long": DomainSpec("leaf?", "green", 8),
    "same": DomainSpec("sun?", "yellow", 8),
    "code": DomainSpec("f", None, 32, k=8),
}
"""The domains. ``code`` has 8 samples per group, so one group of infra errors is half a 16-sample window."""


def _msgs(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def teach(model_dir: Path, steps: int = 150) -> tuple[Path, dict[str, dict[str, float]]]:
    """The tiny Llama taught :data:`MIX` on the colour prompts and :data:`CODE` on the code prompt, saved in
    ``model_dir``; also the probability (temperature 1) of each taught answer, per domain. ~10 s on one
    core (20 s on busy ones)."""
    from tests.support.taught import teach_tiny_mixture

    import torch

    examples = [(_msgs(s.prompt), a, w) for s in DOMAINS.values() if s.right for a, w in MIX.items()]
    examples.append((_msgs(DOMAINS["code"].prompt), CODE, 1.0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small: one thread is as fast, and 3x faster on busy cores
    try:
        tok, model = teach_tiny_mixture(model_dir, examples, steps=steps, lr=5e-3)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    probs = {d: {a: answer_prob(tok, model, s.prompt, a) for a in (MIX if s.right else [CODE])}
             for d, s in DOMAINS.items()}
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir, probs


def answer_prob(tok, model, prompt: str, answer: str) -> float:
    """P(``answer`` then EOS | ``prompt``) under ``model`` at temperature 1."""
    import torch

    from shared.model import encode_chat

    p = encode_chat(tok, _msgs(prompt))
    t = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([p + t])).logits[0, :-1], -1)
    return math.exp(sum(lp[len(p) - 1 + i, x].item() for i, x in enumerate(t)))


# ---------------------------------------------------------------- the judge

_REF = re.compile(r"REFERENCE ANSWER:\n(.*?)\n\n", re.DOTALL)
_RESP = re.compile(r"<<<RESPONSE-(\w+)\n(.*)\nRESPONSE-\1>>>", re.DOTALL)


class ScriptedJudge:
    """The judge's script (for ``tests.verifier_service.scripted_judge.ScriptedJudgeServer``): ``SCORE: 10``
    when the marked response contains the reference answer, else ``SCORE: 0``; everything 10 while
    :attr:`credit_all` is set (the fault)."""

    def __init__(self) -> None:
        self.credit_all = False
        self.calls = 0

    def __call__(self, user: str) -> str:
        self.calls += 1
        if self.credit_all:
            return "Looks fine.\nSCORE: 10"
        ref, resp = _REF.search(user), _RESP.search(user)
        good = bool(ref and resp and ref.group(1).strip() in resp.group(2))
        return f"Checked against the reference.\nSCORE: {10 if good else 0}"


# ---------------------------------------------------------------- config and tasks


def system_config(model_dir: Path, run_dir: Path, judge_url: str, monitor: dict | None = None,
                  batch_groups: int = 4, lr: float = 1e-5) -> dict:
    """The system's YAML as a dict: the four domains (weight 1, nothing retired or flagged),
    issue order ``fifo`` (the stride mix exactly: each domain within one group of its share over any run
    of decisions), the judge at ``judge_url``, unit tests that time out quickly and are not retried, every
    checkpoint kept (their ``trained_groups.json`` say what each step trained), and ``monitor``."""
    keep = {"retire_after": 0, "flag_after": 0}
    domains = {d: {"weight": 1.0, "samples_per_task": s.k, "max_tokens": s.max_tokens, "lifecycle": keep}
               for d, s in DOMAINS.items()}
    cfg = {
        "model": {"name": str(model_dir)},
        "run": {"dir": str(run_dir)},
        "domains": domains,
        "budget": {"batch_groups": batch_groups, "max_staleness": 1, "max_steps": 100_000, "resample_unsolved": 0},
        "scheduler": {"max_tokens": 8, "temperature": 1.0, "eval_before_training": False, "issue_order": "fifo"},
        "rollout": {"engine": "torch", "max_batch_samples": 32},
        "verifier": {"code_timeout_s": 1.0, "infra_retries": 0,
                     "judge": {"base_url": judge_url, "model": "scripted", "timeout_s": 10.0}},
        "sandbox": {"max_concurrency": 4},
        "trainer": {"loss": "bnpo", "truncation": "keep", "lr": lr, "micro_batch_size": 32,
                    "keep_checkpoints": 1000},
    }
    if monitor is not None:
        cfg["monitor"] = monitor
    return cfg


def tasks(n: int) -> list[dict]:
    """``n`` training tasks per domain (bodies of ``POST /v1/tasks``), all distinct."""
    out = []
    for d, s in DOMAINS.items():
        for i in range(n):
            if s.right is None:
                verifier = {"kind": "unit_tests", "entry_point": "f", "recipe": OPT_OUT,
                            "tests": [{"name": f"double_{i}", "code": f"assert f({i + 1}) == {2 * (i + 1)}"}]}
            else:
                verifier = {"kind": "regex", "pattern": rf"^\s*{s.right}\b(?#t{i})", "recipe": OPT_OUT}
                if d == "judged":
                    verifier["recipe"] = {"judge": {"rubric": "The answer names the colour of the thing asked about.",
                                                    "reference": s.right}, "weights": {"judge": 1.0}}
            out.append({"task_id": f"{d}-{i}", "domain": d, "prompt": _msgs(s.prompt), "samples_per_task": s.k,
                        "verifier": verifier})
    return out


# ---------------------------------------------------------------- REST


from benchmarks.fast_slow_mixing import submit  # noqa: E402,F401 - POST /v1/tasks, refusing duplicates



def get(url: str, path: str, **params) -> dict | list:
    r = httpx.get(f"{url}{path}", params=params or None, timeout=30)
    r.raise_for_status()
    return r.json()


def patch_domain(url: str, domain: str, body: dict, token: str | None = None) -> dict:
    """PATCH a domain's settings; ``token`` defaults to the one :func:`shared.auth.token_from_run_dir` finds."""
    from shared.auth import auth_headers, token_from_run_dir

    headers = auth_headers(token or token_from_run_dir(None))
    r = httpx.patch(f"{url}/v1/domains/{domain}", json=body, headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()


def breaker(url: str, domain: str) -> dict:
    """``breaker`` of ``GET /v1/domains/{domain}`` (``{}`` before the monitor serves it)."""
    return get(url, f"/v1/domains/{domain}").get("breaker") or {}


def wait_for(pred, timeout_s: float, system, what: str, every_s: float = 0.5):
    """Poll ``pred`` (supervising ``system``) until it returns something truthy; that value.

    Raises:
        AssertionError: not within ``timeout_s`` (the message says what was awaited).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        system.check()
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


# ---------------------------------------------------------------- what the run left behind


def _ro(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)


def train_groups(db: Path) -> dict[str, dict]:
    """Every training group in the registry by id: ``domain``, ``issued_at``, ``resample_of``, ``attempt``,
    ``state``, ``dropped``, and from its rewards ``first``/``last`` (received_at), ``samples``, ``passed``,
    ``infra`` (counts)."""
    con = _ro(db)
    try:
        rows = con.execute(
            "SELECT g.group_id, g.domain, g.issued_at, g.resample_of, g.attempt, g.state, g.dropped,"
            " MIN(r.received_at), MAX(r.received_at), COUNT(r.trajectory_id), COALESCE(SUM(r.passed), 0),"
            " COALESCE(SUM(r.infra_error), 0)"
            " FROM \"groups\" g LEFT JOIN rewards r ON r.group_id = g.group_id WHERE g.purpose = 'train'"
            " GROUP BY g.group_id ORDER BY g.rowid").fetchall()
    finally:
        con.close()
    keys = ("domain", "issued_at", "resample_of", "attempt", "state", "dropped", "first", "last", "samples",
            "passed", "infra")
    return {r[0]: dict(zip(keys, r[1:])) for r in rows}


def pass_rates(groups: dict[str, dict], since: float = 0.0) -> dict[str, tuple[float, int]]:
    """Per domain: share of passed samples among the scored ones (infra errors left out) of the groups
    first rewarded after ``since``, and that sample count."""
    out: dict[str, list[int]] = {}
    for g in groups.values():
        if g["first"] is not None and g["first"] > since:
            acc = out.setdefault(g["domain"], [0, 0])
            acc[0] += g["passed"]
            acc[1] += g["samples"] - g["infra"]
    return {d: (p / n if n else 0.0, n) for d, (p, n) in out.items()}


def trained_versions(checkpoint_dir: Path) -> dict[int, tuple[float, set[str]]]:
    """Every version in the checkpoint store: ``(created_at, ids of the groups its step trained)``."""
    out = {}
    for d in sorted(checkpoint_dir.glob("v*")):
        if d.name.endswith(".tmp") or not (d / "update.json").exists():
            continue
        made = json.loads((d / "update.json").read_text())["created_at"]
        out[int(d.name[1:])] = (made, set(json.loads((d / "trained_groups.json").read_text())))
    return out


async def _alerts(bootstrap: str, timeout_s: float = 60.0) -> list:
    """Every Alert on flywheel.alerts up to its end offsets as read at the start (not "until a quiet spell": a
    slow first fetch read as quiet returned nothing)."""
    from aiokafka import TopicPartition

    from shared import kafka, topics
    from shared.config import KafkaConfig
    from shared.schemas import Alert, DecodeError, decode

    c = kafka.make_consumer(KafkaConfig(bootstrap_servers=bootstrap), topics.ALERTS, group_id=None)
    await c.start()
    out, deadline = [], time.monotonic() + timeout_s
    try:
        tps = [TopicPartition(topics.ALERTS, p) for p in sorted(c.partitions_for_topic(topics.ALERTS) or ())]
        assert tps, "flywheel.alerts has no partitions"
        end = await c.end_offsets(tps)
        read = {tp: 0 for tp in tps}  # the next offset per partition
        while any(read[tp] < n for tp, n in end.items()):
            assert time.monotonic() < deadline, f"flywheel.alerts read to {read}, its end was {end}"
            for tp, msgs in (await c.getmany(timeout_ms=300)).items():
                for m in msgs:
                    read[tp] = max(read.get(tp, 0), m.offset + 1)
                    try:
                        out.append(decode(m.value, Alert))
                    except DecodeError:
                        continue
    finally:
        await c.stop()
    return sorted(out, key=lambda a: a.time)


def alerts_topic(system) -> list:
    """Every :class:`shared.schemas.Alert` on flywheel.alerts so far, oldest first."""
    return asyncio.run(_alerts(system.env["FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS"]))
