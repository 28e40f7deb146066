"""End to end through the CLI: five service processes, the embedded broker, a tiny model, a toy domain."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flywheel.broker import die_with_parent
from tests.support.system import procs_under

from shared.model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


_procs_under = procs_under


def _flywheel(*args, cwd, timeout=600, check=True):
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, preexec_fn=die_with_parent())  # a killed test run leaves no system
    if check and r.returncode != 0:
        raise AssertionError(f"flywheel {' '.join(args)} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")




def test_run_trains_toy_domain_and_reward_rises(tiny, tmp_path):
    report = tmp_path / "report.json"
    r = _flywheel("run", str(ROOT / "examples/toy.yaml"), "--set", f"model.name={tiny}", "--set",
                  f"run.dir={tmp_path / 'runs'}", "--report", str(report), "--timeout", "400", cwd=tmp_path)
    rep = json.loads(report.read_text())
    assert report.with_suffix(".png").stat().st_size > 1000
    hist = rep["history"]
    assert rep["steps"] == 25 and [h["step"] for h in hist] == list(range(1, 26))
    first = sum(h["mean_reward"] for h in hist[:5]) / 5
    last = sum(h["mean_reward"] for h in hist[-5:]) / 5
    assert last > first + 0.15, (first, last, r.stdout[-2000:])
    assert rep["eval"]["before"]["n"] == 16 and rep["eval"]["before"]["policy_version"] == 0
    assert rep["eval"]["after"]["policy_version"] == 25
    # not a terminal: one progress line per step reached, the precision chosen for this CPU said and reported
    steps = {int(m) for m in re.findall(r"^step (\d+)/25 ", r.stdout, flags=re.M)}
    assert 25 in steps and len(steps) >= 5, r.stdout[-2000:]
    assert set(rep["precision"]) == {"rollout.dtype", "trainer.autocast_bf16", "trainer.output_bf16"}
    assert all(p["dtype"] in ("float32", "bfloat16") and p["requested"] == "auto" for p in rep["precision"].values())
    assert "precision: rollout.dtype " in r.stdout
    assert rep["eval"]["after"]["accuracy"] > rep["eval"]["before"]["accuracy"]
    assert all(h["train/staleness_max"] <= 1 for h in hist)
    # genuine learning (the pass rate climbs fast from near 0) trips no breaker; warnings are reported
    assert rep["alerts"]["critical"] == 0, rep["alerts"]
    print("toy run alerts:", rep["alerts"])
    # everything stopped: no process of the run is left
    run_dir = Path(rep["run_dir"])
    assert not (run_dir / "flywheel.json").exists()
    assert _procs_under(run_dir) == []


def test_a_run_stopped_by_its_timeout_still_writes_its_report(tiny, tmp_path):
    """``--timeout`` passes mid-training: the command fails, and the report holds the steps reached and why."""
    report = tmp_path / "report.json"
    r = _flywheel("run", str(ROOT / "examples/toy.yaml"), "--set", f"model.name={tiny}", "--set",
                  f"run.dir={tmp_path / 'runs'}", "--set", "budget.max_steps=100000", "--report", str(report),
                  # the toy tasks may all retire within the 90 s (the scheduler would say so and the run end): this
                  # test is about the timeout
                  "--set", "scheduler.stall_after_s=3600", "--timeout", "90", cwd=tmp_path, check=False)
    assert r.returncode == 1 and "the job stopped: TimeoutError" in r.stdout and "Traceback" not in r.stderr, r.stderr[-2000:]
    rep = json.loads(report.read_text())
    assert rep["interrupted"].startswith("TimeoutError") and rep["steps"] >= 1, (rep.get("interrupted"), r.stdout[-2000:])
    assert [h["step"] for h in rep["history"]] == list(range(1, rep["steps"] + 1))
    assert rep["eval"]["after"] is None and "stopped early" in r.stdout
    assert _procs_under(Path(rep["run_dir"])) == []


def test_up_submit_status_supervise_down(tiny, tmp_path):
    runs = tmp_path / "runs"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model: {{name: '{tiny}'}}\nrun: {{dir: '{runs}'}}\nbudget: {{max_steps: 2}}\n"
                   "scheduler: {max_tokens: 2}\n")
    env = dict(os.environ, FLYWHEEL_CONFIG=str(cfg))
    up = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "up", str(cfg)], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                          preexec_fn=die_with_parent())
    try:
        state_file = runs / "system" / "flywheel.json"
        deadline = time.monotonic() + 180
        while not state_file.exists():
            assert up.poll() is None, up.stdout.read()
            assert time.monotonic() < deadline, "system did not come up"
            time.sleep(0.5)
        state = json.loads(state_file.read_text())
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text("\n".join(json.dumps({"task_id": f"t{i}", "domain": "toy",
                                               "prompt": [{"role": "user", "content": f"q{i}"}],
                                               "verifier": {"kind": "regex", "pattern": "^a"},
                                               "samples_per_task": 2}) for i in range(3)) + "\n")
        sub = _flywheel("submit", str(tasks), cwd=tmp_path)
        assert "submitted 3 tasks" in sub.stdout
        t = httpx.get(f"{state['scheduler_url']}/v1/tasks/t0", timeout=5).json()
        assert t["domain"] == "toy"
        st = _flywheel("status", "--run-dir", str(runs / "system"), cwd=tmp_path)
        assert "scheduler" in st.stdout and "running" in st.stdout and "policy_version" in st.stdout
        assert f"{state['scheduler_url']}/dashboard" in st.stdout
        # the compose job's command against this system: submits the config's toy tasks, trains, evaluates
        job_cfg = tmp_path / "job.yaml"
        job_cfg.write_text(f"model: {{name: '{tiny}'}}\nrun: {{dir: '{runs}'}}\nbudget: {{max_steps: 2}}\n"
                           "tasks: {kind: toy_prefix, train_size: 8, eval_size: 4, samples_per_task: 2}\n")
        report = tmp_path / "job.json"
        job = _flywheel("job", str(job_cfg), "--url", state["scheduler_url"], "--report", str(report),
                        "--timeout", "300", "--wait", "30", cwd=tmp_path)
        assert "held-out greedy accuracy" in job.stdout, job.stdout
        rep = json.loads(report.read_text())
        assert rep["steps"] >= 2 and rep["eval"]["after"]["n"] == 4, rep["eval"]
        assert httpx.get(f"{state['scheduler_url']}/v1/tasks/toy-train-0", timeout=5).json()["domain"] == "toy_prefix"
        # supervision: a killed service is reported and restarted
        victim = state["services"]["verifier"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while json.loads(state_file.read_text())["services"]["verifier"] == victim:
            assert time.monotonic() < deadline, "dead verifier was not restarted"
            time.sleep(0.5)
        new_state = json.loads(state_file.read_text())
        assert _alive(new_state["services"]["verifier"])
        _flywheel("down", "--run-dir", str(runs / "system"), cwd=tmp_path)
        up.wait(60)
        out = up.stdout.read()
        assert "service verifier" in out and "killed by SIGKILL" in out and "restarting verifier" in out, out[-3000:]
        for pid in [new_state["broker_pid"], *new_state["services"].values()]:
            assert not _alive(pid), f"pid {pid} still running"
    finally:
        if up.poll() is None:  # the supervisor stops its services on SIGTERM
            up.terminate()
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait(10)
        for pid in _procs_under(runs):  # whatever a failure left behind, stopped by pid
            os.kill(pid, signal.SIGKILL)


def test_weights_travel_by_broadcast_and_the_file_stays_the_fallback(tiny, tmp_path):
    """weights.transport=distributed: each version reaches the rollout engine over gloo (trainer
    metrics say so, the rollout log says which way it loaded), and training still works."""
    report = tmp_path / "report.json"
    _flywheel("run", str(ROOT / "examples/toy.yaml"), "--set", f"model.name={tiny}", "--set",
              f"run.dir={tmp_path / 'runs'}", "--set", "weights.transport=distributed", "--set",
              "budget.max_steps=8", "--report", str(report), "--timeout", "300", cwd=tmp_path)
    rep = json.loads(report.read_text())
    hist = rep["history"]
    assert len(hist) == 8
    sent = [h.get("weights/broadcast_ok") for h in hist]
    assert sum(1 for x in sent if x == 1.0) >= 6, sent  # the first version may go out before the engine registered
    log = (Path(rep["run_dir"]) / "logs" / "rollout.log").read_text()
    assert "(broadcast)" in log and "registered for weight broadcasts" in log
    assert rep["eval"]["after"]["policy_version"] == 8


def test_an_sglang_engine_takes_broadcast_weights_in_the_server(tiny, tmp_path):
    """rollout.engine=sglang against the torch-backed stand-in (SGLang's HTTP contract, not SGLang) with
    weights.transport=distributed: the server itself joins each version's session
    (/init_weights_update_group, flattened buckets), and training runs end to end on its samples."""
    from flywheel.broker import free_port, stop_pid

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tests.support.torch_sglang_server", str(tiny), "--port",
                               str(port)], cwd=ROOT)
    try:
        report = tmp_path / "report.json"
        _flywheel("run", str(ROOT / "examples/toy.yaml"), "--set", f"model.name={tiny}", "--set",
                  f"run.dir={tmp_path / 'runs'}", "--set", "rollout.engine=sglang", "--set",
                  f"rollout.sglang_url=http://127.0.0.1:{port}", "--set", "weights.transport=distributed",
                  "--set", "budget.max_steps=6", "--report", str(report), "--timeout", "300", cwd=tmp_path)
        rep = json.loads(report.read_text())
        sent = [h.get("weights/broadcast_ok") for h in rep["history"]]
        assert len(sent) == 6 and sum(1 for x in sent if x == 1.0) >= 4, sent
        log = (Path(rep["run_dir"]) / "logs" / "rollout.log").read_text()
        assert "received policy version 6 by broadcast" in log, log[-3000:]
        assert httpx.get(f"http://127.0.0.1:{port}/model_info", timeout=5).json()["weight_version"] == "6"
        assert rep["eval"]["after"]["policy_version"] == 6
    finally:
        stop_pid(server)


def test_interrupting_generation_for_new_weights_runs_end_to_end(tiny, tmp_path):
    """``rollout.weight_update_policy: interrupt``: versions load mid-generation, the trajectories carry
    tokens of two versions, and training goes on and learns."""
    report = tmp_path / "report.json"
    _flywheel("run", str(ROOT / "examples/toy.yaml"), "--set", f"model.name={tiny}", "--set",
              f"run.dir={tmp_path / 'runs'}", "--set", "rollout.weight_update_policy=interrupt", "--set",
              "scheduler.max_tokens=48", "--set", "budget.max_steps=10", "--report", str(report),
              "--timeout", "300", cwd=tmp_path)
    rep = json.loads(report.read_text())
    assert rep["steps"] == 10
    log_text = next((Path(rep["run_dir"]) / "logs").glob("rollout.log")).read_text()
    assert "interrupting generation to load it" in log_text
    mixed = [h for h in rep["history"] if h.get("train/staleness_max", 0) >= 1]
    assert mixed, "no step trained on tokens older than its policy version"
    assert all(h["train/staleness_max"] <= 1 for h in rep["history"])  # η = 1 holds for the oldest token


def test_a_run_that_drops_groups_still_reaches_max_steps(tiny, tmp_path):
    """Groups the trainer drops give their slot back: with η = 1, generation interrupted for new weights
    (stale groups) and a third of the training tasks refused by the rollout (prompts longer than the
    model's context: failed groups, in every epoch over 12 tasks), the run still trains all 10 steps, and
    the drops are reported as they happen (status, report, the trainer's and the scheduler's logs)."""
    long_tasks = tmp_path / "long.jsonl"
    with long_tasks.open("w") as f:
        for i in range(4):  # ~3000 digits: far beyond the tiny model's 512 positions
            f.write(json.dumps({"task_id": f"long-{i}", "domain": "toy_prefix", "split": "train",
                                "prompt": [{"role": "user", "content": f"{i} " + "1234567890 " * 300}],
                                "verifier": {"kind": "regex", "pattern": "^[a-z]"}, "samples_per_task": 8}) + "\n")
    report = tmp_path / "report.json"
    _flywheel("run", str(ROOT / "examples/toy.yaml"), "--set", f"model.name={tiny}", "--set",
              f"run.dir={tmp_path / 'runs'}", "--set", "rollout.weight_update_policy=interrupt", "--set",
              "scheduler.max_tokens=48", "--set", "tasks.train_size=8", "--set", "budget.max_steps=10",
              # a third of the domain's tasks fail by design: the drift monitor would (rightly) open its breaker
              # at an infra error rate of 0.5, and this test is about the drops' accounting
              "--set", "monitor.enabled=false",
              # the scheduler now refuses such prompts at the door; claim a long context there so
              # they get through and fail in the rollout, the path this test is about
              "--set", "scheduler.context_tokens=100000",
              "--submit", str(long_tasks), "--report", str(report), "--timeout", "300", cwd=tmp_path)
    rep = json.loads(report.read_text())
    assert rep["steps"] == 10 and rep["eval"]["after"]["policy_version"] == 10
    dropped = rep["dropped_groups"]
    assert dropped.get("failed", 0) >= 4, dropped  # each long task at least once
    logs = Path(rep["run_dir"]) / "logs"
    trainer_log, scheduler_log = (logs / "trainer.log").read_text(), (logs / "scheduler.log").read_text()
    assert "dropped group long-" in trainer_log and "slot returned to the scheduler" in trainer_log
    assert "its slot is given back" in scheduler_log
    assert all(h["train/staleness_max"] <= 1 for h in rep["history"])


def test_a_lora_run_publishes_adapters_that_the_engine_serves(tiny, tmp_path):
    """trainer.lora: every version in the checkpoint store is an adapter (no full weights), the rollout engine
    applies each one (its canary agrees with the trainer's: no group dropped, no canary alert), and the toy
    domain is learned (held-out greedy accuracy 0 -> 1 in a trial run at this learning rate; the adapters start
    at zero, so the tiny model needs a larger one than full fine-tuning's 3e-3)."""
    report = tmp_path / "report.json"
    r = _flywheel("run", str(ROOT / "examples/toy.yaml"), "--set", f"model.name={tiny}", "--set",
                  f"run.dir={tmp_path / 'runs'}", "--set", "trainer.lora.r=8", "--set", "trainer.lora.alpha=16",
                  "--set", "trainer.lr=1.0e-1", "--set", "trainer.keep_checkpoints=100",
                  "--report", str(report), "--timeout", "400", cwd=tmp_path)
    rep = json.loads(report.read_text())
    hist = rep["history"]
    assert rep["steps"] == 25 and rep["eval"]["after"]["policy_version"] == 25
    before, after = rep["eval"]["before"]["accuracy"], rep["eval"]["after"]["accuracy"]
    assert after >= before + 0.5, (before, after, r.stdout[-2000:])
    first = sum(h["mean_reward"] for h in hist[:5]) / 5
    last = sum(h["mean_reward"] for h in hist[-5:]) / 5
    assert last > first, (first, last)
    ckpt = Path(rep["run_dir"]) / "checkpoints"
    versions = sorted(ckpt.glob("v0*"))
    assert len(versions) == 25, versions
    assert all((v / "adapter_model.safetensors").is_file() and not (v / "model.safetensors").exists()
               for v in versions)
    update = json.loads((versions[-1] / "update.json").read_text())
    assert update["adapter"]["r"] == 8 and update["path"].endswith("adapter_model.safetensors")
    assert rep["dropped_groups"].get("canary", 0) == 0 and rep["alerts"]["critical"] == 0, rep
    assert all(h.get("canary/failing_engines", 0) == 0 for h in hist)
    assert any(h.get("canary/abs_logp_diff_max") is not None for h in hist)


def test_a_run_whose_tasks_all_retire_ends_saying_why(tiny, tmp_path):
    """Every sample passes (a pattern anything matches), so every training task retires after its first two
    groups (the lifecycle default): the scheduler has nothing left to issue long before max_steps, says so
    (``run/stalled``, naming the domain's reason), and ``flywheel run`` ends on it with its report instead of
    waiting out its timeout."""
    report = tmp_path / "report.json"
    r = _flywheel("run", str(ROOT / "examples/toy.yaml"), "--set", f"model.name={tiny}", "--set",
                  f"run.dir={tmp_path / 'runs'}", "--set", "tasks.toy_pattern=.*", "--set", "tasks.train_size=4",
                  "--set", "budget.max_steps=1000", "--set", "scheduler.stall_after_s=5", "--set", "monitor.enabled=false",
                  "--report", str(report), "--timeout", "900", cwd=tmp_path, check=False)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "the run cannot go on" in r.stdout and "toy_prefix: no live training task at level 0 (4 of 4 retired)" \
        in r.stdout.replace("\n", " "), r.stdout[-3000:]
    rep = json.loads(report.read_text())
    assert rep["interrupted"].startswith("RunStalled: the run cannot go on"), rep["interrupted"]
    assert 0 < rep["steps"] < 1000
    alerts = (Path(rep["run_dir"]) / "logs" / "scheduler.log").read_text()
    assert "ALERT firing run/stalled [critical]" in alerts
