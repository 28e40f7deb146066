"""The ``math`` kind against Math-Verify's own test cases (issue 14), and one focused test per cause.

The cases (``data/math_verify_cases.jsonl``, from huggingface/Math-Verify's ``tests/*.py``, Apache-2.0;
regenerate with ``scripts/vendor_math_verify_cases.py``) run through ``Scorer.check`` as the service
scores a completion; ``benchmarks/math_verify_suite.py`` prints the same numbers per test file with
math-verify's own baseline. The focused tests call the worker's function in-process
(:func:`math_verify_compare`, what ``score_math`` submits to the pool).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from shared.verifier_specs import MathSpec
from verifier_service.config import VerifierConfig
from verifier_service.extract import extract_last_word_number, latexify_plain_math, strip_reasoning
from verifier_service.scorers import MATH_OPTIONS, Scorer, _read_gold, math_verify_compare

CASES = Path(__file__).parent / "data" / "math_verify_cases.jsonl"
SPEC_OPTIONS = ("extraction", "boxed_match_priority", "float_rounding", "strict", "allow_set_relation_comp")


def _cases() -> tuple[dict, list[dict]]:
    rows = [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]
    return rows[0]["_meta"], rows[1:]


def _spec(case: dict) -> MathSpec:
    return MathSpec(answer=case["gold"], **{k: case["options"][k] for k in SPEC_OPTIONS})


def compare(gold: str, completion: str, **options) -> dict:
    """What a pool worker returns for this completion (``score_math`` minus the pool)."""
    logging.disable(logging.WARNING)
    spec = MathSpec(answer=gold, **options)
    return math_verify_compare(spec.answer, strip_reasoning(completion), spec.model_dump(include=set(MATH_OPTIONS)))


def test_vendored_cases_name_their_source():
    meta, cases = _cases()
    assert meta["repo"] == "huggingface/Math-Verify" and meta["licence"] == "Apache-2.0"
    assert len(meta["commit"]) == 40 and meta["cases"] == len(cases) == 270
    assert {c["expected"] for c in cases} == {0, 1}
    assert all(set(SPEC_OPTIONS) <= set(c["options"]) for c in cases)


async def test_math_kind_agrees_with_math_verify_suite():
    """>= 265 of the 270 agree and no false credit (the 4 misses are golds we flag misconfigured)."""
    _, cases = _cases()
    scorer = Scorer(VerifierConfig(math_workers=2, math_timeout_s=30.0))
    try:
        results = await asyncio.gather(*(scorer.check(_spec(c), c["pred"]) for c in cases))
    finally:
        await scorer.close()
    got = [int(r.score == 1.0 and not r.infra_error) for r in results]
    false_credit = [c["test"] for c, g in zip(cases, got) if g == 1 and c["expected"] == 0]
    missed = [(c["file"], c["test"], r.details.get("reason")) for c, g, r in zip(cases, got, results)
              if g != c["expected"]]
    assert not false_credit, false_credit
    assert sum(g == c["expected"] for c, g in zip(cases, got)) >= 265, missed
    assert all(r.infra_error and r.details.get("misconfigured") for c, g, r in zip(cases, got, results)
               if g != c["expected"]), missed  # every miss is a gold we refuse, none a wrong reading


# ---------------------------------------------------------------- one test per cause of issue 14


@pytest.mark.parametrize("completion", [
    "\\boxed{1},\\boxed{2},\\boxed{3}",
    "\\boxed{1} and \\boxed{2} and \\boxed{3}",
    "The solutions are $\\boxed{1}$, $\\boxed{2}$ and $\\boxed{3}$.",
])
def test_an_answer_of_several_boxes_is_read_as_one_set(completion):
    r = compare("\\{1, 2, 3\\}", completion)
    assert r["ok"] and r["answer_parsed"] == "{1, 2, 3}", r


@pytest.mark.parametrize("gold, completion", [
    ("\\{1, 2, 3\\}", "\\boxed{1}, \\boxed{2}"),          # part of the set
    ("3", "\\boxed{3} or \\boxed{5}"),                   # hedging between two answers
    ("3", "first \\boxed{3}, hmm, no: it is \\boxed{5}"),  # the last answer counts
])
def test_several_boxes_never_credit_one_of_them(gold, completion):
    assert not compare(gold, completion)["ok"]


FINAL_AFTER_BOXES = ("First CD: $0.04 \\cdot 10,000 \\cdot \\frac{1}{2} = \\boxed{200}$. Second CD: "
                     "$0.05 \\cdot 10,200 \\cdot \\frac{1}{2} = \\boxed{255}$. Final Answer: The final answer "
                     "is $10,455$. I hope it is correct.")


def test_the_final_answer_after_intermediate_boxes_decides():
    assert compare("10455", FINAL_AFTER_BOXES)["ok"]
    assert not compare("255", FINAL_AFTER_BOXES)["ok"]  # an intermediate box earns nothing
    assert not compare("200", FINAL_AFTER_BOXES)["ok"]


@pytest.mark.parametrize("completion", ["AZYUK2A", "x2", "the code is K2"])
def test_a_number_inside_a_word_is_no_answer(completion):
    r = compare("2", completion)
    assert not r["ok"] and r["answer_parsed"] is None, r


def test_the_last_number_fallback_is_word_bounded():
    assert extract_last_word_number("AZYUK2A") is None
    assert extract_last_word_number("2nd try, 12cm, 5x") is None
    assert extract_last_word_number("so x = -3.") == "-3"
    assert extract_last_word_number("total: 1,234.") == "1234"
    r = compare("2", "so it is (2)")  # math-verify finds nothing here; the fallback does
    assert r["ok"] and r["extracted_by"] == "last_number", r


def test_a_latex_answer_that_does_not_parse_is_not_replaced_by_its_last_number():
    r = compare("$1$", "$-[0,1)$")  # math-verify's own test: expected 0
    assert not r["ok"] and r["extracted_by"] == "full", r


@pytest.mark.parametrize("gold, completion", [
    ("2\\pi", "The answer is 2pi."),
    ("2\\pi", "so the period is 2π"),
    ("3\\sqrt{2}", "so x = 3*sqrt(2)"),
    ("\\frac{\\pi}{4}", "the angle is pi/4 radians"),
    ("\\frac{\\sqrt{3}}{2}", "sin 60° = sqrt(3)/2"),
    ("\\sqrt{2}", "the side is √2"),
    ("(0, \\infty)", "x ∈ (0, ∞)"),
])
def test_plain_text_symbolic_answers_are_read(gold, completion):
    r = compare(gold, completion)
    assert r["ok"], r


@pytest.mark.parametrize("gold, completion", [
    ("2\\pi", "The answer is 2."),      # the number without the constant
    ("2", "The answer is 2pi."),        # the constant is not dropped to credit 2
    ("3", "so x = 3*sqrt(2)"),
    ("4", "pi/4"),
])
def test_plain_text_symbolic_answers_are_not_their_numbers(gold, completion):
    assert not compare(gold, completion)["ok"]


def test_latexify_plain_math_rewrites_only_plain_text():
    assert latexify_plain_math("The answer is 2pi.") == "The answer is $2\\pi$."
    assert latexify_plain_math("x = 3*sqrt(2)") == "x = $3*\\sqrt{2}$"
    assert latexify_plain_math("(it is pi/4)") == "(it is $\\pi /4$)"
    text = "already $2\\pi$, a spin of 5, \\sqrt{2}"
    assert latexify_plain_math(text) is text


@pytest.mark.parametrize("gold, completion, options, default_ok", [
    ("$\\frac{1}{3}$", "0.3333", {"float_rounding": 4}, False),
    ("$f(x)$", "$f(y)$", {"strict": False}, False),
    ("$x \\in [-2,7]$", "$-2 \\le x \\le 7$", {"allow_set_relation_comp": True}, False),
    ("$9$", "Answer $ \n 9 \n $", {"extraction": ["latex"]}, True),     # numbers outside LaTeX ignored
    ("5", "so \\boxed{5}", {"extraction": ["latex"], "boxed_match_priority": -1}, True),  # boxes ignored
    ("1,22", "1.22", {"extraction": ["expr"]}, False),                  # the gold read as one number
])
def test_math_verify_options_are_carried_by_the_spec(gold, completion, options, default_ok):
    assert compare(gold, completion)["ok"] is default_ok
    assert compare(gold, completion, **options)["ok"] is not default_ok


@pytest.mark.parametrize("bad", [
    {"extraction": []}, {"extraction": ["latex", "latex"]}, {"extraction": ["string"]},
    {"float_rounding": -1}, {"boxed_match_priority": -2}, {"strict": "sometimes"}, {"precision": 3},
])
def test_math_options_are_validated(bad):
    with pytest.raises(ValueError):
        MathSpec(answer="1", **bad)


def test_math_spec_defaults_are_math_verifys():
    s = MathSpec(answer="1")
    assert (s.extraction, s.boxed_match_priority, s.float_rounding, s.numeric_precision, s.strict,
            s.allow_set_relation_comp) == (["latex", "expr"], 0, 6, 15, True, False)


@pytest.mark.parametrize("gold, latex", [
    ("$1 - \\frac{1}{\\mathrm{e}}$", True),   # math-verify reads "1 - \frac{1}{", then the number 1
    ("\\boxed{W(n) = 1 \\text{ and } W(n) = -1", True),  # unclosed box: read as -1
    ("\\boxed{W(n) = 1", True),
    ("(1, 2)", False),                      # the expr reader takes 2
    ("3.5e3", False),                       # ... and 3.5
    ("", True),
])
def test_a_gold_read_only_in_part_is_refused(gold, latex):
    _, err = _read_gold(gold, latex)
    assert err, gold


@pytest.mark.parametrize("gold, value", [
    ("(1, 2)", "Interval.open(1, 2)"), ("12", "12"), ("0.5", "1/2"), ("1,234", "1234"), ("$\\frac{14}{3}$", "14/3"),
    ("x^2+1", "x**2 + 1"), ("10\\%", "10*(1/100)"),
])
def test_a_whole_gold_is_read_whole(gold, value):
    got, err = _read_gold(gold, True)
    assert err is None and str(got[0]) == value


async def test_a_fragment_gold_is_misconfigured_not_a_zero():
    scorer = Scorer(VerifierConfig(math_timeout_s=30.0))
    try:
        frag = await scorer.score(MathSpec(answer="$1 - \\frac{1}{\\mathrm{e}}$"), "$1 - \\frac{1}{\\mathrm{e}}$")
        unclosed = await scorer.score(MathSpec(answer="\\boxed{W(n) = 1"), "W(n) = 1")
        fine = await scorer.score(MathSpec(answer="2"), "AZYUK2A")
    finally:
        await scorer.close()
    for r in (frag, unclosed):
        assert r.infra_error and r.details["misconfigured"], r
    assert "does not parse" in frag.details["reason"] and "unbalanced" in unclosed.details["reason"]
    assert fine.total == 0.0 and not fine.infra_error  # the model's miss, scored
