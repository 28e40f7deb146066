"""The ``sglang`` engine: an SGLang server driven over its HTTP API (../shared/notes/sglang-api.md).

* Generation: ``POST /generate`` with ``input_ids`` (token in, token out), ``return_logprob`` and
  ``logprob_start_len: -1``; ids and behaviour log-probs come from ``meta_info.output_token_logprobs``
  (``[logprob, token_id, text]`` per token), the finish reason from ``meta_info.finish_reason.type``,
  and the version of every output span from ``meta_info.weight_versions`` (≥ 0.5.19) or
  ``meta_info.weight_version``. The K samples of a prompt are sent as K copies of it in one batch:
  SGLang's radix cache prefills the shared prompt once.
* Weights from disk: ``/pause_generation {mode: retract}`` → ``/update_weights_from_disk {model_path,
  weight_version, flush_cache: false}`` → ``/continue_generation``. With ``retract`` the requests in
  flight go back to the queue and re-prefill under the new weights, so an update mid-generation is
  the interruptible policy: each span is tagged with its version.
* Health and readiness: ``GET /health_generate`` (503 while paused) and ``GET /model_info``.

Not yet: the NCCL path (``/init_weights_update_group``, ``/begin_weight_update``,
``/update_weights_from_distributed`` with flattened buckets, ``/end_weight_update``); the trainer's
broadcast would need an SGLang receiver. Engines then load each version from the checkpoint file,
which must be a directory SGLang can load (weights plus the model's config).

Checked in CI against :mod:`rollout_service.torch_sglang_server` (the same HTTP contract backed by the
torch engine) and on a GPU by ``benchmarks/gpu_sglang_check.py``.
"""

from __future__ import annotations

import logging
import time

import httpx

from rollout_service.engine import Engine, GenerationRequest, Sample
from shared.schemas import VersionSpan, WeightUpdate

log = logging.getLogger("rollout.sglang")


def _version(v) -> int:
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

    def __init__(self, url: str, timeout_s: float = 600.0, max_context: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s)
        self.policy_version = 0
        self.max_context = max_context

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
        self.policy_version = _version(info.get("weight_version", 0))
        return info

    # ------------------------------------------------------------------ generation

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
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
        resp = self.http.post("/generate", json={"input_ids": input_ids, "sampling_params": params,
                                                 "return_logprob": True, "logprob_start_len": -1})
        resp.raise_for_status()
        outs = resp.json()
        outs = outs if isinstance(outs, list) else [outs]
        samples = [self._sample(o) for o in outs]
        grouped, k = [], 0
        for r in requests:
            grouped.append(samples[k:k + r.n])
            k += r.n
        return grouped

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
        spans = [VersionSpan(version=_version(v["version"]), start=int(v["start"]), end=int(v["end"]))
                 for v in meta.get("weight_versions") or []]
        if not spans:
            spans = [VersionSpan(version=_version(meta.get("weight_version", self.policy_version)), start=0,
                                 end=len(ids))]
        err = fr.get("message") if isinstance(fr, dict) and reason == "abort" else None
        return Sample(ids, logprobs, reason, spans, err)

    # ------------------------------------------------------------------ weights

    def update_weights(self, update: WeightUpdate) -> None:
        """Pause (retract), load ``update.path`` from disk with its version, continue."""
        self._post("/pause_generation", {"mode": "retract"})
        try:
            res = self._post("/update_weights_from_disk", {"model_path": update.path, "weight_version": str(update.version),
                                                            "flush_cache": False})
            if not res.get("success", False):
                raise RuntimeError(f"SGLang could not load version {update.version}: {res.get('message')}")
            self.policy_version = update.version
        finally:
            self._post("/continue_generation", {})

    def interrupt_with(self, update: WeightUpdate) -> bool:
        """The same sequence while a ``/generate`` is in flight: its requests are retracted, re-prefilled
        under the new weights and continue; the spans of their output carry both versions."""
        self.update_weights(update)
        return True

    def _post(self, path: str, body: dict) -> dict:
        r = self.http.post(path, json=body)
        r.raise_for_status()
        try:
            return r.json()
        except ValueError:
            return {}

    def close(self) -> None:
        self.http.close()
