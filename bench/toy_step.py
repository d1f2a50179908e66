"""Where a toy training step's time goes, for a checkout: the warm start, the rollout, the
grading and the update with its pieces.

    python bench/toy_step.py                    # this checkout: warm start + 6 steps, twice
    python bench/toy_step.py --repo ../other    # another checkout of the project, the same way
    python bench/toy_step.py --full-run         # also `python train.py` from a fresh cache, whole
    python bench/toy_step.py --repo ../other --cache .cache   # a toy model built there before: no warm start
    python bench/toy_step.py --compare ../other --cache .cache --rounds 3   # two checkouts in turns, the ratios

Everything runs as that checkout's own commands, so any version of the project can be measured
and compared on one machine one after the other:
1. `python toy.py --task math` in an empty MARL_CACHE: the warm start from scratch (its time as
   toy.py prints it, saving included);
2. `python train.py --steps N --eval-every 0` on that cache (the default Voting run, cut
   short): the step-0 accuracy of the untrained workflow, and each step's rollout, grading and
   update times from metrics.jsonl (median over the steps after the first);
3. the same command under cProfile: how the update's time splits into the old-logprob
   recompute, the training forwards and losses, the backwards, the per-slot gradient readings
   and the rest (shares of the profiled update; the profiler slows Python, not the kernels).
Give each checkout the machine alone: the figures are wall times.
"""
import argparse
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (label, functions whose cumulative time it is, their files): names of either version of grpo.py
PIECES = [("recompute", ("old_logprobs", "reference_logprobs"), ("grpo.py",)),
          ("backward", ("backward",), ("_tensor.py",)),
          ("forward+loss", ("micro_loss",), ("grpo.py",)),
          ("grad readings", ("flat_grad",), ("grpo.py", "dynamics.py"))]


def run(cmd, repo, env, what):
    t0 = time.time()
    r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"error: {what} failed in {repo}:\n{r.stderr[-2000:]}")
    return r, time.time() - t0


def cumulative(stats, names, files):
    """Sum of the cumulative times of the functions called `names` in `files`."""
    total = 0.0
    for (file, _, func), (_, _, _, ct, _) in stats.stats.items():
        if func in names and os.path.basename(file) in files:
            total += ct
    return total


def steps_of(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        ms = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(folder, "eval.jsonl")) as f:
        acc0 = json.loads(f.readline())["acc"]
    return ms[1:], acc0


def median(ms, key):
    return statistics.median(m["time"][key] for m in ms)


def measure(repo, steps, full_run, cache=None):
    tmp = tempfile.mkdtemp(prefix="toy-step-")
    env = {**os.environ, "MARL_CACHE": os.path.abspath(cache) if cache else os.path.join(tmp, "cache")}
    r, wall = run([sys.executable, "toy.py", "--task", "math"], repo, env, "the warm start")
    m = re.search(r"\((\d+) s\)", r.stdout)
    out = {"warm start (s)": float(m.group(1)) if m else wall}
    flags = ["train.py", "--steps", str(steps), "--eval-every", "0", "--samples-every", "0", "--save-every", "0",
             "--quiet"]
    run([sys.executable, *flags, "--out", os.path.join(tmp, "plain")], repo, env, "the plain run")
    ms, acc0 = steps_of(os.path.join(tmp, "plain"))
    out["step-0 accuracy (%)"] = 100 * acc0
    for key in ("rollout", "score", "update", "step"):
        out[f"{key} (s)"] = median(ms, key)
    prof = os.path.join(tmp, "prof.out")
    run([sys.executable, "-m", "cProfile", "-o", prof, *flags, "--out", os.path.join(tmp, "profiled")], repo, env,
        "the profiled run")
    st = pstats.Stats(prof)
    update = cumulative(st, ("update",), ("grpo.py",))
    done = 0.0
    for label, names, files in PIECES:
        t = cumulative(st, names, files)
        if label == "forward+loss":   # an older version's micro step held its backward too
            t += max(0.0, cumulative(st, ("_micro_step",), ("grpo.py",)) - cumulative(st, ("backward",), ("_tensor.py",)))
        out[f"update: {label} (%)"] = 100 * t / update
        done += t / update
    out["update: other (%)"] = 100 * (1 - done)
    if full_run:
        fresh = {**os.environ, "MARL_CACHE": os.path.join(tmp, "fresh")}
        _, wall = run([sys.executable, "train.py", "--out", os.path.join(tmp, "full"), "--quiet"], repo, fresh,
                      "the full default run")
        out["python train.py, fresh cache (s)"] = wall
        with open(os.path.join(tmp, "full", "eval.jsonl")) as f:
            accs = [json.loads(line)["acc"] for line in f if line.strip()]
        out["python train.py: accuracy first -> last (%)"] = f"{100 * accs[0]:.1f} -> {100 * accs[-1]:.1f}"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=HERE, help="the checkout to measure (default: this one)")
    ap.add_argument("--steps", type=int, default=6, help="training steps per run; the first is left out (default: %(default)s)")
    ap.add_argument("--full-run", action="store_true", help="also time `python train.py` from a fresh cache (minutes)")
    ap.add_argument("--cache", default=None, help="the MARL_CACHE to use (default: a fresh one): a toy model already "
                    "built there is loaded, not warm-started, so the warm start's time is then only the lookup")
    ap.add_argument("--compare", default=None, metavar="CHECKOUT", help="also measure this other checkout, the two "
                    "taking turns --rounds times, and print the ratios of their median rollout, update and step times")
    ap.add_argument("--rounds", type=int, default=2, help="with --compare: turns each (default: %(default)s)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is left out)")
    repos = [args.compare, args.repo] * args.rounds if args.compare else [args.repo]
    seen = {}
    for repo in repos:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                                text=True).stdout.strip() or "?"
        print(f"checkout {repo} ({commit}), {os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}",
              flush=True)
        out = measure(repo, args.steps, args.full_run, args.cache)
        for key, value in out.items():
            print(f"  {key:<44} {value:.2f}" if isinstance(value, float) else f"  {key:<44} {value}", flush=True)
        seen.setdefault(repo, []).append(out)
    if args.compare:
        for key in ("rollout (s)", "update (s)", "step (s)"):
            other, this = (statistics.median(o[key] for o in seen[r]) for r in (args.compare, args.repo))
            print(f"{key}: {args.compare} {other:.2f}, {args.repo} {this:.2f}: {other / this:.2f}x (medians of "
                  f"{args.rounds} turns)")


if __name__ == "__main__":
    main()
