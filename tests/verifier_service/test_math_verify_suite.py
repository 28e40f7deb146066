"""The ``math`` kind against Math-Verify's own test cases, and one focused test per cause.

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


@pytest.fixture(autouse=True)
def _quiet_math_verify():
    """math-verify warns on every unparseable answer; silenced for this module's tests only (a global
    ``logging.disable`` left on would hide the warnings later tests assert on)."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def compare(gold: str, completion: str, **options) -> dict:
    """What a pool worker returns for this completion (``score_math`` minus the pool)."""
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


# ---------------------------------------------------------------- one test per cause found


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
    r = compare("2", "so it is (2)")  # math-verify finds nothing here; the stated answer is read
    assert r["ok"] and r["extracted_by"] == "statement", r
    for fragment in ("\\sqrt{2}", "x^2", "x^2+1", "2!", "2%", "2:1", "2 million", "(1, 2)", "2 - i", "\\log 2"):
        assert extract_last_word_number(f"so we get {fragment}") is None, fragment


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


# ---------------------------------------------------------------- the stated answer (review of the math kind)

FALSE_CREDIT = [  # (gold, completion): a wrong answer, never 1
    # a number read out of a larger expression, bare LaTeX or plain text
    *[("2", c) for c in [
        "The answer is \\sqrt{2}", "The answer is 2\\pi.", "2\\sqrt{3}", "The answer is x^2", "The answer is 2^{10}",
        "The answer is 2e3", "The answer is 2x+1", "The answer is 2i", "The answer is 2 - i", "The answer is 2!",
        "The answer is 2:1", "The answer is log(2)", "The answer is \\log 2", "The answer is ln 2",
        "The answer is 2 \\times 3", "The answer is (1, 2).", "The point is (1, 2)", "The answer is 2 thousand",
        "The answer is 2 million", "The answer is 2%", "The answer is 2\\%", "The answer is 200%", "The answer is 2nd.",
        "The answer is \u2212 2.", "The answer is 2cm... no wait 3", "The answer is 2 with remainder 1",
        "The answer is 2 to 1"]],
    ("3", "The answer is \\sqrt{3}"), ("3", "The answer is \u22123."), ("1", "The answer is x^2+1"),
    # a box beaten by a later answer, or an operand of a larger expression
    *[("2", c) for c in [
        "\\boxed{2}\nThe answer is 3.", "\\boxed{2}\n**Answer:** 3", "\\boxed{2} (or possibly 3)",
        "\\boxed{2}, though 3 is also possible", "\\boxed{2}\n\nHmm, on reflection it is 3.",
        "We get $\\boxed{2}$ for the first part, so the final answer is 3.", "$\\boxed{2} \\cdot 3 = 6$. The answer is 6.",
        "\\boxed{2}^3", "\\boxed{2}\\sqrt{3}", "$\\boxed{2}\\pi$", "\\fbox{3} \\boxed{2}", "\\boxed 3 \\boxed{2}",
        "Maybe $\\boxed{2}$ but checking again the answer is $3$.", "\\boxed{2} or 3", "\\boxed{2}, or maybe 3",
        "The answer is 2, though 3 is also possible"]],
    ("8", "$2^3 = \\boxed{8}$ wait, the answer is 9"),
    # alternatives where the gold has none
    ("45", "\\boxed{44 \\vee 45}"), ("45", "\\boxed{44 \\lor 45}"), ("45", "\\boxed{44 | 45}"),
    *[("2", c) for c in [
        "The answer is 2 or 3.", "The final answer is 2 or 3.", "Either 3 or 2.", "Answer: 2 or 3",
        "Final answer: 2 (or 3)", "The answer is 2 and 3", "The answers are 2 and 3", "The answer is $2$ or maybe $3$",
        "x=2 or x=3"]],
]

FALSE_ZERO = [  # (gold, completion): a right answer, scored 1
    ("(1,2)", "(1, 2)"), ("(1,2)", "The answer is (1, 2)."), ("(1,2)", "Final answer: (1, 2)"), ("(1,2)", "x = 1, y = 2"),
    ("(1, 2)", "The ordered pair is (1, 2)."), ("k = 45 and n = 2", "k = 45, n = 2"),
    ("\\{1, 2\\}", "x = 1 or x = 2"), ("\\{1, 2\\}", "The solutions are 1 and 2."), ("\\{1, 2\\}", "x = 1, 2"),
    ("[1, 2)", "The interval is [1, 2)."), ("2\\pi", "The answer is 2\\pi."),
    ("\\frac{\\sqrt{3}}{2}", "The answer is \\sqrt{3}/2"), ("\\frac{\\sqrt{3}}{2}", "The answer is \\frac{\\sqrt{3}}{2}"),
    ("\\sqrt{2}", "The answer is \\sqrt{2}"), ("\\sqrt{2}", "The answer is sqrt2"), ("2^{10}", "The answer is 2^{10}"),
    ("x^2+1", "The answer is x^2+1"), ("-3", "The answer is \u22123."), ("-3", "x = \u22123"), ("3", "The answer is -(-3)."),
    ("1000000", "The answer is 1 000 000"), ("18", "The answer is 18 dollars."), ("3", "\\boxed{2}\nThe answer is 3."),
    ("3", "Final Answer: Jane started growing Sphere 3 hours ago. I hope it is correct."),
    ("12", "Final Answer: The final answer is 12. I hope it is correct."),
    ("5", "The answer is 5, since 2+3=5."), ("5", "The answer is 5 because 2+3=5."), ("5", "2 + 3 = 5"),
    ("2", "\\boxed{2}\nWe could also check with 3 or 4 cases."),
    ("2", "\\boxed{2}. This is the smallest possible value since 1 < 2."),
    ("(1,2)", "The answer is (1, 2), which is the point."),
]


@pytest.mark.parametrize("gold, completion", FALSE_CREDIT)
def test_a_wrong_stated_answer_never_scores(gold, completion):
    assert not compare(gold, completion)["ok"]


@pytest.mark.parametrize("gold, completion", FALSE_ZERO)
def test_a_right_stated_answer_scores(gold, completion):
    r = compare(gold, completion)
    assert r["ok"], r
