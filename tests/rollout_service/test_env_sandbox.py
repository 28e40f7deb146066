"""An environment's sandbox in the rollout: tools and hooks that run code in the rollout's own session, a workspace
shipped with the environment that each rollout starts from, snapshots and rollback, and the sandbox's failures as
error samples. Against the real sandbox service, with a real (tiny, taught) model where a rollout is driven."""

from __future__ import annotations

import asyncio

import pytest

from rollout_service.env_loop import encode_with_tools, run_env_loop
from rollout_service.torch_engine import TorchEngine
from shared.auth import token_from_run_dir
from shared.client import AsyncApiClient, RetryPolicy
from shared.envs import Environment
from shared.envs.sandbox import Sandbox, SandboxError, pack_workspace
from shared.envs.tools import HookError, call_tool
from shared.schemas import SamplingParams, Task
from shared.tools import format_tool_call
from tests.support.taught import teach_tiny_mixture

GREEDY = SamplingParams(max_new_tokens=60, temperature=0.0)


def _client(url: str) -> AsyncApiClient:
    """The rollout service's kind of client (the token from ``$FLYWHEEL_AUTH__TOKEN_FILE``, set by conftest)."""
    return AsyncApiClient(url, lambda: token_from_run_dir(None), timeout=30.0,
                          retry=RetryPolicy(deadline_s=30.0, retry_for_s=2.0))


@pytest.fixture
def workspace(tmp_path):
    d = tmp_path / "repo"
    (d / "src").mkdir(parents=True)
    (d / "notes.txt").write_text("keep me\n")
    (d / "src" / "app.py").write_text("print('hello from the workspace')\n")
    (d / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (d / "run.sh").chmod(0o755)
    return d


async def _ls(sandbox: Sandbox) -> str:
    out = await sandbox.run("find . -mindepth 1 | sort", language="bash")
    assert out["status"] == "ok", out
    return out["stdout"]


def test_a_workspace_packs_the_same_bytes_for_the_same_tree_and_refuses_a_symlink(workspace, tmp_path):
    a = pack_workspace(str(workspace))
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(workspace, copy)
    b = pack_workspace(str(copy))
    assert a.digest == b.digest and a.files == 3
    (copy / "link").symlink_to("/etc/passwd")
    pack_workspace.cache_clear()
    with pytest.raises(ValueError, match="'link' is not a regular file"):
        pack_workspace(str(copy))
    with pytest.raises(ValueError, match="workspace"):
        Environment(dataset=[], rubric=lambda: 1.0, workspace=copy)


async def test_each_session_starts_from_the_workspace_keeps_its_changes_and_rolls_back(sandbox_url, workspace):
    """A rollout that deletes its whole workspace and rolls back: the next run sees it restored; another
    rollout's session never sees the deletion."""
    http = _client(sandbox_url)
    ws = pack_workspace(str(workspace))
    a, b = Sandbox(http, ws), Sandbox(http, ws)
    try:
        start = await _ls(a)
        assert start == "./notes.txt\n./run.sh\n./src\n./src/app.py\n"
        assert (await a.run("exec(open('src/app.py').read())"))["stdout"] == "hello from the workspace\n"
        assert (await a.run("./run.sh", language="bash"))["stdout"] == "ran\n"  # the exec bit came along
        await a.run("open('made.txt', 'w').write('mine')")
        snap = await a.snapshot()
        assert snap == 1
        wiped = await a.run("rm -rf /work/* && ls -A /work | wc -l", language="bash")
        assert wiped["status"] == "ok" and wiped["stdout"].strip() == "0"
        assert await _ls(a) == ""
        assert await _ls(b) == start  # another session of the same workspace, meanwhile
        await a.rollback(snap)
        assert await a.read_text("made.txt") == "mine" and await a.read_text("notes.txt") == "keep me\n"
        assert await _ls(a) == "./made.txt\n" + start
        await a.rollback(0)
        assert await _ls(a) == start and await a.read_text("made.txt") is None
        with pytest.raises(ValueError, match="no snapshot 1"):
            await a.rollback(snap)  # dropped by the rollback before it: the caller's mistake, not the sandbox's
        with pytest.raises(ValueError, match="language"):
            await a.run("print(1)", language="ruby")
    finally:
        await a.close()
        await b.close()
    with pytest.raises(SandboxError, match="ended"):
        await a.run("print(1)")
    await http.aclose()


async def test_a_session_without_a_workspace_starts_empty_and_keeps_files(sandbox_url):
    s = Sandbox.connect(sandbox_url)  # by hand, as the guide tries a tool outside a run (token from the env)
    try:
        assert await _ls(s) == ""
        await s.run("echo 1 > a", language="bash")
        assert await s.read_text("a") == "1\n" and await s.read_text("missing") is None
    finally:
        await s.close()
    assert s.http.http.is_closed  # its own client, closed with it


async def shell(command: str, sandbox) -> str:
    """Run a shell command in the workspace.

    Args:
        command: the command
    """
    out = await sandbox.run(command, language="bash")
    return out["stdout"] + out["stderr"]


async def test_a_tool_gets_its_rollouts_sandbox_and_a_dead_sandbox_is_an_error_not_an_observation(sandbox_url):
    http = _client(sandbox_url)
    s = Sandbox(http)
    try:
        obs = await call_tool([shell], "shell", {"command": "echo hi > f; cat f", "sandbox": "ignored"}, None,
                              {"state": {}, "task": {}, "sandbox": s}, 20.0)
        assert obs == "hi\n"  # the model cannot pass its own sandbox: the injected one is used
    finally:
        await s.close()
        await http.aclose()
    dead = _client("http://127.0.0.1:9")  # nothing listens there
    gone = Sandbox(dead)
    with pytest.raises(HookError, match="tool shell: sandbox"):
        await call_tool([shell], "shell", {"command": "true"}, None, {"state": {}, "task": {}, "sandbox": gone}, 20.0)
    await dead.aclose()


# --- a whole rollout through the environment loop, with a taught tiny model ---------------------------------------

_WIPED = asyncio.Event()


async def wipe(sandbox, state: dict) -> str:
    """Delete everything, look, roll back, look again."""
    snap = await sandbox.snapshot()
    await sandbox.run("rm -rf /work/*", language="bash")
    state["after_wipe"] = await _ls(sandbox)
    _WIPED.set()
    await asyncio.sleep(0.5)  # the other rollout looks now
    await sandbox.rollback(snap)
    return await _ls(sandbox)


async def look(sandbox, state: dict) -> str:
    """List the workspace while another rollout has wiped its own."""
    await asyncio.wait_for(_WIPED.wait(), 30)
    return await _ls(sandbox)


ANSWERS = {"wipe": format_tool_call("wipe", {}), "look": format_tool_call("look", {})}


def _msgs(case: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"case {case}"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> TorchEngine:
    tok, model = teach_tiny_mixture(tmp_path_factory.mktemp("tiny") / "model",
                                    [(_msgs(k), v, 1.0) for k, v in ANSWERS.items()], steps=150,
                                    render=lambda tok, msgs: encode_with_tools(tok, msgs, _env(None).tool_schemas()))
    model.eval()
    return TorchEngine(model, tok, seed=0)


async def _read_notes(state: dict, sandbox) -> None:
    state["notes"] = await sandbox.read_text("notes.txt")


def _env(workspace) -> Environment:
    return Environment(dataset=[], rubric=lambda state: 1.0, tools=[wipe, look], workspace=workspace, max_turns=2,
                       cleanup=_read_notes, hook_timeout_s=30.0)


async def test_a_rollout_wipes_its_workspace_and_rolls_back_while_another_never_sees_it(engine, sandbox_url,
                                                                                        workspace):
    env = _env(workspace)
    http = _client(sandbox_url)
    _WIPED.clear()

    async def one(case: str):
        msgs = _msgs(case)
        task = Task(task_id=case, domain="env", prompt=msgs, max_turns=2,
                    verifier={"kind": "environment", "environment": {"module": "unused"}})
        prompt = encode_with_tools(engine.tokenizer, msgs, env.tool_schemas())
        return await run_env_loop(engine, engine.tokenizer, env, task, prompt, 1, GREEDY, 400, sandbox=http)

    try:
        (wiper,), (looker,) = await asyncio.gather(one("wipe"), one("look"))
    finally:
        await http.aclose()
    start = "./notes.txt\n./run.sh\n./src\n./src/app.py\n"
    for ro, case in ((wiper, "wipe"), (looker, "look")):
        assert ro.error is None and ro.rollout.turns[0]["text"] == ANSWERS[case], ro.rollout.turns
        assert ro.rollout.turns[1]["role"] == "tool" and ro.rollout.turns[1]["text"] == start
        assert ro.state["notes"] == "keep me\n"  # cleanup read the final workspace, then the session ended
    assert wiper.state["after_wipe"] == ""
    assert all(ro.sandbox.session_id is None for ro in (wiper, looker))


async def test_a_rollout_whose_sandbox_is_unreachable_is_an_error_sample(engine, workspace):
    dead = _client("http://127.0.0.1:9")
    msgs = _msgs("look")
    env = Environment(dataset=[], rubric=lambda state: 1.0, tools=[look], workspace=workspace, max_turns=2,
                      setup=_read_notes, hook_timeout_s=30.0)
    task = Task(task_id="x", domain="env", prompt=msgs, max_turns=2,
                verifier={"kind": "environment", "environment": {"module": "unused"}})
    prompt = encode_with_tools(engine.tokenizer, msgs, env.tool_schemas())
    try:
        (ro,) = await run_env_loop(engine, engine.tokenizer, env, task, prompt, 1, GREEDY, 400, sandbox=dead)
    finally:
        await dead.aclose()
    assert ro.error is not None and "sandbox" in ro.error and ro.rollout.turns == []
