"""Weight broadcast over torch.distributed: the data plane of DESIGN.md "Weight sync".

The trainer (rank 0) hosts a ``TCPStore``. Each rollout engine registers as a receiver in it and
keeps a heartbeat there. For every policy version the trainer opens a *session*: a fresh process
group (gloo on CPU, NCCL on GPU) over a ``PrefixStore`` named after the version, with the
receivers whose heartbeat is fresh, and broadcasts the weights in buckets of about
``bucket_bytes`` (tensors of one dtype flattened into one buffer each). The CRC-32 of every
bucket's bytes goes into the store; a receiver checks it before handing the weights over.

A session is all-or-nothing and bounded by ``timeout_s``: a receiver that dies or stalls makes the
collective fail (gloo reports a closed connection or the timeout) for that version only. The trainer
logs it and goes on; the receivers fall back to the version's safetensors checkpoint (the control
plane announces both), and a receiver whose heartbeat stopped is left out of the next session.
Building a group per version costs a few milliseconds on loopback and needs no global state
(``init_process_group`` is never called), so members can come and go.

References: torch.distributed ``ProcessGroupGloo``/``ProcessGroupNCCL`` constructed on a store
(the pattern of verl's and OpenRLHF's trainer-to-vLLM weight sync), ``TCPStore``, ``PrefixStore``.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("weight_sync")

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
HEARTBEAT_S = 1.0
"""Receivers refresh their heartbeat this often (seconds); one older than 5 of these is dead."""


@dataclass(frozen=True)
class Bucket:
    """Tensors broadcast as one flat buffer: their names, in order, and the dtype they share."""

    names: tuple[str, ...]
    dtype: torch.dtype
    numel: int


def plan_buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Group tensors (in name order) into buckets of one dtype and at most ``bucket_bytes`` each
    (a single larger tensor gets a bucket of its own). Both sides compute the same plan from the
    same manifest."""
    buckets: list[Bucket] = []
    cur: list[str] = []
    cur_dtype, cur_bytes, cur_numel = None, 0, 0
    for name in sorted(tensors):
        t = tensors[name]
        size = t.numel() * t.element_size()
        if cur and (t.dtype != cur_dtype or cur_bytes + size > bucket_bytes):
            buckets.append(Bucket(tuple(cur), cur_dtype, cur_numel))
            cur, cur_bytes, cur_numel = [], 0, 0
        cur.append(name)
        cur_dtype = t.dtype
        cur_bytes += size
        cur_numel += t.numel()
    if cur:
        buckets.append(Bucket(tuple(cur), cur_dtype, cur_numel))
    return buckets


def _digest(flat: torch.Tensor) -> str:
    """CRC-32 of a bucket's bytes: catches corruption in transit at ~4 GB/s on a CPU core (SHA-256 runs at
    ~1.7 GB/s and would be most of a CPU broadcast's time). Integrity at rest is the checkpoint's SHA-256."""
    return f"{zlib.crc32(flat.contiguous().view(torch.uint8).numpy().data):08x}"


def _group(store: dist.Store, session: str, rank: int, world: int, timeout_s: float, backend: str):
    prefix = dist.PrefixStore(session, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":  # not exercised here (CPU-only torch has no NCCL); the same calls as torch's own binding
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world, opts)
    return dist.ProcessGroupGloo(prefix, rank, world, timeout)


class WeightBroadcaster:
    """Rank 0: hosts the store and broadcasts each version to the live receivers.

    Args:
        host, port: where the ``TCPStore`` listens (receivers connect there).
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        timeout_s: bound on forming a session's group and on each bucket's broadcast (seconds).
        bucket_bytes: target bucket size (bytes).

    Raises:
        RuntimeError: the store cannot listen on ``host:port``.
    """

    def __init__(self, host: str, port: int, backend: str = "gloo", timeout_s: float = 30.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.host, self.port, self.backend = host, port, backend
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.store = dist.TCPStore(host, port, world_size=None, is_master=True,
                                   timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.store.set("recv/count", "0")

    def live_receivers(self, max_age_s: float = 5 * HEARTBEAT_S) -> list[str]:
        """Ids of receivers whose heartbeat is younger than ``max_age_s`` (sorted)."""
        n = int(self.store.get("recv/count"))
        now, live = time.time(), []
        for i in range(n):
            try:
                rid, ts = self.store.get(f"recv/{i}").decode().rsplit("|", 1)
            except (RuntimeError, ValueError):
                continue
            if now - float(ts) <= max_age_s:
                live.append(rid)
        return sorted(live)

    def prepare(self, version: int, receivers: list[str]) -> None:
        """Write session ``v<version>``'s members (ranks 1..n in the given order) and size to the store;
        call before announcing the version, so a receiver that sees the announcement finds its rank."""
        session = f"v{version}/"
        for i, rid in enumerate(receivers):
            self.store.set(f"{session}rank/{rid}", str(i + 1))
        self.store.set(f"{session}world", str(1 + len(receivers)))

    def broadcast(self, version: int, tensors: dict[str, torch.Tensor], receivers: list[str]) -> dict:
        """Send ``tensors`` to ``receivers`` as session ``v<version>``; never raises for a receiver's failure.

        ``receivers`` get ranks 1..n in the given order (:meth:`prepare` is called if it was not).
        Returns ``{"ok", "seconds", "bytes", "receivers", "error"}``.
        """
        t0 = time.perf_counter()
        session = f"v{version}/"
        total = 0
        try:
            if not self.store.check([f"{session}world"]):
                self.prepare(version, receivers)
            pg = _group(self.store, session, 0, 1 + len(receivers), self.timeout_s, self.backend)
            for k, b in enumerate(plan_buckets(tensors, self.bucket_bytes)):
                flat = torch.cat([tensors[n].detach().reshape(-1) for n in b.names])
                self.store.set(f"{session}crc/{k}", _digest(flat.cpu()))
                pg.broadcast(flat, 0, timedelta(seconds=self.timeout_s)).wait()
                total += flat.numel() * flat.element_size()
            return {"ok": True, "seconds": time.perf_counter() - t0, "bytes": total, "receivers": receivers,
                    "error": None}
        except (RuntimeError, dist.DistError) as e:
            log.warning("weight broadcast of v%d to %s failed after %.1f s: %s (receivers fall back to the "
                        "checkpoint)", version, receivers, time.perf_counter() - t0, e)
            return {"ok": False, "seconds": time.perf_counter() - t0, "bytes": total, "receivers": receivers,
                    "error": str(e)[:500]}

    def close(self) -> None:
        """Stop serving the store (receivers' later calls fail and they fall back to checkpoints)."""
        del self.store


class WeightReceiver:
    """A rollout engine's side: registers, heartbeats, and receives a version's buckets.

    Args:
        host, port: the trainer's store.
        receiver_id: unique name of this engine (e.g. ``rollout-0``).
        timeout_s: bound on joining a session and on each bucket (seconds).

    Raises:
        RuntimeError: the store is unreachable within ``timeout_s``.
    """

    def __init__(self, host: str, port: int, receiver_id: str, timeout_s: float = 30.0, backend: str = "gloo",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.id, self.timeout_s, self.backend, self.bucket_bytes = receiver_id, timeout_s, backend, bucket_bytes
        self.store = dist.TCPStore(host, port, world_size=None, is_master=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.slot = self.store.add("recv/count", 1) - 1
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._heartbeat, name=f"weight-receiver-{receiver_id}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.store.set(f"recv/{self.slot}", f"{self.id}|{time.time()}")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except RuntimeError:
                return  # the trainer's store is gone

    def receive(self, version: int, like: dict[str, torch.Tensor], world_size: int | None = None
                ) -> dict[str, torch.Tensor]:
        """Join session ``v<version>`` and return fresh tensors shaped and typed like ``like``.

        Raises:
            RuntimeError: not a member of this session, the group or a bucket timed out or broke,
                or a bucket's CRC-32 does not match (the caller falls back to the checkpoint).
        """
        session = f"v{version}/"
        rank = int(self.store.get(f"{session}rank/{self.id}"))
        if world_size is None:
            world_size = int(self.store.get(f"{session}world"))
        pg = _group(self.store, session, rank, world_size, self.timeout_s, self.backend)
        out: dict[str, torch.Tensor] = {}
        for k, b in enumerate(plan_buckets(like, self.bucket_bytes)):
            flat = torch.empty(b.numel, dtype=b.dtype, device=like[b.names[0]].device)
            pg.broadcast(flat, 0, timedelta(seconds=self.timeout_s)).wait()
            want = self.store.get(f"{session}crc/{k}").decode()
            if _digest(flat.cpu()) != want:
                raise RuntimeError(f"weight bucket {k} of v{version}: checksum mismatch")
            off = 0
            for n in b.names:
                t = like[n]
                out[n] = flat[off:off + t.numel()].view(t.shape)
                off += t.numel()
        return out

    def close(self) -> None:
        """Stop the heartbeat (the trainer leaves this receiver out of sessions 5 s later)."""
        self._stop.set()
