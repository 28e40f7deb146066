"""Deterministic scorers, one per verifier spec kind (DESIGN.md, "Verification layers", layer 1).

Every scorer returns a :class:`shared.schemas.Reward`:

* ``total`` is 1.0 or 0.0 (strict: no partial credit reaches the trainer);
* ``components`` names the layer, ``{"correctness": total}``;
* ``details`` carries what was extracted, the raw score and any error text;
* ``infra_error`` is True only when *our* side failed (sandbox unreachable, math-verify pool
  timed out or died, misconfigured spec). Such a reward is never a 0: the service retries it and
  then passes it on flagged. A model answer that makes a scorer raise is the model's fault: 0.

The pure helpers (``extract_*``, :func:`score_exact`, :func:`score_regex`,
:func:`score_reasoning_gym`) are synchronous and thread-safe; :class:`Scorer` holds the
resources (reasoning-gym dataset cache, math-verify process pool, HTTP client) and dispatches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import re
import threading
import time
from typing import Any

import httpx
import regex
from opentelemetry import propagate

from shared.schemas import ExactSpec, MathSpec, ReasoningGymSpec, RegexSpec, Reward, UnitTestsSpec
from verifier_service.config import VerifierConfig

log = logging.getLogger(__name__)

LAYER = "correctness"
"""Name of the deterministic layer in ``Reward.components``."""

_DETAIL_TEXT_LIMIT = 2000  # characters of stdout/stderr/exception text kept in details


def _reward(ok: bool, **details: Any) -> Reward:
    total = 1.0 if ok else 0.0
    return Reward(total=total, components={LAYER: total}, details=details)


def _infra(reason: str, **details: Any) -> Reward:
    return Reward(total=0.0, components={}, details={"reason": reason, **details}, infra_error=True)


def _clip(text: str | None) -> str:
    text = text or ""
    return text if len(text) <= _DETAIL_TEXT_LIMIT else text[:_DETAIL_TEXT_LIMIT] + "...[truncated]"


# ---------------------------------------------------------------- extraction

# A minus sign counts only when it is not a binary operator ("5-3" gives 5 and 3, "= -3" gives -3).
_NUMBER = re.compile(r"(?:(?<![\w)\]}.])-)?\d(?:[\d,]*\d)?(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_PY_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_last_number(text: str) -> str | None:
    """Last integer or decimal in ``text`` with thousands commas removed ("1,234." gives "1234"), or None."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer_tag(text: str) -> str | None:
    """Stripped content of the last ``<answer>...</answer>`` in ``text``, or None."""
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def extract_boxed(text: str) -> str | None:
    """Stripped content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        i = start + len("\\boxed{")
        depth = 1
        while i < len(text):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len("\\boxed{") : i].strip()
            i += 1
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


def extract_answer(text: str, how: str) -> str | None:
    """Answer taken from a completion by ``how`` (``last_number``, ``answer_tag``, ``boxed``, ``full``).

    Returns None when nothing matches (``full`` gives None for blank text).

    Raises:
        ValueError: unknown ``how``.
    """
    if how == "last_number":
        return extract_last_number(text)
    if how == "answer_tag":
        return extract_answer_tag(text)
    if how == "boxed":
        return extract_boxed(text)
    if how == "full":
        return text.strip() or None
    raise ValueError(f"unknown extraction {how!r}")


def extract_code(text: str) -> str:
    """Code of a completion: the last ```python fenced block, else the last bare ``` block, else the text."""
    blocks = _PY_FENCE.findall(text) or _FENCE.findall(text)
    return blocks[-1] if blocks else text


# ---------------------------------------------------------------- trivial kinds


def score_exact(spec: ExactSpec, completion: str) -> Reward:
    """1 when the stripped completion equals the stripped ``spec.answer`` (case-folded unless case_sensitive)."""
    got, want = completion.strip(), spec.answer.strip()
    if not spec.case_sensitive:
        got, want = got.casefold(), want.casefold()
    return _reward(got == want, extracted=_clip(completion.strip()))


def score_regex(spec: RegexSpec, completion: str, timeout_s: float = 1.0) -> Reward:
    """1 when ``regex.search(spec.pattern, completion)`` matches; the match text goes to details.

    A match that runs longer than ``timeout_s`` seconds (catastrophic backtracking on this completion)
    is reward 0 with the error in the details, like a scorer that raises on a model's answer.
    """
    try:
        m = regex.search(spec.pattern, completion, timeout=timeout_s)
    except TimeoutError:
        return _reward(False, error=f"regex match timed out after {timeout_s} s")
    return _reward(m is not None, match=_clip(m.group(0)) if m else None)


# ---------------------------------------------------------------- reasoning-gym

_rg_cache: dict[str, Any] = {}
_rg_lock = threading.Lock()


def reasoning_gym_dataset(name: str) -> Any:
    """The reasoning-gym dataset ``name`` (size 1, seed 0), created once per process and cached.

    Raises:
        Exception: whatever ``reasoning_gym.create_dataset`` raises for an unknown or broken name.
    """
    ds = _rg_cache.get(name)
    if ds is None:
        with _rg_lock:
            ds = _rg_cache.get(name)
            if ds is None:
                import reasoning_gym

                ds = reasoning_gym.create_dataset(name, size=1, seed=0)
                _rg_cache[name] = ds
    return ds


def score_reasoning_gym(spec: ReasoningGymSpec, completion: str) -> Reward:
    """Strictly extract the answer, score it with the dataset's own scorer; 1 only for a score of exactly 1.0.

    Blocking (dataset creation can take seconds the first time): call it from a worker thread in
    async code. An unknown dataset is a misconfiguration: infra_error with ``details.misconfigured``.
    """
    answer = extract_answer(completion, spec.extract)
    if answer is None:
        return _reward(False, extracted=None, reason=f"no answer found by extract={spec.extract}")
    try:
        ds = reasoning_gym_dataset(spec.dataset)
    except Exception as e:  # noqa: BLE001 - any failure here is ours, not the model's
        return _infra(f"cannot create reasoning-gym dataset {spec.dataset!r}: {e!r}", misconfigured=True)
    try:
        raw = ds.score_answer(answer, entry=spec.entry)
    except Exception as e:  # noqa: BLE001 - the model's answer broke the scorer: its fault
        return _reward(False, extracted=_clip(answer), error=_clip(f"{type(e).__name__}: {e}"))
    try:
        raw_f = float(raw)
    except (TypeError, ValueError):
        return _reward(False, extracted=_clip(answer), error=f"scorer returned non-number {raw!r}")
    return _reward(raw_f == 1.0, extracted=_clip(answer), raw_score=raw_f)


# ---------------------------------------------------------------- math (runs in a worker process)


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
    """Scores a completion against a verifier spec; owns the math pool and the sandbox HTTP client.

    Use from one asyncio event loop (any thread). Call :meth:`close` when done. Scoring never
    raises for the model's or the infrastructure's failures: both come back as a Reward.
    """

    def __init__(self, cfg: VerifierConfig) -> None:
        self.cfg = cfg
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pool_lock = asyncio.Lock()
        self._math_slots = asyncio.Semaphore(cfg.math_workers)
        self._http: httpx.AsyncClient | None = None

    async def score(self, spec: Any, completion: str) -> Reward:
        """Score ``completion`` against ``spec`` (any ``shared.schemas.VerifierSpec``).

        Raises:
            asyncio.CancelledError: when cancelled (nothing else).
        """
        try:
            if isinstance(spec, RegexSpec):
                return await asyncio.to_thread(score_regex, spec, completion, self.cfg.regex_timeout_s)
            if isinstance(spec, ExactSpec):
                return score_exact(spec, completion)
            if isinstance(spec, ReasoningGymSpec):
                return await asyncio.to_thread(score_reasoning_gym, spec, completion)
            if isinstance(spec, MathSpec):
                return await self.score_math(spec, completion)
            if isinstance(spec, UnitTestsSpec):
                return await self.score_unit_tests(spec, completion)
            return _infra(f"unsupported verifier kind {getattr(spec, 'kind', type(spec).__name__)!r}",
                          misconfigured=True)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug of ours: flag it, never a 0 reward
            log.exception("scorer failed on %s", getattr(spec, "kind", spec))
            return _infra(f"scorer crashed: {type(e).__name__}: {e}")

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

    def _kill_pool(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        if self._pool is pool:
            self._pool = None
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        pool.shutdown(wait=False, cancel_futures=True)

    async def score_math(self, spec: MathSpec, completion: str) -> Reward:
        """math-verify equivalence of the gold and the model answer, bounded by ``math_timeout_s``.

        The answer is the last ``\\boxed{}`` when present, else math-verify's own extraction over
        the full text, else the last number. A pool timeout or crash is infra_error (the pool is
        recreated); an unparseable model answer is 0; an unparseable gold is infra_error with
        ``details.misconfigured``.
        """
        if not completion.strip():
            return _reward(False, extracted=None, reason="empty completion")
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
                return _infra(f"math-verify pool did not start: {e!r}")
            async with self._math_slots:
                fut = pool.submit(math_verify_compare, spec.answer, used, is_boxed)
                try:
                    res = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=self.cfg.math_timeout_s)
                except asyncio.TimeoutError:
                    self._kill_pool(pool)
                    return _infra(f"math-verify exceeded {self.cfg.math_timeout_s} s", extracted=_clip(used))
                except concurrent.futures.process.BrokenProcessPool as e:
                    self._kill_pool(pool)
                    return _infra(f"math-verify worker died: {e!r}", extracted=_clip(used))
                except Exception as e:  # noqa: BLE001 - sympy raising on the model's answer
                    res = {"ok": False, "error": f"{type(e).__name__}: {e}", "gold_unparsed": False}
            if res.get("gold_unparsed"):
                return _infra(res["error"], misconfigured=True)
            if res.get("answer_parsed") is not None:
                break  # parsed: this candidate decides
        details = {
            k: (_clip(v) if isinstance(v, str) else v) for k, v in res.items() if k not in ("ok", "gold_unparsed")
        }
        return _reward(bool(res.get("ok")), extracted=_clip(used), extracted_by=how, **details)

    # ------------------------------------------------------------ unit tests

    def build_request(self, spec: UnitTestsSpec, completion: str, timeout_s: float) -> dict:
        """The sandbox request in test-harness mode: ``prefix`` + the completion's code as the solution,
        ``spec.tests`` as one test (``check(entry_point)`` is called by the harness when set)."""
        code = spec.prefix + extract_code(completion)
        req = {"code": code, "tests": [{"name": "tests", "code": spec.tests}], "timeout_s": timeout_s}
        if spec.entry_point:
            req["entry_point"] = spec.entry_point
        return req

    async def score_unit_tests(self, spec: UnitTestsSpec, completion: str) -> Reward:
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
            return _infra(f"sandbox unreachable: {type(e).__name__}: {e}", sandbox_url=self.cfg.sandbox_url)
        if r.status_code != 200:
            return _infra(f"sandbox answered HTTP {r.status_code}", body=_clip(r.text))
        try:
            body = r.json()
            status = body["status"]
            tests = body.get("tests") or []
        except (ValueError, KeyError, TypeError) as e:
            return _infra(f"sandbox answered malformed JSON: {e!r}", body=_clip(r.text))
        details = {
            "status": status, "exit_code": body.get("exit_code"), "run_id": body.get("run_id"),
            "stdout": _clip(body.get("stdout")), "stderr": _clip(body.get("stderr")),
            "tests": [{k: (_clip(v) if isinstance(v, str) else v) for k, v in t.items()} for t in tests],
        }
        if status == "infra_error":
            return _infra("sandbox infrastructure error", **details)
        passed = bool(tests) and all(t.get("status") == "passed" for t in tests)
        if not passed and tests:
            details["reason"] = "; ".join(f"{t.get('name')}: {t.get('status')}" for t in tests if t.get("status") != "passed")
        return _reward(passed, **details)

    # ------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Close the HTTP client and stop the math pool (killing a worker stuck in sympy)."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._pool is not None:
            self._kill_pool(self._pool)
