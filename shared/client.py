"""HTTP clients of the scheduler and sandbox APIs: base URL, bearer token, timeouts, and retry with
exponential backoff and jitter up to a total deadline, so that a caller rides through a restart.

Used by the ``flywheel`` CLI (:class:`ApiClient`), the verifier's and the rollout's calls to the sandbox
(:class:`AsyncApiClient`) and the tests.

Which failures are retried (:meth:`RetryPolicy.verdict`; "idempotent" below is :func:`is_idempotent`):

* **Not sent**: ``httpx.ConnectError`` (connection refused: the server is down or restarting),
  ``ConnectTimeout``, ``PoolTimeout``. The server never saw the request: every method is retried.
* **Refused without acting**: HTTP 429 and 503 (RFC 6585 §4, RFC 9110 §15.6.4; the sandbox answers 503
  when it admits no execution: queue full, breaker open, shutting down). Every method is retried, after
  the server's ``Retry-After`` when it gives one (given up at once when that is past the deadline).
* **Sent, outcome unknown**: read/write timeouts, a connection reset or closed mid-request
  (``ReadError``, ``WriteError``, ``RemoteProtocolError``), and HTTP 502/504 (a proxy's answer: the
  server behind it may have acted). Retried only when the request is idempotent: ``GET``, ``HEAD``,
  ``PUT``, ``DELETE``, ``OPTIONS`` (RFC 9110 §9.2.2), or a ``POST`` to a route listed in
  ``idempotent_posts``. ``POST /v1/tasks`` is (:data:`SCHEDULER_IDEMPOTENT_POSTS`): the registry stores a
  batch in one transaction, accepts a stored task id with the same content again and reports a task of
  new id but stored content as a duplicate without storing it
  (``scheduler_service.registry.Registry.register``), so a batch posted twice stores its tasks once.
  ``POST /v1/evals`` (a new round each time) and ``POST /v1/execute`` (runs the program again, doubling
  its cost) are not.
* **Everything else** (other 4xx, 500, a malformed URL): not retried; 4xx keep the server's message
  (:class:`ApiStatusError`; 401 as :class:`Unauthorized`, which says where the token comes from).

The deadline (:attr:`RetryPolicy.deadline_s`) bounds the retries: no retry starts after it (nor after
:attr:`RetryPolicy.retry_for_s`, when shorter) and a retry's timeout is cut to the time left, so a call
lasts at most ``max(timeout, deadline)`` (0: one attempt). Past it the call raises :class:`ApiUnreachable`
naming the URL, the attempts and the last error.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from shared.auth import auth_headers

log = logging.getLogger(__name__)

#: ``POST`` routes of the scheduler that are safe to send twice (see the module docstring).
SCHEDULER_IDEMPOTENT_POSTS = frozenset({"/v1/tasks"})
#: How long the verifier and the rollout retry a sandbox that refuses connections or answers 503 (seconds): a
#: restarted sandbox answers within ~3 s; past this the call is an infrastructure error (never a score).
SANDBOX_RETRY_S = 10.0
#: Methods idempotent by definition (RFC 9110 §9.2.2).
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
#: Statuses that mean "refused, nothing done": retried for every method.
REFUSED_STATUSES = frozenset({429, 503})
#: Statuses of a gateway whose upstream may have acted: retried for idempotent requests only.
GATEWAY_STATUSES = frozenset({502, 504})
#: Transport errors raised before the request left this process.
NOT_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
#: Transport errors after (part of) the request may have reached the server.
MAYBE_SENT_ERRORS = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.ReadError, httpx.WriteError,
                     httpx.RemoteProtocolError)

TOKEN_HELP = ("the token comes from $FLYWHEEL_AUTH__TOKEN, the file $FLYWHEEL_AUTH__TOKEN_FILE or "
              "<run dir>/auth_token (written by the launcher; the CLI's --run-dir)")

Token = str | None | Callable[[], str | None]
"""A token, or a function returning the current one (read per request: a file written after the client)."""


class ApiError(Exception):
    """A request to a Flywheel API failed for good. ``method``, ``url``, ``attempts`` say which and how often."""

    def __init__(self, message: str, *, method: str, url: str, attempts: int) -> None:
        Exception.__init__(self, message)  # not the httpx base's __init__ (it wants request/response)
        self._request: httpx.Request | None = None
        self.method, self.url, self.attempts = method, url, attempts


class ApiUnreachable(ApiError, httpx.TransportError):
    """No answer (or only retryable ones) by the deadline; ``last_error`` is the last failure's text."""

    def __init__(self, *, method: str, url: str, attempts: int, elapsed_s: float, last_error: str,
                 request: httpx.Request | None = None) -> None:
        msg = (f"{method} {url}: no usable answer after {attempts} attempt{'s' if attempts != 1 else ''} in "
               f"{elapsed_s:.1f} s; last error: {last_error}")
        ApiError.__init__(self, msg, method=method, url=url, attempts=attempts)
        self._request = request
        self.elapsed_s, self.last_error = elapsed_s, last_error


class ApiStatusError(ApiError, httpx.HTTPStatusError):
    """The server answered a status that is not retried (or was retried until the deadline). ``detail`` is
    the server's message (FastAPI's ``detail``, else the body, clipped to 2,000 characters)."""

    def __init__(self, response: httpx.Response, *, attempts: int, hint: str = "") -> None:
        method, url = response.request.method, str(response.request.url)
        self.status_code, self.detail = response.status_code, response_detail(response)
        msg = f"{method} {response.request.url.path} -> {response.status_code}: {self.detail}{hint}"
        if attempts > 1:
            msg += f" (after {attempts} attempts)"
        ApiError.__init__(self, msg, method=method, url=url, attempts=attempts)
        self.request, self.response = response.request, response


class Unauthorized(ApiStatusError):
    """HTTP 401: the token is missing or wrong; the message says where the token comes from."""

    def __init__(self, response: httpx.Response, *, attempts: int, sent_token: bool) -> None:
        sent = "a token was sent but refused" if sent_token else "no token was sent"
        super().__init__(response, attempts=attempts, hint=f" ({sent}; {TOKEN_HELP})")


def response_detail(r: httpx.Response, limit: int = 2000) -> str:
    """The server's error message in one line: ``field: message`` per problem of a FastAPI 422, else its
    ``detail`` (or the body), clipped to ``limit`` characters."""
    try:
        body = r.json()
        detail = body.get("detail", body) if isinstance(body, dict) else body
    except ValueError:
        detail = r.text
    if isinstance(detail, list) and all(isinstance(e, dict) for e in detail):  # FastAPI validation errors
        detail = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                           for e in detail)
    text = detail if isinstance(detail, str) else str(detail)
    return text if len(text) <= limit else text[:limit] + "...[cut]"


def is_idempotent(method: str, path: str, idempotent_posts: frozenset[str] | set[str] = frozenset()) -> bool:
    """May this request be sent twice? By method (RFC 9110 §9.2.2), or a ``POST`` to a listed route."""
    method = method.upper()
    return method in IDEMPOTENT_METHODS or (method == "POST" and path.rstrip("/") in idempotent_posts)


def retry_after_s(r: httpx.Response) -> float | None:
    """The ``Retry-After`` header in seconds (delta-seconds or an HTTP date, RFC 9110 §10.2.3); None if absent
    or unreadable."""
    value = r.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


Verdict = Literal["done", "retry", "fail"]


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to retry (module docstring); pure: no I/O, tested on its own."""

    deadline_s: float = 60.0
    """How long one call may go on retrying, attempts and pauses together (seconds, >= 0; 0: one attempt,
    with its full timeout)."""
    retry_for_s: float | None = None
    """No retry starts after this many seconds of a call (default: the deadline). Lets a caller keep a long
    deadline for one slow answer (a program run in the sandbox) but give up on a dead server sooner."""
    first_backoff_s: float = 0.2
    """Pause after the first failure (seconds); doubled after each further one."""
    max_backoff_s: float = 5.0
    """Longest pause between two attempts (seconds)."""
    jitter: float = 0.5
    """Each pause is drawn uniformly from ``[(1 - jitter) * p, p]`` (0..1), so clients restarted together
    do not retry in step."""
    idempotent_posts: frozenset[str] = field(default_factory=frozenset)
    """``POST`` paths that are safe to send twice (e.g. :data:`SCHEDULER_IDEMPOTENT_POSTS`)."""

    def __post_init__(self) -> None:
        if self.retry_for_s is not None and self.retry_for_s < 0:
            raise ValueError(f"retry_for_s must be >= 0, got {self.retry_for_s}")
        if self.deadline_s < 0 or self.first_backoff_s <= 0 or self.max_backoff_s < self.first_backoff_s:
            raise ValueError(f"bad retry policy {self}: need deadline_s >= 0, 0 < first_backoff_s <= max_backoff_s")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be within [0, 1], got {self.jitter}")

    def verdict(self, method: str, path: str, *, error: BaseException | None = None,
                status: int | None = None) -> Verdict:
        """``done`` (a final answer: 2xx/3xx or a status not retried), ``retry`` or ``fail`` (an error not retried)."""
        idem = is_idempotent(method, path, self.idempotent_posts)
        if error is not None:
            if isinstance(error, NOT_SENT_ERRORS):
                return "retry"
            if isinstance(error, MAYBE_SENT_ERRORS):
                return "retry" if idem else "fail"
            return "fail"
        if status in REFUSED_STATUSES or (status in GATEWAY_STATUSES and idem):
            return "retry"
        return "done"

    def pause_s(self, failures: int, rng: random.Random | None = None) -> float:
        """Pause after the ``failures``-th failure (1-based): ``min(max, first * 2**(failures-1))``, jittered."""
        p = min(self.max_backoff_s, self.first_backoff_s * 2 ** min(failures - 1, 30))
        return p * (1.0 - self.jitter * (rng or random).random())


@dataclass
class RetryEvent:
    """What :attr:`ApiClient.on_retry` is told before each pause."""

    method: str
    url: str
    attempt: int
    """Attempts made so far."""
    error: str
    """The failure: the exception, or ``HTTP <status>``."""
    pause_s: float
    elapsed_s: float


class _Call:
    """The retry loop's state for one call (shared by the sync and the async client)."""

    def __init__(self, policy: RetryPolicy, method: str, url: str, path: str, deadline_s: float | None) -> None:
        self.policy, self.method, self.url, self.path = policy, method.upper(), url, path
        self.t0 = time.monotonic()
        self.deadline = self.t0 + (policy.deadline_s if deadline_s is None else deadline_s)
        self.retry_until = self.deadline if policy.retry_for_s is None else min(self.deadline,
                                                                                self.t0 + policy.retry_for_s)
        self.attempts, self.last_error, self.last_request = 0, "", None

    def attempt_timeout(self, timeout: httpx.Timeout) -> httpx.Timeout:
        """``timeout`` for the first attempt; for a retry, cut to the time left (at least 0.05 s)."""
        if self.attempts == 0:
            return timeout
        left = max(0.05, self.deadline - time.monotonic())
        cut = {k: (left if v is None else min(v, left)) for k, v in timeout.as_dict().items()}
        return httpx.Timeout(**cut)

    def after(self, response: httpx.Response | None, error: BaseException | None) -> float | None:
        """Record one attempt; the pause before the next, or None when ``response`` is final.

        Raises:
            ApiUnreachable: retryable, but the deadline has passed (or ``Retry-After`` is beyond it).
            ApiStatusError: a 4xx/5xx that is not retried; :class:`Unauthorized` for a 401.
            httpx.HTTPError: ``error`` itself when it is not retried.
        """
        self.attempts += 1
        status = response.status_code if response is not None else None
        verdict = self.policy.verdict(self.method, self.path, error=error, status=status)
        if verdict == "done":
            if status is not None and status >= 400:
                if status == 401:
                    sent = "authorization" in {k.lower() for k in response.request.headers}
                    raise Unauthorized(response, attempts=self.attempts, sent_token=sent)
                raise ApiStatusError(response, attempts=self.attempts)
            return None
        if verdict == "fail":
            assert error is not None
            raise error
        self.last_error = f"{type(error).__name__}: {error}" if error is not None else f"HTTP {status}"
        if response is not None:
            self.last_request = response.request
            if status is not None and status >= 400:
                self.last_error += f" ({response_detail(response, 300)})"
        pause = self.policy.pause_s(self.attempts)
        wait = retry_after_s(response) if response is not None else None
        if wait is not None:
            pause = max(pause, wait)
        left = self.retry_until - time.monotonic()
        if left <= 0 or (wait is not None and wait > left):
            if wait is not None and wait > left > 0:
                self.last_error += f"; Retry-After {wait:.1f} s is past the deadline"
            raise ApiUnreachable(method=self.method, url=self.url, attempts=self.attempts,
                                 elapsed_s=time.monotonic() - self.t0, last_error=self.last_error,
                                 request=self.last_request)
        return min(pause, left)

    def event(self, pause: float) -> RetryEvent:
        return RetryEvent(self.method, self.url, self.attempts, self.last_error, pause, time.monotonic() - self.t0)


def _resolve(token: Token) -> str | None:
    return token() if callable(token) else token


class ApiClient:
    """Synchronous client of one API (the CLI's): ``request`` retries as the module docstring says.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        token: the bearer token, or a function returning it (read per request), or None (no header).
        timeout: one attempt's timeout (seconds, or an ``httpx.Timeout``).
        retry: the policy; its ``deadline_s`` bounds each call unless the call gives its own.
        on_retry: called before each pause (the CLI supervises the system there, and says so once).
    """

    def __init__(self, base_url: str, token: Token = None, *, timeout: float | httpx.Timeout = 10.0,
                 retry: RetryPolicy = RetryPolicy(), on_retry: Callable[[RetryEvent], None] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.token, self.retry, self.on_retry = token, retry, on_retry
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.http = httpx.Client(base_url=self.base_url)

    def request(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                headers: dict[str, str] | None = None, timeout: float | None = None,
                deadline_s: float | None = None) -> httpx.Response:
        """Send ``method path`` until a final answer; returns a response of status < 400.

        Raises:
            ApiUnreachable: no usable answer by the deadline.
            ApiStatusError: a 4xx (the server's message kept) or a 5xx not retried; 401: :class:`Unauthorized`.
            httpx.HTTPError: a transport error that may not be retried (e.g. a POST's read timeout).
        """
        call = _Call(self.retry, method, f"{self.base_url}{path}", path, deadline_s)
        base = httpx.Timeout(timeout) if timeout is not None else self.timeout
        while True:
            hdrs = {**(headers or {}), **auth_headers(_resolve(self.token))}
            response = error = None
            try:
                response = self.http.request(call.method, path, json=json, params=params, headers=hdrs,
                                             timeout=call.attempt_timeout(base))
            except httpx.TransportError as e:
                error = e
            pause = call.after(response, error)
            if pause is None:
                return response
            log.debug("retrying %s %s in %.2f s: %s", call.method, call.url, pause, call.last_error)
            if self.on_retry is not None:
                self.on_retry(call.event(pause))
            time.sleep(max(0.0, min(pause, call.deadline - time.monotonic())))

    def get(self, path: str, **kw) -> Any:
        """``GET path``: the decoded JSON body."""
        return self.request("GET", path, **kw).json()

    def post(self, path: str, json: Any = None, **kw) -> Any:
        """``POST path`` with a JSON body: the decoded JSON answer."""
        return self.request("POST", path, json=json, **kw).json()

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "ApiClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncApiClient:
    """Asynchronous client of one API (the services' calls to the sandbox); as :class:`ApiClient`."""

    def __init__(self, base_url: str, token: Token = None, *, timeout: float | httpx.Timeout = 10.0,
                 retry: RetryPolicy = RetryPolicy()) -> None:
        self.base_url = base_url.rstrip("/")
        self.token, self.retry = token, retry
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.http = httpx.AsyncClient(base_url=self.base_url)

    async def request(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                      headers: dict[str, str] | None = None, timeout: float | httpx.Timeout | None = None,
                      deadline_s: float | None = None, content: bytes | None = None) -> httpx.Response:
        """As :meth:`ApiClient.request`; ``content``: a raw body instead of ``json``.

        Raises:
            ApiUnreachable, ApiStatusError, httpx.HTTPError: as :meth:`ApiClient.request`.
            asyncio.CancelledError: when cancelled (nothing else).
        """
        call = _Call(self.retry, method, f"{self.base_url}{path}", path, deadline_s)
        base = self.timeout if timeout is None else (timeout if isinstance(timeout, httpx.Timeout)
                                                     else httpx.Timeout(timeout))
        while True:
            hdrs = {**(headers or {}), **auth_headers(_resolve(self.token))}
            response = error = None
            try:
                response = await self.http.request(call.method, path, json=json, params=params, headers=hdrs,
                                                   content=content, timeout=call.attempt_timeout(base))
            except httpx.TransportError as e:
                error = e
            pause = call.after(response, error)
            if pause is None:
                return response
            log.debug("retrying %s %s in %.2f s: %s", call.method, call.url, pause, call.last_error)
            await asyncio.sleep(max(0.0, min(pause, call.deadline - time.monotonic())))

    async def aclose(self) -> None:
        await self.http.aclose()
