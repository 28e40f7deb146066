"""Extract Math-Verify's own (gold, prediction, expected, options) test cases into a JSONL data file.

    python scripts/vendor_math_verify_cases.py --git-dir <Math-Verify .git> [--commit HEAD] \
        [--out tests/verifier_service/data/math_verify_cases.jsonl]

Source: https://github.com/huggingface/Math-Verify (Apache-2.0), its ``tests/*.py``. Only data is
taken: each ``@pytest.mark.parametrize`` row of a test that compares a gold with a prediction
(through the suite's ``compare_strings`` helper or ``verify(parse(gold), parse(pred))``), plus the
literal ``compare_strings(...) == n`` asserts of unparametrized tests. The options each test passes
are recorded with the case, with the helper's defaults filled in, read from the same commit:

* ``extraction``: the extraction targets used for both gold and prediction (``latex``, ``expr``);
* ``boxed_match_priority``: of the LaTeX target (the suite's helper uses 0, ``parse``'s default is
  ``LatexExtractionConfig``'s own);
* ``float_rounding``, ``strict``, ``allow_set_relation_comp``: passed to ``verify``.

The test files are read with ``ast`` (nothing of them is imported or run); a row's values are
literals, except f-strings over ``math`` (``f"{math.sqrt(17):.15f}"``), evaluated with only
``math`` in scope. Tests of other things (string extraction, configs, timeouts, errors) have no
(gold, prediction) pair and are skipped. The first line of the output is a ``_meta`` record naming
the repository, commit and licence; then one case per line.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import subprocess
import sys
from pathlib import Path

REPO = "huggingface/Math-Verify"
LICENCE = "Apache-2.0"
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests/verifier_service/data/math_verify_cases.jsonl"
OPTION_PARAMS = {"precision": "float_rounding", "strict": "strict",
                 "allow_set_relation_comp": "allow_set_relation_comp"}


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True,
                          text=True).stdout


def value(node: ast.expr):
    """A row's value: a literal, or an expression over ``math`` only (f-strings)."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        code = compile(ast.Expression(node), "<case>", "eval")
        return eval(code, {"__builtins__": {}, "math": math})  # noqa: S307 - data rows of a pinned commit


def helper_defaults(tree: ast.Module) -> dict:
    """Defaults of the suite's ``compare_strings(gold, pred, match_types=..., precision=..., ...)``."""
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == "compare_strings":
            names = [a.arg for a in fn.args.args][-len(fn.args.defaults):]
            d = {n: ast.literal_eval(v) for n, v in zip(names, fn.args.defaults)}
            body = ast.unparse(fn)
            prio = re.search(r"LatexExtractionConfig\(boxed_match_priority=(-?\d+)\)", body)
            d["boxed_match_priority"] = int(prio.group(1)) if prio else None
            return d
    raise SystemExit("compare_strings not found in tests/test_all.py")


def call_options(call: ast.Call, helper: dict, parse_prio: int, row: dict) -> dict | None:
    """The options a test's comparison call uses, resolved against one parametrize row (``row``)."""
    name = ast.unparse(call.func)
    if name == "compare_strings":
        opts = {"extraction": helper["match_types"], "boxed_match_priority": helper["boxed_match_priority"],
                "float_rounding": helper["precision"], "strict": helper["strict"],
                "allow_set_relation_comp": helper["allow_set_relation_comp"]}
        for kw in call.keywords:
            v = row[kw.value.id] if isinstance(kw.value, ast.Name) else ast.literal_eval(kw.value)
            key = {"match_types": "extraction"}.get(kw.arg, OPTION_PARAMS.get(kw.arg, kw.arg))
            opts[key] = v
        return opts
    if name == "verify" and all(ast.unparse(a).startswith("parse(") for a in call.args):
        return {"extraction": ["latex", "expr"], "boxed_match_priority": parse_prio, "float_rounding": 6,
                "strict": True, "allow_set_relation_comp": False}
    return None


def comparison_call(fn: ast.FunctionDef) -> ast.Call | None:
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("compare_strings", "verify"):
            return node
    return None


def cases_of(path: str, tree: ast.Module, helper: dict, parse_prio: int):
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test"):
            continue
        marks = [d for d in fn.decorator_list
                 if isinstance(d, ast.Call) and ast.unparse(d.func).endswith("parametrize")]
        call = comparison_call(fn)
        if call is None:
            continue
        if not marks:  # literal asserts: compare_strings("g", "p", ...) == n
            for node in ast.walk(fn):
                if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Call)
                        and ast.unparse(node.left.func) == "compare_strings"):
                    g, p = (ast.literal_eval(a) for a in node.left.args[:2])
                    opts = call_options(node.left, helper, parse_prio, {})
                    yield {"file": path, "test": fn.name, "gold": g, "pred": p,
                           "expected": int(ast.literal_eval(node.comparators[0])), "options": opts}
            continue
        names = [n.strip() for n in ast.literal_eval(marks[0].args[0]).split(",")]
        for i, elt in enumerate(marks[0].args[1].elts):
            row = dict(zip(names, (value(e) for e in elt.elts)))
            if "gold" not in row or "pred" not in row:
                continue
            opts = call_options(call, helper, parse_prio, row)
            if opts is None:
                continue
            expected = row.get("expected", row.get("result"))
            yield {"file": path, "test": f"{fn.name}[{i}]", "gold": row["gold"], "pred": row["pred"],
                   "expected": int(expected), "options": opts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--git-dir", required=True, help="a clone (or bare mirror) of huggingface/Math-Verify")
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    commit = git(args.git_dir, "rev-parse", args.commit).strip()
    files = sorted(p for p in git(args.git_dir, "ls-tree", "--name-only", commit, "tests/").split()
                   if p.endswith(".py") and Path(p).name.startswith("test_"))
    trees = {p: ast.parse(git(args.git_dir, "show", f"{commit}:{p}")) for p in files}
    helper = helper_defaults(trees["tests/test_all.py"])
    parser_src = git(args.git_dir, "show", f"{commit}:src/math_verify/parser.py")
    parse_prio = int(re.search(r"boxed_match_priority: int = (-?\d+)", parser_src).group(1))
    cases = [c for p in files for c in cases_of(p, trees[p], helper, parse_prio)]
    meta = {"repo": REPO, "url": f"https://github.com/{REPO}", "commit": commit, "licence": LICENCE,
            "files": files, "cases": len(cases), "generated_by": "scripts/vendor_math_verify_cases.py"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        f.write(json.dumps({"_meta": meta}, ensure_ascii=False) + "\n")
        for c in cases:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    print(f"{len(cases)} cases from {REPO}@{commit[:12]} -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
