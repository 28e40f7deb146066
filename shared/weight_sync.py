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
Building a group per version costs a few milliseconds on loopback and needs no default group
(``init_process_group`` is never called), so members can come and go.

Wire format, shared with SGLang's ``/update_weights_from_distributed`` (``load_format:
"flattened_bucket"``): each bucket travels as one ``uint8`` buffer, the bytes of its tensors
(``flatten().view(uint8)``) joined in the session's plan order; the plan (names per bucket) is in the
store. Groups are formed the way SGLang's ``init_custom_process_group`` forms them (a
``PrefixStore`` named after the group over the trainer's store, then torch's process-group helper),
so an SGLang server joins a session through ``/init_weights_update_group`` with the same
``group_name``, ``rank_offset`` and ``world_size`` (a receiver of width *w*, e.g. a server with
tensor parallelism *w*, takes ranks ``rank_offset .. rank_offset + w - 1``).

References: torch.distributed process groups built on a store (the pattern of verl's, OpenRLHF's and
slime's trainer-to-engine weight sync), ``TCPStore``, ``PrefixStore``; SGLang
``python/sglang/srt/utils/common.py:init_custom_process_group`` and
``weight_sync/tensor_bucket.py:FlattenedTensorBucket`` (../shared/notes/sglang-api.md).
"""

from __future__ import annotations

import json
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
    return f"{zlib.crc32(flat.cpu().contiguous().view(torch.uint8).numpy().data):08x}"


def join_group(store: dist.Store, group_name: str, rank: int, world_size: int, backend: str,
               timeout_s: float):
    """Form (collectively, with every other rank) the process group ``group_name`` over ``store``, as
    SGLang's ``init_custom_process_group`` does: ``PrefixStore(group_name, store)`` and torch's group
    helper, with no default group. Blocks until all ``world_size`` ranks have joined. The helper is
    private torch API (stable across the pinned torch 2.13 and SGLang's torch); the store keys depend
    on it, which is why both sides must build groups through the same function.

    Returns:
        The process group (pass it to :func:`leave_group` when done).

    Raises:
        RuntimeError, torch.distributed.DistError: the others did not join within ``timeout_s``.
    """
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    prefix = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend), prefix, group_name=group_name,
                                      timeout=timedelta(seconds=timeout_s))
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank == rank, as SGLang sets it
    return pg


def leave_group(pg) -> None:
    """Destroy a group from :func:`join_group` (frees its name for reuse); never raises."""
    try:
        dist.destroy_process_group(pg)
    except (RuntimeError, ValueError, KeyError) as e:  # already gone
        log.debug("destroying a weight-sync group: %s", e)


def _bcast(pg, buf: torch.Tensor) -> None:
    """One bucket's broadcast from rank 0: sends ``buf`` on rank 0, fills it elsewhere (a seam the tests use
    to kill a receiver mid-session). With NCCL, ``wait`` only orders the current stream: the device is
    synchronised so the bytes are in place (or sent) before the group is destroyed."""
    pg.broadcast(buf, 0).wait()
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)


def _device(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


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

    def widths(self, receivers: list[str]) -> list[int]:
        """Ranks each receiver takes (1 for a torch engine, an SGLang server's tensor-parallel size)."""
        out = []
        for rid in receivers:
            key = f"width/{rid}"
            out.append(int(self.store.get(key)) if self.store.check([key]) else 1)
        return out

    def prepare(self, version: int, receivers: list[str], tensors: dict[str, torch.Tensor] | None = None) -> int:
        """Write session ``v<version>``'s members (rank offsets from 1, in the given order, each receiver
        taking as many ranks as its width), its world size and, given ``tensors``, its bucket plan to the
        store; call before announcing the version, so a receiver that sees the announcement finds its rank.

        Returns:
            The session's world size (1 + the receivers' ranks).
        """
        session = f"v{version}/"
        offset = 1
        for rid, w in zip(receivers, self.widths(receivers)):
            self.store.set(f"{session}rank/{rid}", str(offset))
            offset += w
        if tensors is not None:
            plan = [list(b.names) for b in plan_buckets(tensors, self.bucket_bytes)]
            self.store.set(f"{session}plan", json.dumps(plan))
        self.store.set(f"{session}world", str(offset))
        return offset

    def broadcast(self, version: int, tensors: dict[str, torch.Tensor], receivers: list[str]) -> dict:
        """Send ``tensors`` to ``receivers`` as session ``v<version>``; never raises for a receiver's failure.

        Each bucket goes out as the ``uint8`` bytes of its tensors (SGLang's flattened-bucket format);
        :meth:`prepare` is called first if it was not.
        Returns ``{"ok", "seconds", "bytes", "receivers", "error"}``.
        """
        t0 = time.perf_counter()
        session = f"v{version}/"
        total = 0
        pg = None
        try:
            if not self.store.check([f"{session}world", f"{session}plan"]):
                self.prepare(version, receivers, tensors)
            world = int(self.store.get(f"{session}world"))
            pg = join_group(self.store, session, 0, world, self.backend, self.timeout_s)
            for k, names in enumerate(json.loads(self.store.get(f"{session}plan"))):
                flat = torch.cat([tensors[n].detach().reshape(-1).view(torch.uint8) for n in names])
                self.store.set(f"{session}crc/{k}", _digest(flat))
                _bcast(pg, flat.to(_device(self.backend)))  # rank 0's side of the broadcast
                total += flat.numel()
            return {"ok": True, "seconds": time.perf_counter() - t0, "bytes": total, "receivers": receivers,
                    "error": None}
        except (RuntimeError, ValueError, dist.DistError) as e:
            log.warning("weight broadcast of v%d to %s failed after %.1f s: %s (receivers fall back to the "
                        "checkpoint)", version, receivers, time.perf_counter() - t0, e)
            return {"ok": False, "seconds": time.perf_counter() - t0, "bytes": total, "receivers": receivers,
                    "error": str(e)[:500]}
        finally:
            if pg is not None:
                leave_group(pg)

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
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, width: int = 1) -> None:
        self.id, self.timeout_s, self.backend, self.bucket_bytes = receiver_id, timeout_s, backend, bucket_bytes
        self.host, self.port = host, port
        self.store = dist.TCPStore(host, port, world_size=None, is_master=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.store.set(f"width/{receiver_id}", str(width))
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

    def session(self, version: int) -> tuple[int, int]:
        """``(rank_offset, world_size)`` of this receiver in session ``v<version>``.

        Raises:
            RuntimeError: not a member (the key does not appear within ``timeout_s``).
        """
        session = f"v{version}/"
        return int(self.store.get(f"{session}rank/{self.id}")), int(self.store.get(f"{session}world"))

    def plan(self, version: int) -> list[list[str]]:
        """Names of the tensors in each bucket of session ``v<version>``, in broadcast order (waits for the
        trainer to write it). Raises RuntimeError past ``timeout_s``."""
        return json.loads(self.store.get(f"v{version}/plan"))

    def receive(self, version: int, like: dict[str, torch.Tensor], world_size: int | None = None
                ) -> dict[str, torch.Tensor]:
        """Join session ``v<version>`` and return fresh tensors shaped and typed like ``like``.

        Raises:
            RuntimeError: not a member of this session, the group or a bucket timed out or broke, the
                plan names a tensor ``like`` lacks, or a bucket's CRC-32 does not match (the caller
                falls back to the checkpoint).
        """
        session = f"v{version}/"
        rank, world = self.session(version)
        pg = join_group(self.store, session, rank, world_size or world, self.backend, self.timeout_s)
        try:
            out: dict[str, torch.Tensor] = {}
            for k, names in enumerate(self.plan(version)):
                missing = [n for n in names if n not in like]
                if missing:
                    raise RuntimeError(f"v{version} broadcasts tensors this engine lacks: {missing[:3]}")
                nbytes = sum(like[n].numel() * like[n].element_size() for n in names)
                flat = torch.empty(nbytes, dtype=torch.uint8, device=_device(self.backend))
                _bcast(pg, flat)
                flat = flat.cpu()
                if _digest(flat) != self.store.get(f"{session}crc/{k}").decode():
                    raise RuntimeError(f"weight bucket {k} of v{version}: checksum mismatch")
                off = 0
                for n in names:
                    t = like[n]
                    size = t.numel() * t.element_size()
                    out[n] = flat[off:off + size].view(t.dtype).view(t.shape).to(t.device)
                    off += size
            return out
        finally:
            leave_group(pg)

    def close(self) -> None:
        """Stop the heartbeat (the trainer leaves this receiver out of sessions 5 s later)."""
        self._stop.set()
