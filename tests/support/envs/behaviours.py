"""A user environment whose reward misbehaves on demand (``args: {behaviour: ...}``), for the verifier's tests."""

import asyncio
import time

from flywheel.env import Environment, Rubric


def load_environment(behaviour: str = "exact", sleep_s: float = 3600.0) -> Environment:
    def exact(completion: str, answer) -> float:
        return float(completion.strip() == str(answer))

    def misbehaving(completion: str, answer):
        if behaviour == "raises":
            raise KeyError("no such field")
        if behaviour == "nan":
            return float("nan")
        if behaviour == "string":
            return "1.0"
        if behaviour == "sleeps":
            time.sleep(sleep_s)
        if behaviour == "out_of_range":
            return 5.0
        return {"score": exact(completion, answer), "length": len(completion)}

    async def not_applicable(info: dict) -> float | None:
        await asyncio.sleep(0)
        return None if not info.get("graded") else 1.0

    return Environment(dataset=[{"question": "2+2", "answer": 4}], rubric=Rubric([exact, misbehaving, not_applicable],
                                                                                [1.0, 1.0, 0.5]))
