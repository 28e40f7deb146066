"""The verifier's dispatcher: runs the layers of a task's recipe and composes them into a Reward
(DESIGN.md, "Verification layers").

1. Deterministic (``correctness``): :mod:`verifier_service.deterministic` for the in-process kinds;
   here, ``math`` (math-verify in a process pool with our own time bound) and ``unit_tests`` (the
   sandbox's test-harness mode over HTTP).
2. Rules (:mod:`verifier_service.rules`): format, tool protocol, safety, truncation.
3. Judge (:mod:`verifier_service.judge`): a rubric scored over an OpenAI-compatible endpoint.

Then :func:`compose` applies the recipe's gates and weights; reward-hacking detectors
(:mod:`verifier_service.hacks`, hedging judged against the spec's gold) are flagged in the details and
zero the total unless the recipe's ``hack_policy`` is ``flag`` (``judge_injection`` zeroes only a task
whose recipe has a judge: elsewhere no grader reads the words, so it is only flagged). The resulting :class:`Reward`:

* ``components``: every layer computed, each in [0, 1];
* ``total``: 0 when a gate failed, else the weighted mean of the weighted components;
* ``details``: the correctness layer's details at the top level (what was extracted, raw score,
  errors), ``rules`` and ``judge`` details, ``gated_by``, ``hacks`` and ``zeroed_by`` (the hacks that
  zeroed the total);
* ``infra_error``: True only when *our* side failed (sandbox unreachable, math-verify pool timed out
  or died, judge down or unparsable, misconfigured spec). Never a 0: the service retries it and
  then passes it on flagged. A model answer that makes a scorer raise is the model's fault: 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import multiprocessing
import re
import time
from typing import Any

import httpx
from opentelemetry import propagate

from shared.auth import token_from_run_dir
from shared.client import SANDBOX_RETRY_S, ApiStatusError, ApiUnreachable, AsyncApiClient, RetryPolicy, Token
from shared.verifier_specs import (
    EnvironmentSpec, ExactSpec, GeometrySpec, JsonFieldsSpec, MathSpec, NumericSpec, ReasoningGymSpec, Recipe,
    RegexSpec, UnitTestsSpec,
)
from shared.schemas import Reward
from verifier_service import deterministic as det
from verifier_service.config import VerifierConfig
from verifier_service.deterministic import CheckResult, infra, ok_if
from verifier_service.environments import EnvironmentScorer, kill_pool
from verifier_service.extract import (
    clip, extract_code, math_candidates, normalise_math_text, stated_answer, strip_reasoning,
)
from verifier_service.hacks import detect_hacks, zeroing_hacks
from verifier_service.hacks.gold import gold_shape
from verifier_service.judge import JudgeClient
from verifier_service.rules import run_rules

log = logging.getLogger(__name__)

LAYER = "correctness"
"""Name of the deterministic layer in ``Reward.components``."""

CODE_KINDS = (UnitTestsSpec,)
"""Spec kinds scored by running the response's code (the test-tampering detector applies)."""

SLOW_REASONING_GYM = frozenset(det.SLOW_SCORERS)
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
    zeroing = zeroing_hacks(hacks, recipe.judge is not None)  # judge injection zeroes only a judged task
    if zeroing and recipe.hack_policy == "zero":  # the default: a detected hack earns nothing
        details["zeroed_by"] = zeroing
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


MATH_OPTIONS = ("extraction", "boxed_match_priority", "float_rounding", "numeric_precision", "strict",
                "allow_set_relation_comp")
"""The :class:`MathSpec` fields passed to the worker (math-verify's options; see their docstrings)."""

_GOLD_DELIMITERS = re.compile(r"\$|\\\(|\\\[|\\boxed|\\begin\{")
_ESCAPED_BRACE = re.compile(r"\\[{}]")


def _targets(extraction: tuple[str, ...], boxed_match_priority: int) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=boxed_match_priority) if t == "latex"
            else ExprExtractionConfig() for t in extraction]


def _unbalanced(text: str) -> bool:
    """Whether the braces of ``text`` do not balance (``\\{``, ``\\}`` not counted)."""
    bare = _ESCAPED_BRACE.sub("", text)
    return bare.count("{") != bare.count("}")


def _gold_fragment(gold: str, matched: str, expr_only: bool) -> str | None:
    """Why math-verify's reading ``matched`` (the text it parsed) is only part of ``gold``, or None.

    A reading whose braces do not balance was cut short. A plain gold read with ``ExprExtractionConfig``
    alone (``expr_only``) must keep every digit of the gold, in order: that reader takes one number out
    of a text (``(1, 2)`` gives ``2``, ``3.5e3`` gives ``3.5``). A LaTeX reading of a plain gold is whole
    by construction (the boxed content; math-verify may rewrite it, ``0.5`` as ``\\frac{1}{2}``).
    """
    if _unbalanced(matched) or (expr_only and [c for c in gold if c.isdigit()] != [c for c in matched if c.isdigit()]):
        return f"math-verify reads only {matched!r} of the gold answer {gold!r}"
    return None


@functools.lru_cache(maxsize=1024)  # a group's K completions share one gold: parse it once per worker
def _read_gold(gold: str, latex: bool) -> tuple[list, str | None]:
    """math-verify's reading of ``gold`` (``[sympy value, matched text]``) and why it is not a complete
    expression (None when it is: the task is then misconfigured, see :meth:`Scorer.score_math`).

    A plain gold is read whole as LaTeX (as ``\\boxed{gold}``), or with ``ExprExtractionConfig`` alone
    when the spec has no ``latex`` target; a delimited gold (``$``, ``\\(``, ``\\[``, ``\\boxed``,
    ``\\begin{``) is read as math-verify reads an answer. Only math-verify's first match is tried
    (``extraction_mode="first_match"``): a gold whose math does not parse is reported, not replaced by
    a number found elsewhere in it (``$1 - \\frac{1}{\\mathrm{e}}$`` would otherwise read as 1). Not
    complete: unbalanced braces (``\\boxed{W(n) = 1``), no expression, or a fragment
    (:func:`_gold_fragment`).
    """
    from math_verify import parse

    if _unbalanced(gold):
        return [], f"gold answer {gold!r} has unbalanced braces"
    delimited = bool(_GOLD_DELIMITERS.search(gold))
    text = gold if delimited or not latex else f"\\boxed{{{gold}}}"
    targets = _targets(("latex", "expr") if latex else ("expr",), 0)
    got = parse(text, targets, extraction_mode="first_match", parsing_timeout=None)
    if not any(not isinstance(x, str) for x in got):
        return got, f"gold answer {gold!r} does not parse" + (f" (math-verify reads {got[-1]!r})" if got else "")
    matched = next((x for x in got if isinstance(x, str)), "")
    return got, _gold_fragment(gold, matched, not delimited and not latex) if matched else None


def math_verify_compare(gold: str, body: str, options: dict[str, Any]) -> dict[str, Any]:
    """Compare the model's answer in ``body`` (the completion after any reasoning block) with ``gold``
    using math-verify without its signal-based timeouts.

    Runs in the worker process of :class:`Scorer` (plain picklable values in and out), so that all of
    the reading, ours included, is under the pool's time bound. ``body`` is normalised first
    (:func:`normalise_math_text`: Unicode minus signs, ``\\fbox``); a stated answer
    (:func:`stated_answer`) is then the only reading, or rejects the completion (score 0, ``error``
    says why, ``extracted_by`` is ``statement``). Otherwise the readings of ``body`` are
    :func:`math_candidates`, tried in order; the first in which math-verify finds an answer decides,
    parsed or not (an unparseable one is compared as text, as math-verify does): a later, looser
    reading is only a fallback for text math-verify finds nothing in, never a second chance (``$-[0,1)$`` is not read as its last number 1). One decision, so a
    completion that hedges between readings gains nothing. ``options`` holds the :data:`MATH_OPTIONS`.

    Returns ``{"ok": bool, "gold_parsed": str | None, "answer_parsed": str | None, "extracted": str | None,
    "extracted_by": how | None, "error": str | None, "gold_unparsed": bool}`` (``extracted``: the text
    math-verify read; None fields when no reading found anything); ``gold_unparsed`` True means the
    gold itself does not parse whole (the task is misconfigured).
    """
    from math_verify import parse, verify

    out: dict[str, Any] = {"ok": False, "error": None, "gold_unparsed": False, "gold_parsed": None,
                           "answer_parsed": None, "extracted": None, "extracted_by": None}
    extraction = tuple(options["extraction"])
    gold_p, err = _read_gold(gold, "latex" in extraction)
    out["gold_parsed"] = str(gold_p[0]) if gold_p else None
    if err:
        out.update(error=err, gold_unparsed=True)
        return out
    targets = _targets(extraction, options["boxed_match_priority"])
    body = normalise_math_text(body)
    stated, rejected = stated_answer(body, gold)
    if rejected:
        out.update(error=rejected, extracted_by="statement")
        return out
    readings = [("statement", stated)] if stated is not None else math_candidates(body, options)
    for how, text in readings:
        ans_p = parse(text, targets, parsing_timeout=None)
        if ans_p:  # math-verify found the answer here, parsed or only as text: it decides
            break
    else:
        out["error"] = "no answer found in the completion"
        return out
    parsed = next((x for x in ans_p if not isinstance(x, str)), None)
    out.update(extracted_by=how, answer_parsed=None if parsed is None else str(parsed),
               extracted=next((x for x in ans_p if isinstance(x, str)), str(parsed)))
    if parsed is None:
        out["error"] = "model answer does not parse"
    out["ok"] = bool(verify(gold_p, ans_p, float_rounding=options["float_rounding"],
                            numeric_precision=options["numeric_precision"], strict=options["strict"],
                            allow_set_relation_comp=options["allow_set_relation_comp"], timeout_seconds=None))
    return out


# ---------------------------------------------------------------- the dispatcher


class Scorer:
    """Runs a task's recipe on a completion; owns the math pool, the sandbox and judge HTTP clients.

    Use from one asyncio event loop (any thread). Call :meth:`close` when done. Scoring never
    raises for the model's or the infrastructure's failures: both come back as a Reward.

    ``token`` is the bearer token sent to the sandbox (or a function returning it); None:
    ``$FLYWHEEL_AUTH__TOKEN``, else the file ``$FLYWHEEL_AUTH__TOKEN_FILE`` (set by the launcher), read at
    each request until found.
    """

    def __init__(self, cfg: VerifierConfig, token: Token = None) -> None:
        self.cfg = cfg
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pool_lock = asyncio.Lock()
        self._math_slots = asyncio.Semaphore(cfg.math_workers)
        self._token = token if token is not None else (lambda: token_from_run_dir(None))
        self._http: AsyncApiClient | None = None
        self.judge = JudgeClient(cfg.judge)
        self.environments = EnvironmentScorer(cfg)

    def recipe_for(self, spec: Any, domain: str | None) -> Recipe:
        """The task's own recipe, else the service's recipe for ``domain``, else the default recipe (safe: the
        truncation gate, hacks zeroed). A task recipe that only opts out (``{reason: ...}``,
        :attr:`~shared.verifier_specs.Recipe.opts_out`) takes the domain's recipe, else correctness alone."""
        own = spec.recipe
        if own is not None and not own.opts_out:
            return own
        return self.cfg.recipes.get(domain or "", None) or own or self.cfg.default_recipe

    async def score(self, spec: Any, completion: str, *, finish_reason: str = "stop",
                    prompt: list[dict[str, str]] | None = None, tools: list[str] | tuple = (),
                    domain: str | None = None, cost: dict[str, float] | None = None,
                    rollout: dict[str, Any] | None = None) -> Reward:
        """Score ``completion`` against ``spec`` (any ``shared.verifier_specs.VerifierSpec``) under its recipe.

        ``finish_reason`` feeds the truncation rule, ``prompt`` the judge, ``tools`` the tool-protocol
        rule (the task's allowed tools), ``domain`` picks the service's per-domain recipe. ``cost``, when
        given, is added to: ``sandbox_seconds`` (wall seconds of the unit-test requests to the sandbox)
        and ``judge_calls`` (requests sent to the judge), each key present once such a call was made.
        ``rollout`` is what an environment's rewards see of a multi-turn rollout
        (:func:`verifier_service.main.rollout_context`).

        Raises:
            asyncio.CancelledError: when cancelled (nothing else).
        """
        try:
            recipe = self.recipe_for(spec, domain)
            correctness = await self.check(spec, completion, cost=cost, prompt=prompt, rollout=rollout)
            rules = run_rules(recipe.rules, completion, finish_reason, list(tools)) if recipe.rules else {}
            hacks = detect_hacks(completion, isinstance(spec, CODE_KINDS), gold_shape(spec))
            judge = None
            so_far = {LAYER: correctness.score, **{k: v.score for k, v in rules.items()}}
            zeroed = bool(zeroing_hacks(hacks, recipe.judge is not None)) and recipe.hack_policy == "zero"
            if recipe.judge is not None and not correctness.infra_error and not failed_gates(recipe, so_far) \
                    and not zeroed:  # a failed gate or a detected hack zeroes the reward: the judge's call would be wasted
                judge = await asyncio.wait_for(self.judge.score(recipe.judge, prompt or [], completion, cost=cost),
                                               timeout=self.cfg.judge.timeout_s + 5)
            return compose(recipe, correctness, rules, judge, hacks)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            return Reward(total=0.0, infra_error=True, details={"reason": "judge timed out"})
        except Exception as e:  # noqa: BLE001 - a bug of ours: flag it, never a 0 reward
            log.exception("scorer failed on %s", getattr(spec, "kind", spec))
            return Reward(total=0.0, infra_error=True, details={"reason": f"scorer crashed: {type(e).__name__}: {e}"})

    async def check(self, spec: Any, completion: str, cost: dict[str, float] | None = None,
                    prompt: list[dict[str, str]] | None = None, rollout: dict[str, Any] | None = None) -> CheckResult:
        """The deterministic layer (``correctness``) for ``spec``.

        In-process kinds run inline when cheap (exact, numeric, json_fields, geometry, a cached
        reasoning-gym dataset) and in a worker thread bounded by ``check_timeout_s`` otherwise; a user
        environment's rubric runs in that environment's process pool (``prompt`` is what its rewards see).
        ``cost`` as in :meth:`score` (``unit_tests`` adds its ``sandbox_seconds``).
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
            return await self.score_unit_tests(spec, completion, cost=cost)
        if isinstance(spec, RegexSpec):
            return await self._in_thread(det.score_regex, spec, completion, self.cfg.regex_timeout_s)
        if isinstance(spec, EnvironmentSpec):
            return await self.environments.score(spec, completion, prompt, rollout)
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
            options = MathSpec(answer="1").model_dump(include=set(MATH_OPTIONS))
            fut = pool.submit(math_verify_compare, "1", "1", options)
            res = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=max(10.0, self.cfg.math_timeout_s))
            return bool(res.get("ok"))
        except Exception:  # noqa: BLE001 - any failure means the pool is not healthy
            if pool is not None:
                self._kill_pool(pool)  # never leave a stuck worker behind
            return False

    def _kill_pool(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        if self._pool is pool:
            self._pool = None
        kill_pool(pool)

    async def score_math(self, spec: MathSpec, completion: str) -> CheckResult:
        """math-verify equivalence of the gold and the model answer, bounded by ``math_timeout_s``.

        The answer is read from the completion after any reasoning block: its stated answer
        (:func:`stated_answer`: the last "the answer is …" after the last box, or a bare last line),
        else in the order of :func:`math_candidates` (the whole text with math-verify, then the last
        ``\\boxed{}``, then the last number standing as a word), all in one worker call; the first
        reading in which math-verify finds an answer decides.
        The spec's math-verify options (:data:`MATH_OPTIONS`) apply to every reading.

        Returns 1 or 0 with details ``extracted`` (the text math-verify read), ``extracted_by``,
        ``answer_parsed``, ``gold_parsed`` and ``error``. A pool timeout or crash is infra_error (the
        pool is recreated), unless a fresh pool compares fine, in which case the answer itself is too
        slow and scores 0; an unparseable model answer is 0; a gold that does not parse whole
        (:func:`_read_gold`) is infra_error with ``details.misconfigured``.
        """
        body = strip_reasoning(completion)
        if not body.strip():
            return ok_if(False, extracted=None, reason="empty completion (outside any reasoning block)")
        options = spec.model_dump(include=set(MATH_OPTIONS))
        try:
            pool = await self._get_pool()
        except (asyncio.TimeoutError, concurrent.futures.process.BrokenProcessPool, OSError) as e:
            return infra(f"math-verify pool did not start: {e!r}")
        async with self._math_slots:
            fut = pool.submit(math_verify_compare, spec.answer, body, options)
            try:
                res = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=self.cfg.math_timeout_s)
            except asyncio.TimeoutError:
                self._kill_pool(pool)
                if await self._pool_healthy():  # the pool works: this answer is what takes too long
                    return ok_if(False, extracted=clip(body), reason=f"the answer took longer than "
                                 f"{self.cfg.math_timeout_s} s to compare (e.g. a huge power tower)")
                return infra(f"math-verify exceeded {self.cfg.math_timeout_s} s", extracted=clip(body))
            except concurrent.futures.process.BrokenProcessPool as e:
                self._kill_pool(pool)
                return infra(f"math-verify worker died: {e!r}", extracted=clip(body))
            except Exception as e:  # noqa: BLE001 - sympy raising on the model's answer
                res = {"ok": False, "error": f"{type(e).__name__}: {e}", "gold_unparsed": False}
        if res.get("gold_unparsed"):
            return infra(res["error"], misconfigured=True, gold_parsed=res.get("gold_parsed"))
        details = {k: (clip(v) if isinstance(v, str) else v) for k, v in res.items() if k not in ("ok", "gold_unparsed")}
        return ok_if(bool(res.get("ok")), **details)

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

    async def score_unit_tests(self, spec: UnitTestsSpec, completion: str,
                               cost: dict[str, float] | None = None) -> CheckResult:
        """Run the completion's code against ``spec.tests`` in the sandbox's test-harness mode (``POST {sandbox_url}/v1/execute``).

        Passed iff every test reports ``passed`` over the sandbox's private result channel (never from
        the program's stdout or exit code, so ``sys.exit(0)`` or a printed "passed" cannot pass).
        Unreachable sandbox, HTTP errors (503 included) and status ``infra_error`` give infra_error;
        timeouts and limits of the program give 0. Within the request's time limit (``timeout_s + 30``
        seconds in all) a refused connection (the sandbox restarting) and 503 (it admits no execution now)
        are retried with backoff for up to ``shared.client.SANDBOX_RETRY_S``; a timeout after the request
        was sent is not (the program would run twice). The
        system's bearer token and the W3C trace context travel in the request headers. The request's wall
        seconds, answered or not, are added to ``cost["sandbox_seconds"]`` when ``cost`` is given.
        """
        timeout_s = spec.timeout_s or self.cfg.code_timeout_s
        if self._http is None:
            self._http = AsyncApiClient(self.cfg.sandbox_url, self._token,
                                        retry=RetryPolicy(retry_for_s=SANDBOX_RETRY_S, max_backoff_s=2.0))
        headers: dict[str, str] = {}
        propagate.inject(headers)
        t0 = time.perf_counter()
        try:
            r = await self._http.request(
                "POST", "/v1/execute", json=self.build_request(spec, completion, timeout_s), headers=headers,
                timeout=httpx.Timeout(timeout_s + 30.0, connect=5.0), deadline_s=timeout_s + 30.0,
            )
        except ApiStatusError as e:
            return infra(f"sandbox answered HTTP {e.status_code}", body=clip(e.detail))
        except ApiUnreachable as e:
            return infra(f"sandbox unreachable: {e}", sandbox_url=self.cfg.sandbox_url, http_attempts=e.attempts)
        except httpx.HTTPError as e:
            return infra(f"sandbox unreachable: {type(e).__name__}: {e}", sandbox_url=self.cfg.sandbox_url)
        finally:
            if cost is not None:
                cost["sandbox_seconds"] = cost.get("sandbox_seconds", 0.0) + time.perf_counter() - t0
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
        """Close the HTTP clients and stop the math pool (killing a worker stuck in sympy) and the environments'
        reward pools."""
        await self.judge.close()
        await self.environments.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._pool is not None:
            self._kill_pool(self._pool)
