"""The ``sglang`` engine: an SGLang server driven over its HTTP API (../shared/notes/sglang-api.md).

* Generation: ``POST /generate`` with ``input_ids`` (token in, token out), ``return_logprob`` and
  ``logprob_start_len: -1``; ids and behaviour log-probs come from ``meta_info.output_token_logprobs``
  (``[logprob, token_id, text]`` per token), the finish reason from ``meta_info.finish_reason.type``,
  and the version of every output span from ``meta_info.weight_versions`` (≥ 0.5.19) or
  ``meta_info.weight_version``. The K samples of a prompt are sent as K copies of it in one batch:
  SGLang's radix cache prefills the shared prompt once.
* Weights from disk: ``/pause_generation {mode}`` → ``/update_weights_from_disk {model_path,
  weight_version, flush_cache: false}`` → ``/flush_cache`` → ``/continue_generation``. An update
  mid-generation is the interruptible policy, in one of SGLang's three pause modes
  (``rollout.sglang_pause_mode``): ``retract`` (default) sends the requests in flight back to the
  queue, to re-prefill under the new weights and continue inside the same HTTP call; ``in_place``
  freezes them with their KV cache, which is stale after the update (no flush then: SGLang ≤ 0.5.21
  crashes flushing with requests held); ``abort`` ends them with their partial output, and this engine
  resubmits prompt + partial output for the remaining tokens (AReaL's and slime's partial rollouts).
  Either way each span of output is tagged with its version.
* Weights by broadcast (``weights.transport: distributed``; ``shared/weight_sync.py``): the
  server itself joins each version's session. ``/pause_generation {mode}`` →
  ``/begin_weight_update`` (0.5.21+; skipped when the server answers 404, as ≤ 0.5.19 do) →
  ``/init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
  backend}`` (the trainer's store; SGLang forms the group as the trainer does) → one
  ``/update_weights_from_distributed {names, dtypes, shapes, group_name, load_format:
  "flattened_bucket", flush_cache: false}`` per bucket of the session's plan, the last one with
  ``weight_version`` → ``/destroy_weights_update_group`` → ``/end_weight_update`` →
  ``/continue_generation``. NCCL on a GPU (``weights.broadcast_backend: nccl``); the flattened
  buckets need SGLang ≥ 0.5.13. A failed session leaves the weights partly updated, so the caller loads
  the version from disk.
* Health and readiness: ``GET /health_generate`` (503 while paused), ``GET /model_info`` and
  ``GET /server_info`` (its ``tp_size`` is the number of ranks the server takes in a session).

Weight versions go to SGLang as strings (``"3"``) and come back as integers. Checkpoint files must be
a directory SGLang can load (weights plus the model's config) for the disk path and the fallback.

Checked in CI against ``tests/support/torch_sglang_server.py``, a test double standing in for a GPU
SGLang server (the same HTTP contract backed by the torch engine, gloo instead of NCCL), and on a GPU
by ``benchmarks/gpu_sglang_check.py``.
"""

from __future__ import annotations

import logging
import threading
import time

import httpx

from rollout_service.engine import Engine, GenerationRequest, Sample
from shared.schemas import VersionSpan, WeightUpdate

log = logging.getLogger("rollout.sglang")


def _join(first: Sample, rest: Sample) -> Sample:
    """``first`` (ended by an abort) continued by ``rest``: ids, log-probs and spans (shifted) joined."""
    k = len(first.completion_ids)
    spans = list(first.versions) + [v.shifted(k) for v in rest.versions]
    return Sample(first.completion_ids + rest.completion_ids, first.logprobs + rest.logprobs, rest.finish_reason,
                  [v for v in spans if v.end > v.start] or spans[-1:], rest.error)


def parse_weight_version(v) -> int:
    """SGLang weight versions are strings; Flywheel's are integers (``"v3"`` and ``"3"`` are 3)."""
    try:
        return int(str(v).lstrip("v"))
    except ValueError:
        return 0


class SGLangEngine(Engine):
    """Generation and weight updates on one SGLang server at ``url``.

    Raises (from its methods):
        httpx.HTTPError: the server cannot be reached or answers an error status.
        RuntimeError: the server reports a failed weight update.
    """

    receives_in_server = True

    MAX_RESUBMITS = 8
    """Most times an aborted sample is resubmitted (``pause_mode: abort``) before it is returned as aborted."""

    def __init__(self, url: str, timeout_s: float = 600.0, max_context: int | None = None,
                 pause_mode: str = "retract") -> None:
        if pause_mode not in ("retract", "in_place", "abort"):
            raise ValueError(f"pause_mode must be retract, in_place or abort, not {pause_mode!r}")
        self.pause_mode = pause_mode
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s)
        self.policy_version = 0
        self.max_context = max_context
        self.broadcast_width = 1
        self._weights_lock = threading.Lock()  # one weight update at a time (disk, broadcast)
        self._begin_end: bool | None = None  # whether the server has /begin_weight_update (0.5.21+)

    # ------------------------------------------------------------------ health

    def wait_ready(self, timeout_s: float = 600.0) -> dict:
        """Block until ``/health_generate`` answers 200, then return ``/model_info`` (and take its
        ``weight_version`` as the policy version).

        Raises:
            TimeoutError: not ready within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.http.get("/health_generate", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang at {self.url} not ready after {timeout_s} s")
            time.sleep(1.0)
        info = self.http.get("/model_info").json()
        self.policy_version = parse_weight_version(info.get("weight_version", 0))
        try:
            server = self.http.get("/server_info")
            if server.status_code == 200:
                si = server.json()
                self.broadcast_width = int(si.get("tp_size") or 1)
                if int(si.get("dp_size") or 1) > 1 or int(si.get("pp_size") or 1) > 1:
                    log.warning("SGLang at %s runs dp_size %s / pp_size %s: its weight-update group takes "
                                "tp_size ranks only (SGLang 0.5.23 asserts dp_size == 1); use weights.transport: "
                                "checkpoint", self.url, si.get("dp_size"), si.get("pp_size"))
        except (httpx.HTTPError, ValueError):
            pass  # older servers: one rank
        return info

    # ------------------------------------------------------------------ generation

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """One ``/generate`` call for every sample (K copies of each prompt); samples a pause aborted are
        resubmitted as prompt + partial output for their remaining tokens, their spans joined."""
        input_ids, params = [], []
        for r in requests:
            s = r.sampling
            p = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p}
            if s.seed is not None:
                p["sampling_seed"] = s.seed
            for _ in range(r.n):
                input_ids.append(list(r.prompt_ids))
                params.append(p)
        if not input_ids:
            return []
        samples = self._generate_flat(input_ids, params)
        for _ in range(self.MAX_RESUBMITS):
            todo = [i for i, s in enumerate(samples)
                    if s.finish_reason == "abort" and len(s.completion_ids) < params[i]["max_new_tokens"]]
            if not todo:
                break
            more = self._generate_flat(
                [input_ids[i] + samples[i].completion_ids for i in todo],
                [dict(params[i], max_new_tokens=params[i]["max_new_tokens"] - len(samples[i].completion_ids))
                 for i in todo])
            for i, m in zip(todo, more):
                samples[i] = _join(samples[i], m)
        grouped, k = [], 0
        for r in requests:
            grouped.append(samples[k:k + r.n])
            k += r.n
        return grouped

    def _generate_flat(self, input_ids: list[list[int]], params: list[dict]) -> list[Sample]:
        resp = self.http.post("/generate", json={"input_ids": input_ids, "sampling_params": params,
                                                 "return_logprob": True, "logprob_start_len": -1})
        resp.raise_for_status()
        outs = resp.json()
        outs = outs if isinstance(outs, list) else [outs]
        return [self._sample(o) for o in outs]

    def _sample(self, out: dict) -> Sample:
        meta = out.get("meta_info", {})
        lps = meta.get("output_token_logprobs") or []
        ids = [int(t[1]) for t in lps]
        logprobs = [float(t[0]) for t in lps]
        if not ids and out.get("output_ids"):
            return Sample(list(out["output_ids"]), [], "error", [], "server returned no log-probs")
        fr = meta.get("finish_reason") or {}
        kind = fr.get("type") if isinstance(fr, dict) else str(fr)
        reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(kind, "error")
        spans = [VersionSpan(version=parse_weight_version(v["version"]), start=int(v["start"]), end=int(v["end"]))
                 for v in meta.get("weight_versions") or []]
        if not spans:
            spans = [VersionSpan(version=parse_weight_version(meta.get("weight_version", self.policy_version)), start=0,
                                 end=len(ids))]
        err = fr.get("message") if isinstance(fr, dict) and reason == "abort" else None
        return Sample(ids, logprobs, reason, spans, err)

    # ------------------------------------------------------------------ weights

    def update_weights(self, update: WeightUpdate) -> None:
        """Pause (in ``pause_mode``), load ``update.path`` from disk with its version, flush the prefix
        cache, continue (a version the server already holds is skipped).

        Raises:
            RuntimeError: the server could not load it (SGLang rolls a failed disk load back).
            ValueError: the version is a LoRA adapter.
        """
        if update.adapter is not None:  # SGLang serves LoRA through its own adapter API, not a weights reload
            raise ValueError(f"policy version {update.version} is a LoRA adapter: trainer.lora needs rollout.engine "
                             "torch")
        with self._weights_lock:
            if self.policy_version >= update.version:
                return
            self._pause()
            try:
                self._load_from_disk(update)
            finally:
                self._resume()

    def _load_from_disk(self, update: WeightUpdate) -> None:
        res = self._post("/update_weights_from_disk", {"model_path": update.path, "weight_version": str(update.version),
                                                        "flush_cache": False})
        if not res.get("success", False):
            raise RuntimeError(f"SGLang could not load version {update.version}: {res.get('message')}")
        self._flush()
        self.policy_version = update.version

    def receive_broadcast(self, update: WeightUpdate, rank_offset: int, world_size: int, plan: list[list[str]],
                          master_address: str, master_port: int, backend: str, timeout_s: float) -> bool:
        """Have the server join broadcast session ``v<update.version>`` and take its buckets (the sequence in
        the module docstring); ``update.manifest`` gives each tensor's shape and dtype. SGLang loads each
        bucket as it arrives, so when a session fails after the join the server loads the version from
        ``update.path`` before generation resumes (no span is generated by half-updated weights).

        Returns:
            True when the server took the version by broadcast, False when it already held it.

        Raises:
            RuntimeError: the server refused a step, could not be reached, or the session failed (then
                the server holds either its old weights or, from disk, the new version: see
                ``policy_version``). ``timeout_s`` + 30 s bounds each HTTP call of the session; the
                server's own bound on forming the group is SGLang's, and may be longer.
        """
        specs = {t.name: t for t in update.manifest}
        missing = [n for names in plan for n in names if n not in specs]
        if missing or not plan:
            raise RuntimeError(f"v{update.version}: an empty plan, or tensors missing from the manifest: {missing[:3]}")
        group = f"v{update.version}/"
        wait = timeout_s + 30
        with self._weights_lock:
            if self.policy_version >= update.version:
                return False
            self._pause()
            began = joined = False
            error: Exception | None = None
            try:
                try:
                    began = self._begin()
                    self._check(self._post("/init_weights_update_group", {
                        "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                        "world_size": world_size, "group_name": group, "backend": backend}, timeout=wait), "join")
                    joined = True
                    for k, names in enumerate(plan):
                        body = {"names": names, "dtypes": [specs[n].dtype for n in names],
                                "shapes": [specs[n].shape for n in names], "group_name": group,
                                "load_format": "flattened_bucket", "flush_cache": False}
                        if k == len(plan) - 1:
                            body["weight_version"] = str(update.version)
                        self._check(self._post("/update_weights_from_distributed", body, timeout=wait), f"bucket {k}")
                except (RuntimeError, httpx.HTTPError) as e:
                    error = e
                if joined:
                    self._post_quietly("/destroy_weights_update_group", {"group_name": group})
                if began:
                    self._post_quietly("/end_weight_update", {})
                if error is None:
                    self._flush()
                    self.policy_version = update.version
                elif joined and update.path:  # some buckets may be in: the checkpoint, before anything runs
                    try:
                        self._load_from_disk(update)
                        log.warning("broadcast of v%d failed (%s); the server loaded it from disk", update.version,
                                    error)
                    except (RuntimeError, httpx.HTTPError) as e:
                        log.error("broadcast of v%d failed (%s) and the disk load too (%s): the server's weights "
                                  "may be partly updated", update.version, error, e)
            finally:
                self._resume()
            if error is not None:
                raise RuntimeError(f"broadcast of v{update.version} failed: {error}") from error
            return True

    def _pause(self) -> None:
        self._post("/pause_generation", {"mode": self.pause_mode})

    def _flush(self) -> None:
        """Drop the prefix cache (KV computed under the old weights) while paused; servers that refuse
        (older ones, with requests waiting) are left as they are. Skipped with ``in_place``, whose held
        requests keep their cache."""
        if self.pause_mode == "in_place":
            return
        try:
            r = self.http.post("/flush_cache", json={}, timeout=30)
            if r.status_code != 200:
                log.info("/flush_cache answered %d; the prefix cache keeps old entries", r.status_code)
        except httpx.HTTPError as e:
            log.warning("/flush_cache failed: %s", e)

    def _resume(self) -> None:
        try:
            self._post("/continue_generation", {}, timeout=60)
        except httpx.HTTPError as e:
            log.error("/continue_generation failed, the server may still be paused: %s", e)

    def _begin(self) -> bool:
        """``/begin_weight_update`` when the server has it (0.5.21+ requires it around distributed updates)."""
        if self._begin_end is False:
            return False
        r = self.http.post("/begin_weight_update", json={})
        if r.status_code == 404:
            self._begin_end = False
            return False
        r.raise_for_status()
        self._begin_end = True
        self._check(r.json() if r.content else {"success": True}, "begin")
        return True

    @staticmethod
    def _check(res: dict, what: str) -> None:
        if res.get("success") is False:
            raise RuntimeError(f"SGLang weight update failed at {what}: {res.get('message')}")

    def _post_quietly(self, path: str, body: dict) -> None:
        try:
            self._post(path, body)
        except httpx.HTTPError as e:
            log.warning("%s failed: %s", path, e)

    def interrupt_with(self, update: WeightUpdate) -> bool:
        """The same sequence while a ``/generate`` is in flight: its requests are retracted, re-prefilled
        under the new weights and continue; the spans of their output carry both versions."""
        self.update_weights(update)
        return True

    def _post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST ``body``; the JSON answer, including SGLang's ``{success: false, message}`` refusals, which
        come with HTTP 400. Raises httpx.HTTPError for other error statuses and transport failures."""
        r = self.http.post(path, json=body, **({"timeout": timeout} if timeout else {}))
        if r.status_code == 400:
            try:
                res = r.json()
            except ValueError:
                res = None
            if isinstance(res, dict) and "success" in res:
                return res
        r.raise_for_status()
        try:
            return r.json()
        except ValueError:
            return {}

    def close(self) -> None:
        self.http.close()
