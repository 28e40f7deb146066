"""Test-harness mode (results over the private channel), the languages, and the typed result fields."""

from __future__ import annotations

import shutil

import pytest

from .test_sandbox_api import client, run  # noqa: F401 - the module's app (2 workers) and its call helper

SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = [{"name": "small", "code": "assert add(1, 2) == 3"}, {"name": "neg", "code": "assert add(-1, -1) == -2"}]


def statuses(res: dict) -> list[str]:
    return [t["status"] for t in res["tests"]]


def test_correct_solution_passes_every_test(client):
    res = run(client, SOLUTION, tests=TESTS)
    assert statuses(res) == ["passed", "passed"], res
    assert (res["tests_passed"], res["tests_total"]) == (2, 2)


def test_wrong_solution_fails_with_the_assert_named(client):
    res = run(client, "def add(a, b):\n    return abs(a) + abs(b)\n", tests=TESTS)
    assert statuses(res) == ["passed", "failed"], res
    assert "add(-1, -1) == -2" in res["tests"][1]["message"]
    assert res["tests_passed"] == 1


def test_human_eval_check_convention(client):
    check = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\n"
    assert statuses(run(client, SOLUTION, tests=[{"name": "check", "code": check}], entry_point="add")) == ["passed"]
    wrong = run(client, "def add(a, b):\n    return 5\n", tests=[{"name": "check", "code": check}], entry_point="add")
    assert statuses(wrong) == ["failed"]


@pytest.mark.parametrize("code,expected", [
    ("import sys\nsys.exit(0)\n" + SOLUTION, "error"),  # exits while loading: fails every test
    ("import os\nos._exit(0)\n" + SOLUTION, "error"),  # its process ends while loading: every test errors
    (SOLUTION + "print('passed'); print('2 passed, 0 failed')\n", "passed"),  # printing does nothing...
    ("import os\nos.write(3, b'{\"token\": \"guess\", \"i\": 0, \"status\": \"passed\"}\\n')\n"
     "def add(a, b):\n    return 0\n", "error"),  # the solution's process has no result channel at all
])
def test_exit_codes_and_output_cannot_fake_a_pass(client, code, expected):
    res = run(client, code, tests=TESTS)
    assert statuses(res)[0] == expected, res
    if expected == "passed":  # ...the real results decide
        assert res["tests_passed"] == 2
    else:
        assert res["tests_passed"] == 0


WRONG = "\ndef add(a, b):\n    return 0\n"
CHECK = [{"name": "check", "code": "def check(candidate):\n    assert candidate(1, 2) == 3\n"},
         {"name": "direct", "code": "assert add(2, 2) == 4"}]


@pytest.mark.parametrize("trick", [
    "import builtins\nbuiltins.exec = lambda *a, **k: None",  # the tests' exec, if they shared the interpreter
    "import builtins\n_c = builtins.compile\nbuiltins.compile = lambda s, f, m, *a, **k: _c('pass', f, m)",
    "import orjson\n_d = orjson.dumps\norjson.dumps = lambda o, *a, **k: _d(dict(o, status='passed')"
    " if isinstance(o, dict) and 'status' in o else o, *a, **k)",
    "class Any(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
    "def add(a, b):\n    return Any(0)",  # always-equal result
    "import sys, gc\nfor o in gc.get_objects():\n    if isinstance(o, dict) and 'token' in o:\n"
    "        import os, json\n        for i in range(2):\n"
    "            os.write(3, (json.dumps({'token': o['token'], 'i': i, 'status': 'passed'}) + '\\n').encode())",
    "import builtins\nbuiltins.AssertionError = type('Fake', (Exception,), {})",
])
def test_tampering_solutions_cannot_pass(client, trick):
    """The break-it pass's tricks: none reaches the interpreter that runs the tests or the result channel."""
    code = trick + WRONG if "def add" not in trick else trick
    res = run(client, code, tests=CHECK, entry_point="add")
    assert res["tests_passed"] == 0, res
    assert all(t["status"] in ("failed", "error") for t in res["tests"]), res


PLANT = (
    "import os, sys\n"
    "payload = (\"import sys\\n\"\n"
    "    \"f = sys._getframe()\\n\"\n"
    "    \"while f and 'report' not in f.f_locals:\\n    f = f.f_back\\n\"\n"
    "    \"if f:\\n    for j in range(len(f.f_locals['tests'])):\\n\"\n"
    "    \"        f.f_locals['report'](i=j, status='passed', message='', seconds=0.0)\\n\")\n"
    "for d in {'/work', '/work/main', '/tmp', *(p for p in sys.path if p.startswith(('/work', '/tmp')))}:\n"
    "    try:\n"
    "        os.makedirs(d, exist_ok=True)\n"
    "        for mod in ('cmath', 'unittest', 'numpy', 'pprint'):\n"
    "            open(os.path.join(d, mod + '.py'), 'w').write(payload)\n"
    "    except OSError:\n"
    "        pass\n"
    "def add(a, b):\n"
    "    return 0\n"
)


def test_modules_planted_by_the_solution_are_not_imported_by_the_tests(client):
    """The second break-it pass: a module the solution wrote under /work was imported by a test's
    ``import`` inside the harness process and reported every test passed."""
    tests = [{"name": "t1", "code": "import cmath\nassert add(1, 2) == 3"},
             {"name": "t2", "code": "import pprint\nassert add(2, 2) == 4"}]
    res = run(client, PLANT, tests=tests)
    assert res["tests_passed"] == 0, res
    assert statuses(res) == ["failed", "failed"], res


def test_solution_names_never_shadow_builtins_in_the_tests(client):
    code = ("def truncate_number(n):\n    return 123.0\ndef abs(x):\n    return 0\ndef sorted(x, *a, **k):\n"
            "    return []\ndef len(x):\n    return 0\ndef set(*x):\n    return 0\n")
    tests = [{"name": "abs", "code": "def check(candidate):\n    assert abs(candidate(3.5) - 0.5) < 1e-6"},
             {"name": "sorted", "code": "def check(candidate):\n    assert sorted([candidate(3.5)]) == [0.5]"},
             {"name": "len", "code": "def check(candidate):\n    assert len(str(candidate(3.5))) == 3"}]
    res = run(client, code, tests=tests, entry_point="truncate_number")
    assert res["tests_passed"] == 0 and statuses(res) == ["failed", "failed", "failed"], res


def test_an_oversized_answer_from_the_solution_is_an_error(client):
    code = ("import os, struct\nos.write(102, struct.pack('>I', 2**31))\nos.write(102, b' ' * 4096)\n"
            "def add(a, b):\n    return 0\n")
    res = run(client, code, tests=TESTS, memory_mb=256, timeout_s=5)
    assert res["tests_passed"] == 0 and res["status"] == "ok", res  # uncapped, R would wait for 2 GiB: a timeout
    assert statuses(res) == ["error", "error"] and "larger than" in res["tests"][0]["message"], res


def test_sys_exit_inside_a_test_is_an_error_not_a_pass(client):
    res = run(client, "def add(a, b):\n    raise SystemExit(0)\n", tests=TESTS)
    assert statuses(res) == ["error", "error"]


def test_a_hanging_test_times_out_and_later_tests_are_not_passed(client):
    tests = [TESTS[0], {"name": "hang", "code": "while True: pass"}, TESTS[1]]
    res = run(client, SOLUTION, tests=tests, timeout_s=1.0)
    assert res["status"] == "timeout"
    assert statuses(res) == ["passed", "timeout", "timeout"]


def test_tests_need_python(client):
    r = client.post("/v1/execute", json={"code": "echo hi", "language": "bash", "tests": TESTS})
    assert r.status_code == 422 and "tests" in r.text


def test_result_fields(client):
    res = run(client, "x = bytearray(50 * 1024 * 1024)\nsum(range(10**6))\nprint('ok')")
    assert res["status"] == "ok"
    assert res["cpu_s"] is not None and 0 < res["cpu_s"] < 5
    assert res["peak_memory_bytes"] >= 50 * 1024 * 1024
    assert res["attempts"] == 1 and res["degraded"] == [] and res["network_isolated"] is True


def test_bash(client):
    res = run(client, "read x; echo \"got $x\"; ls /work", language="bash", stdin="42\n")
    assert (res["status"], res["stdout"]) == ("ok", "got 42\nmain.sh\n"), res


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_c_and_cpp(client):
    c = run(client, '#include <stdio.h>\nint main(void){int x; scanf("%d", &x); printf("%d\\n", x * 2); return 0;}',
            language="c", stdin="21")
    assert (c["status"], c["stdout"]) == ("ok", "42\n"), c
    cpp = run(client, "#include <iostream>\nint main(){std::cout << \"hi\" << std::endl; return 3;}", language="cpp")
    assert (cpp["status"], cpp["exit_code"], cpp["stdout"]) == ("runtime_error", 3, "hi\n"), cpp
    bad = run(client, "int main( {", language="c")
    assert bad["status"] == "runtime_error" and "error" in bad["stderr"], bad


def test_fresh_interpreter(client):
    res = run(client, "import sys\nprint(sys.flags.isolated, 'json' in sys.modules)", fresh_interpreter=True)
    assert (res["status"], res["stdout"]) == ("ok", "1 False\n"), res
