"""Math-Verify's own test cases through our ``math`` kind, against math-verify alone.

    python benchmarks/math_verify_suite.py [--cases tests/verifier_service/data/math_verify_cases.jsonl]
        [--math-workers 2] [--show-disagreements]

The cases are Math-Verify's (huggingface/Math-Verify ``tests/*.py``, vendored by
``scripts/vendor_math_verify_cases.py``): a gold, a prediction, the expected 0/1 and the options the
test passes. Each is scored as the service scores a completion: ``Scorer.score`` with
``MathSpec(answer=gold, **options)`` on the prediction, under the default recipe (correctness alone).
A ``correctness`` of 1 counts as 1; 0 or ``infra_error`` (a gold we flag misconfigured) as 0. Cases
whose total the recipe's other layers (reward-hacking detectors) bring below correctness are counted
in the ``zeroed`` column.

Printed per test file: agree/total, false credits (expected 0, scored 1), false negatives (expected 1,
scored 0) and infra errors; then, measured in the same run, math-verify's own
``verify(parse(gold), parse(pred))`` with its defaults (the baseline) and with each test's own options
(what the test itself runs). Target: >= 265/270 agree, 0 false credit. Also one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.verifier_specs import MathSpec  # noqa: E402
from verifier_service.config import VerifierConfig  # noqa: E402
from verifier_service.scorers import Scorer  # noqa: E402

CASES = ROOT / "tests/verifier_service/data/math_verify_cases.jsonl"
SPEC_OPTIONS = ("extraction", "boxed_match_priority", "float_rounding", "strict", "allow_set_relation_comp")


def load_cases(path: Path = CASES) -> tuple[dict, list[dict]]:
    """(the ``_meta`` header, the cases) of a vendored cases file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[0]["_meta"], rows[1:]


def spec_for(case: dict) -> MathSpec:
    """The ``math`` spec a task would carry for ``case``: its gold and the test's math-verify options."""
    return MathSpec(answer=case["gold"], **{k: case["options"][k] for k in SPEC_OPTIONS})


async def score_ours(cases: list[dict], workers: int) -> list[tuple[int, bool, bool]]:
    """(``correctness`` 0/1, infra_error, whether the total is below it) of each case through
    ``Scorer.score``, ``workers`` at a time. The math kind's score is the ``correctness`` component;
    the total can differ when a reward-hacking detector zeroes it (reported apart)."""
    scorer = Scorer(VerifierConfig(math_workers=workers, math_timeout_s=20.0))
    sem = asyncio.Semaphore(workers * 2)

    async def one(c: dict) -> tuple[int, bool, bool]:
        async with sem:
            r = await scorer.score(spec_for(c), c["pred"])
        correct = int(r.components.get("correctness") == 1.0 and not r.infra_error)
        return correct, r.infra_error, r.total < correct

    try:
        return list(await asyncio.gather(*map(one, cases)))
    finally:
        await scorer.close()


def score_baseline(case: dict, own_options: bool) -> int:
    """math-verify alone: ``verify(parse(gold), parse(pred))``, with its defaults or the test's options."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if not own_options:
        return int(verify(parse(case["gold"], parsing_timeout=None), parse(case["pred"], parsing_timeout=None),
                          timeout_seconds=None))
    o = case["options"]
    targets = [LatexExtractionConfig(boxed_match_priority=o["boxed_match_priority"]) if t == "latex"
               else ExprExtractionConfig() for t in o["extraction"]]
    gold, pred = (parse(case[k], targets, parsing_timeout=None) for k in ("gold", "pred"))
    return int(verify(gold, pred, float_rounding=o["float_rounding"], strict=o["strict"],
                      allow_set_relation_comp=o["allow_set_relation_comp"], timeout_seconds=None))


def tally(cases: list[dict], scores: list[int]) -> dict[str, dict[str, int]]:
    """Per file (and ``all``): total, agree, false_credit, false_negative."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: dict(total=0, agree=0, false_credit=0, false_negative=0))
    for c, s in zip(cases, scores):
        for key in (Path(c["file"]).name, "all"):
            t = out[key]
            t["total"] += 1
            t["agree"] += s == c["expected"]
            t["false_credit"] += s == 1 and c["expected"] == 0
            t["false_negative"] += s == 0 and c["expected"] == 1
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=Path, default=CASES)
    ap.add_argument("--math-workers", type=int, default=2)
    ap.add_argument("--show-disagreements", action="store_true")
    args = ap.parse_args()
    meta, cases = load_cases(args.cases)
    t0 = time.perf_counter()
    ours = asyncio.run(score_ours(cases, args.math_workers))
    t_ours = time.perf_counter() - t0
    logging.disable(logging.WARNING)
    base = [score_baseline(c, False) for c in cases]
    own = [score_baseline(c, True) for c in cases]
    t_ours_tab, t_base, t_own = tally(cases, [s for s, _, _ in ours]), tally(cases, base), tally(cases, own)
    infra, zeroed = defaultdict(int), defaultdict(int)
    for c, (_, inf, zero) in zip(cases, ours):
        for key in (Path(c["file"]).name, "all"):
            infra[key] += inf
            zeroed[key] += zero
    print(f"Math-Verify {meta['commit'][:12]} test cases: ours = MathSpec through Scorer.score; "
          f"baseline = verify(parse(g), parse(p)); own = with each test's options")
    head = (f"{'file':<26}{'ours':>9}{'false cr':>9}{'false neg':>10}{'infra':>6}{'zeroed':>7}"
            f"{'baseline':>10}{'b. f.cr':>8}{'own':>9}")
    print(head)
    print("-" * len(head))
    for name in sorted(t_ours_tab, key=lambda n: (n == "all", n)):
        o, b, w = t_ours_tab[name], t_base[name], t_own[name]
        print(f"{name:<26}{o['agree']:>4}/{o['total']:<4}{o['false_credit']:>9}{o['false_negative']:>10}"
              f"{infra[name]:>6}{zeroed[name]:>7}{b['agree']:>5}/{b['total']:<4}{b['false_credit']:>8}"
              f"{w['agree']:>4}/{w['total']:<4}")
    print(f"ours scored in {t_ours:.1f} s")
    if args.show_disagreements:
        for c, (s, inf, _), b in zip(cases, ours, base):
            if s != c["expected"]:
                print(f"  {c['file']}::{c['test']}: expected {c['expected']}, ours {s}{' (infra)' if inf else ''}, "
                      f"baseline {b}: gold {c['gold'][:60]!r} pred {c['pred'][-60:]!r}")
    print(json.dumps({"commit": meta["commit"], "ours": t_ours_tab["all"], "infra": infra["all"],
                      "zeroed": zeroed["all"],
                      "baseline": t_base["all"], "own_options": t_own["all"]}))


if __name__ == "__main__":
    main()
