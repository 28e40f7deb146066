"""The verifier's dispatcher: runs the layers of a task's recipe and composes them into a Reward
(DESIGN.md, "Verification layers").

1. Deterministic (``correctness``): :mod:`verifier_service.deterministic` for the in-process kinds;
   here, ``math`` (math-verify in a process pool with our own time bound) and ``unit_tests`` (the
   sandbox's test-harness mode over HTTP).
2. Rules (:mod:`verifier_service.rules`): format, tool protocol, safety, truncation.
3. Judge (:mod:`verifier_service.judge`): a rubric scored over an OpenAI-compatible endpoint.

Then :func:`compose` applies the recipe's gates and weights; reward-hacking detectors
(:mod:`verifier_service.hacks`) are flagged in the details. The resulting :class:`Reward`:

* ``components``: every layer computed, each in [0, 1];
* ``total``: 0 when a gate failed, else the weighted mean of the weighted components;
* ``details``: the correctness layer's details at the top level (what was extracted, raw score,
  errors), ``rules`` and ``judge`` details, ``gated_by`` and ``hacks``;
* ``infra_error``: True only when *our* side failed (sandbox unreachable, math-verify pool timed out
  or died, judge down or unparsable, misconfigured spec). Never a 0: the service retries it and
  then passes it on flagged. A model answer that makes a scorer raise is the model's fault: 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import time
from typing import Any

import httpx
from opentelemetry import propagate

from shared.verifier_specs import (
    ExactSpec, GeometrySpec, JsonFieldsSpec, MathSpec, NumericSpec, ReasoningGymSpec, Recipe, RegexSpec,
    UnitTestsSpec,
)
from shared.domains.reasoning_gym import SLOW
from shared.schemas import Reward
from verifier_service import deterministic as det
from verifier_service.config import VerifierConfig
from verifier_service.deterministic import CheckResult, infra, ok_if
from verifier_service.extract import clip, extract_boxed, extract_code, extract_last_number, strip_reasoning
from verifier_service.hacks import detect_hacks
from verifier_service.judge import JudgeClient
from verifier_service.rules import run_rules

log = logging.getLogger(__name__)

LAYER = "correctness"
"""Name of the deterministic layer in ``Reward.components``."""

CODE_KINDS = (UnitTestsSpec,)
"""Spec kinds scored by running the response's code (the test-tampering detector applies)."""

SLOW_REASONING_GYM = frozenset(SLOW)
"""reasoning-gym scorers over a millisecond per call: run in the pool."""


def failed_gates(recipe: Recipe, components: dict[str, float]) -> list[str]:
    """The recipe's gates among ``components`` that are below 1 (a gate not computed yet does not fail)."""
    return [g for g in recipe.gates if components.get(g, 1.0) < 1.0]


def compose(recipe: Recipe, correctness: CheckResult, rules: dict[str, CheckResult],
            judge: CheckResult | None, hacks: dict[str, dict]) -> Reward:
    """One Reward from the layers' results under ``recipe`` (formula in :class:`shared.verifier_specs.Recipe`).

    Any layer's infra_error makes the whole reward infra_error (the components computed so far are kept).
    """
    layers: dict[str, CheckResult] = {LAYER: correctness, **rules}
    if judge is not None:
        layers["judge"] = judge
    details: dict[str, Any] = dict(correctness.details)
    if rules:
        details["rules"] = {k: v.details for k, v in rules.items()}
    if judge is not None:
        details["judge"] = judge.details
    if hacks:
        details["hacks"] = hacks
    failed = [k for k, v in layers.items() if v.infra_error]
    if failed:
        first = layers[failed[0]]
        details["reason"] = first.details.get("reason", f"{failed[0]} failed")
        if any(layers[k].details.get("misconfigured") for k in failed):
            details["misconfigured"] = True
        details["infra_layers"] = failed
        return Reward(total=0.0, components={k: v.score for k, v in layers.items() if not v.infra_error},
                      details=details, infra_error=True)
    components = {k: v.score for k, v in layers.items()}
    gated_by = failed_gates(recipe, components)
    weighted = {k: w for k, w in recipe.weights.items() if k in components and w > 0}
    total = sum(w * components[k] for k, w in weighted.items()) / sum(weighted.values()) if weighted else 0.0
    if gated_by:
        details["gated_by"] = gated_by
        total = 0.0
    if hacks and recipe.hack_policy == "zero":
        total = 0.0
    return Reward(total=total, components=components, details=details)


# ---------------------------------------------------------------- math (runs in a worker process)


def _reasoning_gym_worker(spec_json: str, completion: str) -> tuple[float, dict, bool]:
    """:func:`deterministic.score_reasoning_gym` in a pool worker (plain values in and out)."""
    r = det.score_reasoning_gym(ReasoningGymSpec.model_validate_json(spec_json), completion)
    return r.score, r.details, r.infra_error


def _math_worker_init() -> None:
    import math_verify  # noqa: F401 - import once per worker (sympy is slow to import)

    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeout is off


def _math_worker_ping() -> int:
    import os

    return os.getpid()


def math_verify_compare(gold: str, answer: str, answer_is_boxed: bool) -> dict[str, Any]:
    """Compare ``answer`` with ``gold`` using math-verify without its signal-based timeouts.

    Runs in the worker process of :class:`Scorer` (plain picklable values in and out). Returns
    ``{"ok": bool, "gold_parsed": str, "answer_parsed": str, "error": str | None}``; ``error``
    set with ``gold_unparsed`` True means the gold itself failed to parse.
    """
    from math_verify import parse, verify

    out: dict[str, Any] = {"ok": False, "error": None, "gold_unparsed": False}
    # The gold is one expression: read it whole, as boxed content. A plain parse takes the last number
    # of "(1, 2)" (2), the false negative of notes/models-datasets.md; fall back to it only if needed.
    gold_p = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    if not gold_p:
        gold_p = parse(gold, parsing_timeout=None)
    if not gold_p:
        gold_p = parse(f"${gold}$", parsing_timeout=None)
    out["gold_parsed"] = str(gold_p[0]) if gold_p else None
    if not gold_p:
        out.update(error=f"gold answer {gold!r} does not parse", gold_unparsed=True)
        return out
    ans_p = parse(f"\\boxed{{{answer}}}" if answer_is_boxed else answer, parsing_timeout=None)
    out["answer_parsed"] = str(ans_p[0]) if ans_p else None
    if not ans_p:
        out["error"] = "model answer does not parse"
        return out
    out["ok"] = bool(verify(gold_p, ans_p, timeout_seconds=None))
    return out


# ---------------------------------------------------------------- the dispatcher


class Scorer:
    """Runs a task's recipe on a completion; owns the math pool, the sandbox and judge HTTP clients.

    Use from one asyncio event loop (any thread). Call :meth:`close` when done. Scoring never
    raises for the model's or the infrastructure's failures: both come back as a Reward.
    """

    def __init__(self, cfg: VerifierConfig) -> None:
        self.cfg = cfg
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pool_lock = asyncio.Lock()
        self._math_slots = asyncio.Semaphore(cfg.math_workers)
        self._http: httpx.AsyncClient | None = None
        self.judge = JudgeClient(cfg.judge)

    def recipe_for(self, spec: Any, domain: str | None) -> Recipe:
        """The task's own recipe, else the service's recipe for ``domain``, else the default recipe."""
        return spec.recipe or self.cfg.recipes.get(domain or "", None) or self.cfg.default_recipe

    async def score(self, spec: Any, completion: str, *, finish_reason: str = "stop",
                    prompt: list[dict[str, str]] | None = None, tools: list[str] | tuple = (),
                    domain: str | None = None) -> Reward:
        """Score ``completion`` against ``spec`` (any ``shared.verifier_specs.VerifierSpec``) under its recipe.

        ``finish_reason`` feeds the truncation rule, ``prompt`` the judge, ``tools`` the tool-protocol
        rule (the task's allowed tools), ``domain`` picks the service's per-domain recipe.

        Raises:
            asyncio.CancelledError: when cancelled (nothing else).
        """
        try:
            recipe = self.recipe_for(spec, domain)
            correctness = await self.check(spec, completion)
            rules = run_rules(recipe.rules, completion, finish_reason, list(tools)) if recipe.rules else {}
            hacks = detect_hacks(completion, isinstance(spec, CODE_KINDS))
            judge = None
            so_far = {LAYER: correctness.score, **{k: v.score for k, v in rules.items()}}
            if recipe.judge is not None and not correctness.infra_error and not failed_gates(recipe, so_far):
                # a failed gate zeroes the reward: the judge's call would be wasted
                judge = await asyncio.wait_for(self.judge.score(recipe.judge, prompt or [], completion),
                                               timeout=self.cfg.judge.timeout_s + 5)
            return compose(recipe, correctness, rules, judge, hacks)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            return Reward(total=0.0, infra_error=True, details={"reason": "judge timed out"})
        except Exception as e:  # noqa: BLE001 - a bug of ours: flag it, never a 0 reward
            log.exception("scorer failed on %s", getattr(spec, "kind", spec))
            return Reward(total=0.0, infra_error=True, details={"reason": f"scorer crashed: {type(e).__name__}: {e}"})

    async def check(self, spec: Any, completion: str) -> CheckResult:
        """The deterministic layer (``correctness``) for ``spec``.

        In-process kinds run inline when cheap (exact, numeric, json_fields, geometry, a cached
        reasoning-gym dataset) and in a worker thread bounded by ``check_timeout_s`` otherwise.
        """
        if isinstance(spec, ExactSpec):
            return det.score_exact(spec, completion)
        if isinstance(spec, NumericSpec):
            return det.score_numeric(spec, completion)
        if isinstance(spec, JsonFieldsSpec):
            return det.score_json_fields(spec, completion)
        if isinstance(spec, GeometrySpec):
            return det.score_geometry(spec, completion)
        if isinstance(spec, MathSpec):
            return await self.score_math(spec, completion)
        if isinstance(spec, UnitTestsSpec):
            return await self.score_unit_tests(spec, completion)
        if isinstance(spec, RegexSpec):
            return await self._in_thread(det.score_regex, spec, completion, self.cfg.regex_timeout_s)
        if isinstance(spec, ReasoningGymSpec):
            if spec.dataset in SLOW_REASONING_GYM:
                return await self._in_pool(_reasoning_gym_worker, spec.model_dump_json(), completion)
            if det.reasoning_gym_cached(spec.dataset):
                return det.score_reasoning_gym(spec, completion)
            return await self._in_thread(det.score_reasoning_gym, spec, completion)
        return infra(f"unsupported verifier kind {getattr(spec, 'kind', type(spec).__name__)!r}", misconfigured=True)

    async def _in_pool(self, fn, *args) -> CheckResult:
        """``fn(*args)`` in the CPU pool, bounded by ``check_timeout_s`` (a stuck worker is killed)."""
        try:
            pool = await self._get_pool()
        except (asyncio.TimeoutError, concurrent.futures.process.BrokenProcessPool, OSError) as e:
            return infra(f"CPU pool did not start: {e!r}")
        async with self._math_slots:
            fut = pool.submit(fn, *args)
            try:
                score, details, infra_error = await asyncio.wait_for(asyncio.wrap_future(fut),
                                                                      timeout=self.cfg.check_timeout_s)
            except asyncio.TimeoutError:
                self._kill_pool(pool)
                return infra(f"{fn.__name__} exceeded {self.cfg.check_timeout_s} s")
            except concurrent.futures.process.BrokenProcessPool as e:
                self._kill_pool(pool)
                return infra(f"CPU pool worker died: {e!r}")
        return CheckResult(score, details, infra_error)

    async def _in_thread(self, fn, *args) -> CheckResult:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout=self.cfg.check_timeout_s)
        except asyncio.TimeoutError:
            return infra(f"{getattr(fn, '__name__', fn)} exceeded {self.cfg.check_timeout_s} s")

    # ------------------------------------------------------------ math

    async def _get_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        async with self._pool_lock:
            if self._pool is None:
                # spawn, not fork: the service process has threads (aiokafka, httpx, to_thread).
                ctx = multiprocessing.get_context("spawn")
                pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=self.cfg.math_workers, mp_context=ctx, initializer=_math_worker_init
                )
                t0 = time.perf_counter()
                # Warm every worker (spawn + sympy import take seconds) outside the per-call bound.
                warm = [pool.submit(_math_worker_ping) for _ in range(self.cfg.math_workers)]
                await asyncio.wait_for(asyncio.gather(*map(asyncio.wrap_future, warm)), timeout=120)
                log.info("math-verify pool of %d started in %.2f s", self.cfg.math_workers, time.perf_counter() - t0)
                self._pool = pool
            return self._pool

    async def _pool_healthy(self) -> bool:
        """Whether a fresh pool compares ``1`` with ``1`` in time (tells a slow answer from a broken pool)."""
        pool = None
        try:
            pool = await self._get_pool()
            fut = pool.submit(math_verify_compare, "1", "1", False)
            res = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=max(10.0, self.cfg.math_timeout_s))
            return bool(res.get("ok"))
        except Exception:  # noqa: BLE001 - any failure means the pool is not healthy
            if pool is not None:
                self._kill_pool(pool)  # never leave a stuck worker behind
            return False

    def _kill_pool(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        if self._pool is pool:
            self._pool = None
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        pool.shutdown(wait=False, cancel_futures=True)

    async def score_math(self, spec: MathSpec, completion: str) -> CheckResult:
        """math-verify equivalence of the gold and the model answer, bounded by ``math_timeout_s``.

        The answer is the last ``\\boxed{}`` when present, else math-verify's own extraction over
        the full text, else the last number. A pool timeout or crash is infra_error (the pool is
        recreated); an unparseable model answer is 0; an unparseable gold is infra_error with
        ``details.misconfigured``.
        """
        completion = strip_reasoning(completion)
        if not completion.strip():
            return ok_if(False, extracted=None, reason="empty completion (outside any reasoning block)")
        boxed = extract_boxed(completion)
        candidates: list[tuple[str, bool, str]] = []
        if boxed is not None:
            candidates.append((boxed, True, "boxed"))
        else:
            candidates.append((completion, False, "full"))
            num = extract_last_number(completion)
            if num is not None:
                candidates.append((num, False, "last_number"))
        res: dict[str, Any] = {}
        used, how = "", ""
        for used, is_boxed, how in candidates:
            try:
                pool = await self._get_pool()
            except (asyncio.TimeoutError, concurrent.futures.process.BrokenProcessPool, OSError) as e:
                return infra(f"math-verify pool did not start: {e!r}")
            async with self._math_slots:
                fut = pool.submit(math_verify_compare, spec.answer, used, is_boxed)
                try:
                    res = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=self.cfg.math_timeout_s)
                except asyncio.TimeoutError:
                    self._kill_pool(pool)
                    if await self._pool_healthy():  # the pool works: this answer is what takes too long
                        return ok_if(False, extracted=clip(used), reason=f"the answer took longer than "
                                     f"{self.cfg.math_timeout_s} s to compare (e.g. a huge power tower)")
                    return infra(f"math-verify exceeded {self.cfg.math_timeout_s} s", extracted=clip(used))
                except concurrent.futures.process.BrokenProcessPool as e:
                    self._kill_pool(pool)
                    return infra(f"math-verify worker died: {e!r}", extracted=clip(used))
                except Exception as e:  # noqa: BLE001 - sympy raising on the model's answer
                    res = {"ok": False, "error": f"{type(e).__name__}: {e}", "gold_unparsed": False}
            if res.get("gold_unparsed"):
                return infra(res["error"], misconfigured=True)
            if res.get("answer_parsed") is not None:
                break  # parsed: this candidate decides
        details = {
            k: (clip(v) if isinstance(v, str) else v) for k, v in res.items() if k not in ("ok", "gold_unparsed")
        }
        return ok_if(bool(res.get("ok")), extracted=clip(used), extracted_by=how, **details)

    # ------------------------------------------------------------ unit tests

    def build_request(self, spec: UnitTestsSpec, completion: str, timeout_s: float) -> dict:
        """The sandbox request in test-harness mode: ``prefix`` + the completion's code as the solution,
        ``spec.tests`` as one test (``check(entry_point)`` is called by the harness when set)."""
        code = spec.prefix + extract_code(completion)
        tests = ([{"name": "tests", "code": spec.tests}] if isinstance(spec.tests, str)
                 else [t.model_dump() for t in spec.tests])
        req = {"code": code, "tests": tests, "timeout_s": timeout_s}
        if spec.entry_point:
            req["entry_point"] = spec.entry_point
        return req

    async def score_unit_tests(self, spec: UnitTestsSpec, completion: str) -> CheckResult:
        """Run the completion's code against ``spec.tests`` in the sandbox's test-harness mode (``POST {sandbox_url}/v1/execute``).

        Passed iff every test reports ``passed`` over the sandbox's private result channel (never from
        the program's stdout or exit code, so ``sys.exit(0)`` or a printed "passed" cannot pass).
        Unreachable sandbox, HTTP errors (503 included) and status ``infra_error`` give infra_error;
        timeouts and limits of the program give 0. The W3C trace context travels in the request headers.
        """
        timeout_s = spec.timeout_s or self.cfg.code_timeout_s
        if self._http is None:
            self._http = httpx.AsyncClient(base_url=self.cfg.sandbox_url.rstrip("/"))
        headers: dict[str, str] = {}
        propagate.inject(headers)
        try:
            r = await self._http.post(
                "/v1/execute", json=self.build_request(spec, completion, timeout_s), headers=headers,
                timeout=httpx.Timeout(timeout_s + 30.0, connect=5.0),
            )
        except httpx.HTTPError as e:
            return infra(f"sandbox unreachable: {type(e).__name__}: {e}", sandbox_url=self.cfg.sandbox_url)
        if r.status_code != 200:
            return infra(f"sandbox answered HTTP {r.status_code}", body=clip(r.text))
        try:
            body = r.json()
            status = body["status"]
            tests = body.get("tests") or []
        except (ValueError, KeyError, TypeError) as e:
            return infra(f"sandbox answered malformed JSON: {e!r}", body=clip(r.text))
        details = {
            "status": status, "exit_code": body.get("exit_code"), "run_id": body.get("run_id"),
            "stdout": clip(body.get("stdout")), "stderr": clip(body.get("stderr")),
            "tests": [{k: (clip(v) if isinstance(v, str) else v) for k, v in t.items()} for t in tests],
        }
        if status == "infra_error":
            return infra("sandbox infrastructure error", **details)
        n_passed = sum(t.get("status") == "passed" for t in tests)
        passed = bool(tests) and n_passed == len(tests)
        if not passed and tests:
            details["reason"] = "; ".join(f"{t.get('name')}: {t.get('status')}" for t in tests if t.get("status") != "passed")
        details["tests_passed"] = n_passed
        if spec.partial_credit and tests:
            return CheckResult(n_passed / len(tests), details)
        return ok_if(passed, **details)

    # ------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Close the HTTP clients and stop the math pool (killing a worker stuck in sympy)."""
        await self.judge.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._pool is not None:
            self._kill_pool(self._pool)
