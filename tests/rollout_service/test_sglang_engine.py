"""The SGLang engine against the torch-backed stand-in server (SGLang's HTTP contract; not SGLang, which
needs a GPU: ``benchmarks/gpu_sglang_check.py`` checks the real one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from rollout_service.engine import GenerationRequest
from rollout_service.sglang_engine import SGLangEngine
from rollout_service.torch_engine import TorchEngine
from shared.model_weights import snapshot_weights
from tests.support.torch_sglang_server import build_app
from shared.model import build_tiny_model, encode_chat, load_model, load_tokenizer
from shared.checkpoint import manifest
from shared.schemas import SamplingParams, WeightUpdate
from shared.weight_sync import WeightReceiver
from tests.conftest import free_port

pytestmark = pytest.mark.e2e  # stand-in servers and trainer processes per test, a minute in all: the e2e tier


@pytest.fixture(params=[True])
def server(request, tmp_path):
    """The stand-in in a thread: (url, its torch engine, model dir, tmp dir). ``request.param`` is
    ``require_begin`` (True: SGLang 0.5.21+; False: ≤ 0.5.19, without begin/end)."""
    import uvicorn

    d = build_tiny_model(tmp_path / "tiny")
    engine = TorchEngine(load_model(d), load_tokenizer(d), seed=0)
    port = free_port()
    app = build_app(engine, str(d), require_begin=request.param, group_timeout_s=10.0)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", engine, d, tmp_path
    finally:
        srv.should_exit = True
        t.join(10)


def test_generate_returns_ids_logprobs_and_versions_token_in_token_out(server):
    url, backend, d, _ = server
    eng = SGLangEngine(url)
    assert eng.wait_ready(timeout_s=10)["weight_version"] == "0"
    p = encode_chat(backend.tokenizer, [{"role": "user", "content": "hi"}])
    out = eng.generate([GenerationRequest(p, 3, SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)),
                        GenerationRequest(p[:-1], 1, SamplingParams(max_new_tokens=4, temperature=0.0))])
    assert [len(o) for o in out] == [3, 1]
    for prompt, group in ((p, out[0]), (p[:-1], out[1])):
        for s in group:
            assert 1 <= len(s.completion_ids) == len(s.logprobs) and s.finish_reason in ("stop", "length")
            assert [(v.version, v.start, v.end) for v in s.versions] == [(0, 0, len(s.completion_ids))]
    # the log-probs are the behaviour policy's at the sampling temperature
    s = out[0][0]
    with torch.no_grad():
        logits = backend.model(torch.tensor([p + s.completion_ids])).logits[0, len(p) - 1:-1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=1e-4)
    eng.close()


def test_update_from_disk_pauses_loads_the_version_and_continues(server):
    url, backend, d, tmp = server
    eng = SGLangEngine(url)
    other = build_tiny_model(tmp / "other", seed=9)
    eng.update_weights(WeightUpdate(model="m", version=3, step=3, manifest=[], checksum="sha256:x", path=str(other)))
    assert eng.policy_version == 3 and eng.http.get("/model_info").json()["weight_version"] == "3"
    assert eng.http.get("/health_generate").status_code == 200  # continued after the update
    from safetensors.torch import load_file

    want = load_file(str(next(other.glob("*.safetensors"))))
    assert all(torch.equal(backend.model.state_dict()[k], v) for k, v in want.items() if k in backend.model.state_dict())
    p = encode_chat(backend.tokenizer, [{"role": "user", "content": "x"}])
    (s,) = eng.generate([GenerationRequest(p, 1, SamplingParams(max_new_tokens=3, temperature=0.0))])[0]
    assert s.versions[-1].version == 3
    eng.http.post("/pause_generation", json={"mode": "retract"})
    assert eng.http.get("/health_generate").status_code == 503  # paused, as SGLang reports it
    eng.http.post("/continue_generation", json={})
    bad = eng.http.post("/update_weights_from_disk", json={"model_path": str(tmp / "nothing"), "weight_version": "4"})
    assert bad.json()["success"] is False
    with pytest.raises(RuntimeError, match="could not load version 4"):
        eng.update_weights(WeightUpdate(model="m", version=4, step=4, manifest=[], checksum="sha256:x",
                                        path=str(tmp / "nothing")))
    assert eng.policy_version == 3 and eng.http.get("/health_generate").status_code == 200
    eng.close()


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_an_update_during_generation_continues_it_under_the_new_version(server, mode):
    """Each pause mode: the samples in flight end with 400 tokens in two spans (with ``abort`` the server
    returns them partial and the engine resubmits prompt + partial output)."""
    url, backend, d, tmp = server
    backend.model.generation_config.eos_token_id = None
    backend.eos_ids = set()
    eng = SGLangEngine(url, pause_mode=mode)
    calls = []
    eng.http.event_hooks["request"].append(lambda r: calls.append(r.url.path))
    other = build_tiny_model(tmp / "other", seed=9)
    p = encode_chat(backend.tokenizer, [{"role": "user", "content": "long"}])
    result = {}
    t = threading.Thread(target=lambda: result.update(out=eng.generate(
        [GenerationRequest(p, 2, SamplingParams(max_new_tokens=400, temperature=1.0, seed=1))])))
    t.start()
    time.sleep(0.3)  # the generation is under way
    eng.interrupt_with(WeightUpdate(model="m", version=1, step=1, manifest=[], checksum="sha256:x", path=str(other)))
    t.join(60)
    for s in result["out"][0]:
        assert len(s.completion_ids) == 400
        vs = [(v.version, v.start, v.end) for v in s.versions]
        assert [v for v, _, _ in vs] == [0, 1] and vs[0][1] == 0 and vs[0][2] == vs[1][1] and vs[1][2] == 400, vs
    assert calls.count("/generate") == (2 if mode == "abort" else 1), calls
    assert ("/flush_cache" in calls) == (mode != "in_place")
    eng.close()


TRAINER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from shared.model_weights import snapshot_weights
    from shared.model import load_model
    from shared.weight_sync import WeightBroadcaster
    port, out, receivers = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
    bc = WeightBroadcaster("127.0.0.1", port, timeout_s=10.0, bucket_bytes=64 * 1024)  # several buckets
    (out / "ready").touch()
    version = 1
    while True:
        go = out / f"go{version}"
        while not go.exists():
            time.sleep(0.01)
        weights = snapshot_weights(load_model(Path(go.read_text())))
        bc.prepare(version, receivers, weights)
        res = bc.broadcast(version, weights, receivers)
        (out / f"v{version}.part").write_text(json.dumps(res))
        os.replace(out / f"v{version}.part", out / f"v{version}.json")  # the test polls for the name
        version += 1
""")


@pytest.fixture
def trainer(tmp_path):
    """The trainer's side of the broadcast in its own process (a process group name is registered once
    per process, so the stand-in server and the trainer cannot share one): ``start(receivers)`` returns
    ``(port, session)``, where ``session(eng, receiver, version, model_dir)`` runs one version's session
    (calling ``before_join()``, if given, once the trainer waits for the server; ``edit`` changes the
    WeightUpdate the engine sees)."""
    procs: list[subprocess.Popen] = []

    def start(receivers: list[str]):
        port, out = free_port(), tmp_path / f"trainer{len(procs)}"
        out.mkdir()
        procs.append(subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(out), ",".join(receivers)],
                                      env=dict(os.environ, PYTHONPATH=os.getcwd())))
        deadline = time.monotonic() + 60
        while not (out / "ready").exists():
            assert procs[-1].poll() is None and time.monotonic() < deadline, "trainer did not start"
            time.sleep(0.02)

        def session(eng: SGLangEngine, receiver: WeightReceiver, version: int, model_dir: Path,
                    before_join=None, edit=None) -> dict:
            weights = snapshot_weights(load_model(model_dir))
            update = WeightUpdate(model="m", version=version, step=version, manifest=manifest(weights),
                                  checksum="sha256:x", transport="distributed", receivers=receivers,
                                  path=str(model_dir))
            update = edit(update) if edit is not None else update
            # written whole, then renamed: the trainer polls for the name and could read an empty file
            (out / f"go{version}.part").write_text(str(model_dir))
            os.replace(out / f"go{version}.part", out / f"go{version}")
            try:
                rank, world = receiver.session(version)  # the trainer has prepared the session
                if before_join is not None:
                    before_join()
                eng.receive_broadcast(update, rank, world, receiver.plan(version), "127.0.0.1", port, "gloo", 10.0)
            finally:
                deadline = time.monotonic() + 30
                while not (out / f"v{version}.json").exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            return json.loads((out / f"v{version}.json").read_text())

        return port, session

    yield start
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.parametrize("server", [True, False], indirect=True, ids=["sglang-0.5.21+", "sglang-0.5.19"])
def test_broadcast_sessions_update_the_server_in_place(server, trainer):
    """The NCCL path's HTTP sequence (gloo here): the server joins each version's session through
    /init_weights_update_group, takes flattened buckets, and serves the new version exactly."""
    url, backend, d, tmp = server
    eng = SGLangEngine(url)
    eng.wait_ready(timeout_s=10)
    port, session = trainer(["sglang-0"])
    receiver = WeightReceiver("127.0.0.1", port, "sglang-0", timeout_s=60.0, width=eng.broadcast_width)
    try:
        for version, seed in ((1, 9), (2, 11)):  # the group is destroyed after each: its name is free again
            model_dir = build_tiny_model(tmp / f"w{seed}", seed=seed)
            weights = snapshot_weights(load_model(model_dir))
            res = session(eng, receiver, version, model_dir)
            assert res["ok"] and len(receiver.plan(version)) > 1, res
            assert eng.policy_version == version and eng.http.get("/model_info").json()["weight_version"] == str(version)
            have = backend.model.state_dict()
            assert all(torch.equal(have[k], v) for k, v in weights.items())
        p = encode_chat(backend.tokenizer, [{"role": "user", "content": "x"}])
        (s,) = eng.generate([GenerationRequest(p, 1, SamplingParams(max_new_tokens=3, temperature=0.0))])[0]
        assert s.versions[-1].version == 2
        assert eng.http.get("/health_generate").status_code == 200  # continued
    finally:
        receiver.close()
        eng.close()


def test_a_broadcast_mid_generation_tags_both_versions(server, trainer):
    url, backend, d, tmp = server
    backend.model.generation_config.eos_token_id = None
    backend.eos_ids = set()
    eng = SGLangEngine(url)
    port, session = trainer(["sglang-0"])
    receiver = WeightReceiver("127.0.0.1", port, "sglang-0", timeout_s=60.0)
    p = encode_chat(backend.tokenizer, [{"role": "user", "content": "long"}])
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=eng.generate(
        [GenerationRequest(p, 2, SamplingParams(max_new_tokens=400, temperature=1.0, seed=1))])))

    def generating():
        t.start()
        time.sleep(0.3)  # under way

    try:
        assert session(eng, receiver, 1, build_tiny_model(tmp / "w", seed=9), before_join=generating)["ok"]
        t.join(60)
        for s in out["r"][0]:
            vs = [(v.version, v.start, v.end) for v in s.versions]
            assert [v for v, _, _ in vs] == [0, 1] and vs[0][2] == vs[1][1] and vs[1][2] == 400, vs
    finally:
        receiver.close()
        eng.close()


def test_a_session_that_never_forms_fails_cleanly_and_the_server_goes_on(server, trainer):
    """A member that never joins: the trainer's broadcast and the server's join both time out; the engine
    raises (the caller loads the checkpoint) and the server is unpaused, on its old version."""
    url, backend, d, tmp = server
    eng = SGLangEngine(url)
    port, session = trainer(["sglang-0", "ghost"])
    receiver = WeightReceiver("127.0.0.1", port, "sglang-0", timeout_s=60.0)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    try:
        with pytest.raises(RuntimeError, match="at join"):
            session(eng, receiver, 1, build_tiny_model(tmp / "w", seed=9))
        assert eng.policy_version == 0 and eng.http.get("/health_generate").status_code == 200
        assert all(torch.equal(before[k], v) for k, v in backend.model.state_dict().items())
    finally:
        receiver.close()
        eng.close()


def test_a_session_that_breaks_after_the_join_loads_the_version_from_disk_before_resuming(server, trainer):
    """SGLang loads buckets as they arrive: when the last bucket is refused (HTTP 400, as SGLang answers),
    the engine loads the version from its checkpoint while still paused, then raises."""
    url, backend, d, tmp = server
    eng = SGLangEngine(url)
    port, session = trainer(["sglang-0"])
    receiver = WeightReceiver("127.0.0.1", port, "sglang-0", timeout_s=60.0)
    model_dir = build_tiny_model(tmp / "w", seed=9)

    def wrong_last_shape(u: WeightUpdate) -> WeightUpdate:  # plans go in name order: this one is last
        last = max(t.name for t in u.manifest)
        return u.model_copy(update={"manifest": [t.model_copy(update={"shape": [1]}) if t.name == last else t
                                                 for t in u.manifest]})

    try:
        with pytest.raises(RuntimeError, match=r"broadcast of v1 failed.*bucket \d+.*wrong shapes"):
            session(eng, receiver, 1, model_dir, edit=wrong_last_shape)
        assert eng.policy_version == 1 and eng.http.get("/model_info").json()["weight_version"] == "1"
        assert eng.http.get("/health_generate").status_code == 200
        want = snapshot_weights(load_model(model_dir))
        have = backend.model.state_dict()
        assert all(torch.equal(have[k], v) for k, v in want.items())
    finally:
        receiver.close()
        eng.close()
