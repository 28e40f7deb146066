"""Bytes and decode cost of one flywheel.scored record, before (version 2: the whole Trajectory with its task,
and the whole Reward) and after (version 3: the lean TrainSample and ScoredReward) the records were made lean.

    python benchmarks/scored_records.py [--tokens 64] [--prompt-tokens 128] [--test-bytes 4000] [--n 4000]

Two tasks: the toy domain's (a regex spec, a one-line prompt) and a code task (``unit_tests`` whose test source
is ``--test-bytes`` bytes, a prompt of the same size). Per task: bytes of the encoded record (uncompressed:
what aiokafka counts against ``max_request_size``), and records/s of ``shared.schemas.decode`` on them, in this
process, best of 3. Version 2 is rebuilt here as it was (``ScoredV2``: ``trajectory: Trajectory``,
``reward: Reward``). Also printed: the verifier's decode of flywheel.trajectories with and without the task
cache (``verifier_service.intake.TrajectoryDecoder``: a group's K samples validate their task once), K = 8.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.schemas import Record, Reward, ScoredTrajectory, Task, Trajectory, decode  # noqa: E402
from verifier_service.intake import TrajectoryDecoder  # noqa: E402


class ScoredV2(Record):
    """flywheel.scored version 2, as it was before the lean records."""

    SCHEMA: ClassVar[str] = "flywheel.ScoredTrajectory"
    VERSION: ClassVar[int] = 2
    trajectory: Trajectory
    reward: Reward


def _tasks(test_bytes: int) -> dict[str, Task]:
    toy = Task(task_id="toy-train-1", domain="toy_prefix", prompt=[{"role": "user", "content": "4821 t 1"}],
               verifier={"kind": "regex", "pattern": "^[a-z]", "recipe": None})
    tests = "".join(f"assert candidate({i}) == {i * i}\n" for i in range(test_bytes // 28 + 1))[:test_bytes]
    code = Task(task_id="humaneval-7", domain="humaneval",
                prompt=[{"role": "user", "content": "def f(x):\n    " + "# spec\n" * (test_bytes // 7)}],
                verifier={"kind": "unit_tests", "tests": tests, "entry_point": "f"})
    return {"toy": toy, "code": code}


def _trajectory(task: Task, i: int, tokens: int, prompt_tokens: int) -> Trajectory:
    return Trajectory(trajectory_id=f"{task.task_id}:0:1:{i}", group_id=f"{task.task_id}:0", sample_index=i,
                      group_size=8, task=task, prompt_ids=list(range(1000, 1000 + prompt_tokens)),
                      completion_ids=[(i * 31 + j) % 49152 for j in range(tokens)],
                      completion_logprobs=[-1.234567 - j / 1000 for j in range(tokens)], loss_mask=[1] * tokens,
                      completion_text="x" * (tokens * 4), finish_reason="stop",
                      policy_versions=[{"version": 3, "start": 0, "end": tokens}], timings={"queue": 0.1, "generate": 1.2},
                      cost={"generated_tokens": float(tokens), "tool_rounds": 0.0, "tool_seconds": 0.0})


def _rate(fn, raws: list[bytes], n: int) -> float:
    """Records per second of ``fn(raw)`` over ``n`` records, best of 3."""
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(n):
            fn(raws[i % len(raws)])
        best = max(best, n / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens per sample")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--test-bytes", type=int, default=4000, help="unit-test source (and prompt) size of the code task")
    ap.add_argument("--n", type=int, default=4000, help="records decoded per timing")
    a = ap.parse_args()
    reward = Reward(total=1.0, components={"correctness": 1.0, "format": 1.0}, details={"extracted": "42"})
    print(f"flywheel.scored, one record ({a.tokens} completion tokens, {a.prompt_tokens} prompt tokens); "
          f"decode = shared.schemas.decode, records/s in one process (best of 3):")
    for name, task in _tasks(a.test_bytes).items():
        trajs = [_trajectory(task, i, a.tokens, a.prompt_tokens) for i in range(8)]
        v2 = [ScoredV2(trajectory=t, reward=reward).encode() for t in trajs]
        v3 = [ScoredTrajectory.of(t, reward).encode() for t in trajs]
        r2, r3 = _rate(lambda b: decode(b, ScoredV2), v2, a.n), _rate(lambda b: decode(b, ScoredTrajectory), v3, a.n)
        print(f"  {name:5s} before (v2): {len(v2[0]):7d} bytes, {r2:8.0f} records/s | after (v3): {len(v3[0]):7d} bytes, "
              f"{r3:8.0f} records/s | {len(v3[0]) / len(v2[0]):.2f}x the bytes, {r3 / r2:.2f}x the decode rate")
        raws = [t.encode() for t in trajs]
        plain = _rate(lambda b: decode(b, Trajectory), raws, a.n)
        dec = TrajectoryDecoder()
        cached = _rate(dec.decode, raws, a.n)
        print(f"        verifier intake of flywheel.trajectories ({len(raws[0])} bytes): decode {plain:8.0f}/s, with the "
              f"task cache {cached:8.0f}/s ({cached / plain:.2f}x)")


if __name__ == "__main__":
    main()
