"""Synthetic financial statements with ground truth: structured extraction scored by ``json_fields``.

Each item is a short statement (press-release prose plus a small table, figures in a stated scale such
as "in thousands", with the prior year as a distractor). The model returns a JSON object with the
fields below; each field is compared after normalisation (amounts with scale words and accounting
negatives, dates in any common format, text case-folded), and the reward is the fraction right.
"""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

from flywheel.domains.common import task_body, with_recipe

RECIPE: dict[str, Any] | None = {
    "reason": "no truncation gate: the answer is one JSON object, which does not parse when it is "
              "cut off; a response cut off after its object closed holds a complete answer"}
"""An explicit opt-out of the verifier's default truncation gate, with its reason (the verifier service's
recipe for the domain still applies when it has one; ``shared.verifier_specs.Recipe.opts_out``)."""

FIELDS = {
    "company": "string",
    "fiscal_year_end": "date",
    "currency": "string",
    "revenue": "amount",
    "net_income": "amount",
    "total_assets": "amount",
    "employees": "number",
}
SYSTEM = ("Extract the requested fields from the financial statement. Reply with one JSON object inside "
          "<answer></answer> tags. Amounts are plain numbers in units of the currency (apply the "
          "statement's scale, e.g. 'in thousands'); dates are YYYY-MM-DD; negative amounts are negative.")

_NAMES = ["Northwind", "Contoso", "Fabrikam", "Tailspin", "Adventure Works", "Litware", "Proseware", "Wingtip",
          "Blue Yonder", "Coho", "Alpine Ski", "Margie's Travel", "Lucerne", "Woodgrove", "Trey Research"]
_SUFFIX = ["Inc.", "plc", "AG", "Ltd.", "Corp.", "S.A.", "Holdings"]
_CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF"]
_SCALES = [(1, ""), (1_000, "in thousands"), (1_000_000, "in millions")]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]


def _fmt_date(d: dt.date, style: int) -> str:
    if style == 0:
        return d.isoformat()
    if style == 1:
        return f"{_MONTHS[d.month - 1]} {d.day}, {d.year}"
    if style == 2:
        return f"{d.day} {_MONTHS[d.month - 1][:3]} {d.year}"
    return f"{d.month:02d}/{d.day:02d}/{d.year}"


def _fmt_amount(units: int, style: int) -> str:
    """An amount already divided by the statement's scale, written as a table cell."""
    s = f"{abs(units):,}"
    if units < 0:
        return f"({s})" if style % 2 == 0 else f"-{s}"
    return s


def _statement(rng: random.Random) -> tuple[str, dict]:
    company = f"{rng.choice(_NAMES)} {rng.choice(_SUFFIX)}"
    code = rng.choice(_CURRENCIES)
    scale, scale_words = rng.choice(_SCALES)
    year = rng.randint(2015, 2025)
    end = dt.date(year, rng.choice([3, 6, 9, 12]), 1)
    end = (end.replace(day=28) + dt.timedelta(days=4)).replace(day=1) - dt.timedelta(days=1)  # last day of month
    rev_units = rng.randint(2_000, 900_000)
    ni_units = int(rev_units * rng.uniform(-0.25, 0.3))
    assets_units = int(rev_units * rng.uniform(0.8, 4.0))
    prev = [int(v * rng.uniform(0.7, 1.2)) for v in (rev_units, ni_units, assets_units)]
    employees = rng.randint(12, 250_000)
    style = rng.randint(0, 3)
    cur_label = f"{code}{', ' + scale_words if scale_words else ''}"
    table = "\n".join([
        f"| ({cur_label}) | FY{year} | FY{year - 1} |",
        "|---|---|---|",
        f"| Revenue | {_fmt_amount(rev_units, style)} | {_fmt_amount(prev[0], style)} |",
        f"| Net income (loss) | {_fmt_amount(ni_units, style)} | {_fmt_amount(prev[1], style)} |",
        f"| Total assets | {_fmt_amount(assets_units, style)} | {_fmt_amount(prev[2], style)} |",
    ])
    prose = (f"{company} today reported results for the fiscal year ended {_fmt_date(end, style)}. "
             f"The company ended the year with {employees:,} employees, compared with "
             f"{int(employees * rng.uniform(0.8, 1.1)):,} a year earlier. Figures are in {code}"
             f"{' ' + scale_words if scale_words else ''}.")
    text = f"{prose}\n\n{table}"
    truth = {"company": company, "fiscal_year_end": end.isoformat(), "currency": code,
             "revenue": rev_units * scale, "net_income": ni_units * scale, "total_assets": assets_units * scale,
             "employees": employees}
    return text, truth


def make(n: int, seed: int = 0, split: str = "train", samples_per_task: int = 8,
         recipe: dict[str, Any] | None = RECIPE) -> list[dict]:
    """``n`` statements (the eval split uses a disjoint seed stream), each carrying ``recipe`` when one is
    given (default :data:`RECIPE`).

    Raises:
        ValueError: ``recipe`` is not a valid recipe.
    """
    rng = random.Random(f"financial:{split}:{seed}")
    out = []
    for i in range(n):
        text, truth = _statement(rng)
        fields = {k: {"value": truth[k], "type": FIELDS[k]} for k in FIELDS}
        user = (f"Statement:\n\n{text}\n\nReturn JSON with the fields: {', '.join(FIELDS)} "
                f"(the current fiscal year, not the prior one).")
        out.append(task_body("financial_extraction", split, f"{seed}:{i}:{text}", user,
                             with_recipe({"kind": "json_fields", "fields": fields}, recipe), system=SYSTEM,
                             samples_per_task=samples_per_task, metadata={"truth": truth}))
    return out


def gold(task: dict) -> str:
    import orjson

    return "<answer>" + orjson.dumps(task["metadata"]["truth"]).decode() + "</answer>"


def corrupt(task: dict, rng: random.Random) -> str:
    """The truth with one field wrong: an amount off by its scale (forgot "in thousands"), the prior year's
    date, or a different company."""
    import orjson

    truth = dict(task["metadata"]["truth"])
    field = rng.choice(["revenue", "net_income", "total_assets", "fiscal_year_end", "company", "employees"])
    if field in ("revenue", "net_income", "total_assets"):
        truth[field] = truth[field] * 1000 + 1 if truth[field] != 0 else 12345
    elif field == "fiscal_year_end":
        y, rest = truth[field].split("-", 1)
        truth[field] = f"{int(y) - 1}-{rest}"
    elif field == "company":
        truth[field] = truth[field] + " Group"
    else:
        truth[field] += 1
    return "<answer>" + orjson.dumps(truth).decode() + "</answer>"
