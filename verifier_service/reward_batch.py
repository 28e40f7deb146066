"""One environment's reward workers: spawned processes fed batches of calls over a socket.

Why not a ``ProcessPoolExecutor``: one submit per reward call costs the event loop far more than a trivial reward
itself (pickling, the executor's threads, a future per call), and a batch submitted to it reports nothing until
its last call is done, so a per-call timeout could not tell which call hung. Here each worker process holds a
socket to the service and a small shared record of its progress (the batch, the call it is running, when that
call started): the service sends it a batch of calls (the JSON contexts) in one message, and the worker sends
the answers back in order, in one message at the end of a short batch. So:

* each call is timed from its own start (``verifier.reward_timeout_s``), by one timer per batch that reads the
  record: past the timeout, only the call running is an infrastructure error; the worker is killed (a
  function that never returns cannot be interrupted any other way), the batch's other calls not yet answered
  go back to the front of the queue (scored again if they were scored but not sent), and a new worker starts;
* a worker that dies (a reward that crashes the interpreter) fails only the call it was running, likewise;
* calls are batched only as far as they queue: the calls that arrive during one step of the event loop (the
  service scores a poll's records concurrently) are sent at its end (or ``verifier.reward_batch_wait_ms``
  later), split evenly over the idle workers, at most ``verifier.reward_batch_size`` per batch; calls that
  arrive while every worker is busy go to the first one freed. So a lone call is not delayed and a burst of
  calls costs a message per worker.

Frames on the socket are a 4-byte big-endian length and that many bytes of JSON.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import math
import multiprocessing
import multiprocessing.util
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import orjson

from shared.envs import EnvironmentLoadError, EnvironmentRef, RewardError, cached_environment
from verifier_service.config import VerifierConfig
from verifier_service.deterministic import CheckResult, infra

log = logging.getLogger(__name__)

FRAME = struct.Struct("!I")
"""Header of a frame: the length of its JSON body in bytes."""

FLUSH_S = 0.005
"""A worker sends the answers it has at least this often during a long batch (seconds)."""

_STARTED: set[multiprocessing.process.BaseProcess] = set()
"""Every worker process started and not yet reaped, by any pool of this process."""


@atexit.register  # registered after multiprocessing's own exit hook, so run before it joins its children
def _kill_started() -> None:
    """At interpreter exit, kill the workers of pools never closed: they are not daemons (a reward may start
    processes of its own), and one stuck in user code would keep the exit waiting."""
    for proc in list(_STARTED):
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - already reaped
            pass


# ---------------------------------------------------------------- in the worker process


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from ``sock``; ``None`` when the service closed it first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(FRAME.pack(len(body)) + body)


def _score_one(rubric: Any, context: dict[str, Any]) -> bytes:
    """The answer to one call: ``[score, details, infra_error]``."""
    try:
        r = rubric.score(**context)
        return orjson.dumps([r.score, {"rewards": r.rewards, "metrics": r.metrics}, False])
    except RewardError as e:
        return orjson.dumps([0.0, {"reason": str(e)}, True])
    except Exception as e:  # noqa: BLE001 - the rubric's own checks failed on a value it could not handle
        return orjson.dumps([0.0, {"reason": f"rubric failed: {type(e).__name__}: {str(e)[:300]}"}, True])


def _send_answers(sock: socket.socket, answers: list[bytes]) -> None:
    _send_frame(sock, b"[" + b",".join(answers) + b"]")


def worker_main(sock: socket.socket, key: str, progress: Any) -> None:
    """Entry of a reward worker process: import the environment ``key`` names, say whether it loaded (an empty
    object, else ``{"reason", "misconfigured"}``), then score batches (``[batch number, [context, ...]]``) until
    the service closes the socket. Answers go back as lists, in order: all of a batch at its end, or those
    ready every :data:`FLUSH_S` seconds of a long batch. Before each call it writes the batch number, the
    call's start (``time.monotonic``) and its index to ``progress`` (a shared array of 3 doubles), so that the
    service can time each call and name the one that hangs or crashes without an answer per call."""
    try:
        rubric = cached_environment(EnvironmentRef.model_validate_json(key)).rubric
    except EnvironmentLoadError as e:
        _send_frame(sock, orjson.dumps({"reason": str(e), "misconfigured": True}))
        return
    _send_frame(sock, b"{}")
    while True:
        head = _recv_exactly(sock, FRAME.size)
        body = head and _recv_exactly(sock, FRAME.unpack(head)[0])
        if body is None:
            return
        number, contexts = orjson.loads(body)
        progress[2], progress[1] = time.monotonic(), 0
        progress[0] = number  # last: the service reads it first
        answers: list[bytes] = []
        flushed = time.monotonic()
        for i, context in enumerate(contexts):
            now = time.monotonic()
            if answers and now - flushed >= FLUSH_S:
                _send_answers(sock, answers)
                answers, flushed = [], now
            progress[2] = now  # the start first: the service reads the index first (see _Worker.running)
            progress[1] = i
            answers.append(_score_one(rubric, context))
        _send_answers(sock, answers)


# ---------------------------------------------------------------- in the service


@dataclass(eq=False)
class _Call:
    context: bytes
    """The JSON object of the rubric's arguments."""
    future: asyncio.Future


class _Worker:
    """One spawned worker process, the service's end of its socket, and the record of its progress."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, progress: Any) -> None:
        self.proc, self.reader, self.writer, self.progress = proc, reader, writer, progress
        self.batch: asyncio.Future[list[_Call] | None] | None = None
        """Resolved with the calls sent to the worker while it waits for a batch (``None``: it died idle)."""
        self.number = 0
        """Number of the batch last sent."""
        self.sent_at = 0.0
        """When it was sent (``time.monotonic``, the event loop's clock)."""
        self.timed_out: int | None = None
        """Index in the batch of the call that ran past the timeout, once the worker was killed for it."""
        self._watch: asyncio.TimerHandle | None = None

    def running(self) -> tuple[int, float]:
        """The index in the current batch of the call the worker is running or ran last, and when it started;
        ``(0, sent_at)`` before it started the batch."""
        number, index, start = self.progress[0], self.progress[1], self.progress[2]  # the index before its start
        return (int(index), start) if number == self.number else (0, self.sent_at)

    def watch(self, number: int, timeout_s: float) -> None:
        """Time the calls of batch ``number``, just sent: once the one running has run ``timeout_s`` seconds,
        kill the worker (which ends the pending read) and set :attr:`timed_out`. One timer per batch, re-armed
        when it fires before the call running then is due: no cost per call."""
        loop = asyncio.get_running_loop()
        self.number, self.sent_at = number, loop.time()

        def check() -> None:
            index, start = self.running()
            left = start + timeout_s - loop.time()
            if left > 0:
                self._watch = loop.call_later(left, check)
            else:
                self.timed_out = index
                self.kill()

        self._watch = loop.call_later(timeout_s, check)

    def unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    async def read_frame(self) -> bytes:
        """The next frame's body.

        Raises:
            asyncio.IncompleteReadError: the worker closed the socket (it died).
        """
        head = await self.reader.readexactly(FRAME.size)
        return await self.reader.readexactly(FRAME.unpack(head)[0])

    def kill(self) -> None:
        """Kill the process (it may be stuck in user code) and close the socket; never raises."""
        try:
            self.proc.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.writer.close()


class RewardPool:
    """``verifier.reward_workers`` worker processes of one environment and its queue of calls. Use from one
    event loop: :meth:`start`, then :meth:`score` from any number of tasks, then :meth:`close`."""

    def __init__(self, key: str, label: str, cfg: VerifierConfig) -> None:
        self.key, self.label, self.cfg = key, label, cfg
        self._pending: collections.deque[_Call] = collections.deque()
        self._idle: collections.deque[_Worker] = collections.deque()
        """Workers waiting for a batch, the longest waiting first."""
        self._flush_at: asyncio.Handle | None = None
        """The scheduled :meth:`_flush` of the calls queued (``None``: none scheduled)."""
        self._sent = 0
        """Batches sent (the last one's number)."""
        self._live = 0
        """Workers started and not yet lost (killed or dead), plus those being started."""
        self._tasks: set[asyncio.Task] = set()
        self._workers: set[_Worker] = set()
        self._procs: list[multiprocessing.process.BaseProcess] = []
        """This pool's processes not yet reaped (killed and reaped at :meth:`close`)."""
        self.closed = False

    @property
    def dead(self) -> bool:
        """No worker is left or being started (a replacement failed to start): a new pool is needed."""
        return self._live == 0

    async def start(self, timeout_s: float) -> None:
        """Start the workers, each importing the environment, within ``timeout_s`` seconds.

        Raises:
            EnvironmentLoadError: the environment cannot be loaded (every worker is stopped).
            asyncio.TimeoutError, OSError: the processes did not start (every worker is stopped).
        """
        try:
            workers = await asyncio.wait_for(asyncio.gather(*(self._spawn() for _ in range(self.cfg.reward_workers)),
                                                            return_exceptions=True), timeout=timeout_s)
        except BaseException:
            await self.close()
            raise
        errors = [w for w in workers if isinstance(w, BaseException)]
        for w in workers:
            if not isinstance(w, BaseException):
                self._run(w)
        if errors:
            await self.close()
            raise errors[0]

    async def score(self, context: bytes) -> CheckResult:
        """The rubric's outcome for one call (``context``: the JSON object of its arguments). Waits for a free
        worker first (not counted in the timeout). Never raises but for cancellation: a reward that fails, hangs
        or kills its worker gives ``infra_error``."""
        if self.closed or self.dead:
            return infra(f"reward pool of {self.label} is {'closed' if self.closed else 'lost all its workers'}")
        call = _Call(context, asyncio.get_running_loop().create_future())
        self._pending.append(call)
        if self._idle and len(self._pending) >= self.cfg.reward_batch_size:
            self._flush()
        elif self._flush_at is None:  # the other calls of this step queue first: one message for them all
            loop = asyncio.get_running_loop()
            wait_s = self.cfg.reward_batch_wait_ms / 1000
            self._flush_at = loop.call_later(wait_s, self._flush) if wait_s > 0 else loop.call_soon(self._flush)
        return await call.future

    async def _spawn(self) -> _Worker:
        """A started worker that loaded the environment.

        Raises:
            EnvironmentLoadError: it could not load the environment.
            OSError, asyncio.IncompleteReadError: the process could not start or died while starting.
        """
        self._live += 1
        worker = None
        try:
            ours, theirs = socket.socketpair()
            ctx = multiprocessing.get_context("spawn")  # not fork: the service has threads (aiokafka, httpx)
            progress = ctx.RawArray("d", 3)
            try:
                proc = ctx.Process(target=worker_main, args=(theirs, self.key, progress), name="flywheel-reward")
                proc.start()
                for old in [p for p in _STARTED if not p.is_alive()]:  # is_alive reaps an exited process
                    _STARTED.discard(old)
                _STARTED.add(proc)
                self._procs = [p for p in self._procs if p in _STARTED] + [proc]
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            try:
                reader, writer = await asyncio.open_connection(sock=ours)
            except BaseException:
                proc.kill()
                ours.close()
                raise
            worker = _Worker(proc, reader, writer, progress)
            self._workers.add(worker)
            hello = orjson.loads(await worker.read_frame())
            if hello:
                raise EnvironmentLoadError(hello["reason"])
        except BaseException:
            if worker is None:
                self._live -= 1
            else:
                self._lose(worker)
            raise
        return worker

    def _lose(self, worker: _Worker) -> None:
        """Kill ``worker``; it no longer counts as live (once, however often it is lost)."""
        worker.kill()
        if worker in self._workers:
            self._workers.discard(worker)
            self._live -= 1

    def _run(self, worker: _Worker) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(worker), name=f"reward worker {self.label}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, worker: _Worker) -> None:
        """Read ``worker``'s answers to each batch it is sent until it is lost, then start its replacement
        (unless the pool is closed)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                worker.batch = loop.create_future()
                self._idle.append(worker)
                self._flush()
                calls = await worker.batch
                if calls is None or not await self._answers(worker, calls):
                    break
        finally:
            if worker in self._idle:
                self._idle.remove(worker)
            self._lose(worker)
        if not self.closed:
            await self._replace()

    async def _replace(self) -> None:
        t0 = time.perf_counter()
        try:
            worker = await asyncio.wait_for(self._spawn(), timeout=self.cfg.reward_timeout_s + 120.0)
        except Exception as e:  # noqa: BLE001 - the pool goes on with the workers it has, or is dead
            log.warning("replacement reward worker of %s did not start: %r", self.label, e)
            if self.dead:
                self._fail_pending(f"reward workers of {self.label} could not be restarted: {e!r}")
            return
        if self.closed:
            self._lose(worker)
            return
        log.info("replacement reward worker of %s started in %.2f s", self.label, time.perf_counter() - t0)
        self._run(worker)

    def _flush(self) -> None:
        """Send the queued calls to the idle workers, an even share to each, at most ``reward_batch_size`` per
        batch (the rest wait for the first worker freed). Few batches: each costs both processes a wake-up,
        which on a busy machine costs more than a cheap reward."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        while self._idle and self._pending:
            share = math.ceil(len(self._pending) / len(self._idle))
            self._send(self._idle.popleft(), min(self.cfg.reward_batch_size, share))

    def _send(self, worker: _Worker, n: int) -> None:
        """Send ``worker`` (idle) the next ``n`` queued calls, those whose callers still wait, as one message; a
        worker that died while idle is not sent any (its reader is told, and it is replaced)."""
        if worker.reader.at_eof():
            worker.batch.set_result(None)
            return
        calls = []
        while self._pending and len(calls) < n:
            call = self._pending.popleft()
            if not call.future.done():  # its caller gave up while it queued
                calls.append(call)
        if not calls:
            self._idle.appendleft(worker)
            return
        self._sent += 1
        body = b"[%d,[" % self._sent + b",".join(c.context for c in calls) + b"]]"
        worker.watch(self._sent, self.cfg.reward_timeout_s)
        worker.writer.write(FRAME.pack(len(body)) + body)  # buffered by the transport: never blocks the loop
        worker.batch.set_result(calls)

    async def _answers(self, worker: _Worker, calls: list[_Call]) -> bool:
        """Resolve each of ``calls`` (just sent to ``worker``) with its answer; ``False`` when the worker was lost
        (a call timed out or the worker died): that call is an infrastructure error, the rest of the batch not
        answered yet queue again at the front (those it had scored but not sent too)."""
        done = 0
        try:
            while done < len(calls):
                for score, details, infra_error in orjson.loads(await worker.read_frame()):
                    if not calls[done].future.done():
                        calls[done].future.set_result(CheckResult(score, details, infra_error))
                    done += 1
            return True
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            if worker.timed_out is not None:
                culprit = worker.timed_out
                reason = f"reward of {self.label} exceeded {self.cfg.reward_timeout_s} s"
            else:
                culprit = worker.running()[0]
                reason = f"reward worker of {self.label} died: exit code {worker.proc.exitcode}, {e!r}"
        except BaseException:  # cancelled (the pool closes): the callers are answered by close()
            self._pending.extendleft(reversed(calls[done:]))
            raise
        finally:
            worker.unwatch()
        culprit = min(max(culprit, done), len(calls) - 1)
        log.warning("%s (%d calls of its batch queued again)", reason, len(calls) - done - 1)
        if not calls[culprit].future.done():
            calls[culprit].future.set_result(infra(reason))
        self._pending.extendleft(reversed(calls[done:culprit] + calls[culprit + 1:]))
        self._flush()
        return False

    def _fail_pending(self, reason: str) -> None:
        while self._pending:
            call = self._pending.popleft()
            if not call.future.done():
                call.future.set_result(infra(reason))

    async def close(self) -> None:
        """Kill the workers now; calls not yet answered get ``infra_error``."""
        self.closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in list(self._workers):
            self._lose(worker)
        for proc in self._procs:
            try:
                proc.kill()
                proc.join(1.0)  # reap it: killed, it exits at once
            except Exception:  # noqa: BLE001 - already reaped
                pass
            _STARTED.discard(proc)
        self._procs.clear()
        self._fail_pending(f"reward pool of {self.label} closed")
