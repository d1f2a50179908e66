"""The first `python train.py` on a fresh machine, timed: a reference checkout against this one.

    git worktree add --detach ../ref 73cae67
    python bench/first_run.py --reference ../ref                 # ~20 minutes: both whole runs
    python bench/first_run.py --reference ../ref --keep runs/first

Each checkout runs the README's main job as a new user would, one after the other on this
machine: `python train.py` (the default Voting run, 100 steps, evaluations of 512 problems)
with an empty MARL_CACHE, so whatever that checkout does before its first step (a version that
builds the toy model warm-starts it here; one that ships it loads it) is in its wall time.
Printed: each run's wall time, the time to its first step line, its step-0 and last accuracy
and the toy model's sha256 from its config.json, then the ratio reference / this checkout.
Give it the machine alone (pause any sweep): the figures are wall times. `--keep DIR` keeps
both run folders (DIR/reference, DIR/this).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def first_run(repo: str, work: str) -> dict:
    """`python train.py --out WORK/run` in `repo` with the empty cache WORK/cache."""
    env = {**os.environ, "MARL_CACHE": os.path.join(work, "cache")}
    out = os.path.join(work, "run")
    t0, first_step = time.time(), None
    proc = subprocess.Popen([sys.executable, "train.py", "--out", out, "--quiet"], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        if first_step is None and line.startswith("step    1/"):
            first_step = time.time() - t0
    if proc.wait() != 0:
        sys.exit(f"error: python train.py failed in {repo}:\n{''.join(tail)}")
    wall = time.time() - t0
    with open(os.path.join(out, "eval.jsonl")) as f:
        accs = [json.loads(line)["acc"] for line in f if line.strip()]
    with open(os.path.join(out, "config.json")) as f:
        sha = json.load(f)["provenance"]["model_sha256"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                            text=True).stdout.strip() or "?"
    return {"commit": commit, "wall": wall, "first step": first_step, "acc": (accs[0], accs[-1]), "sha": sha, "out": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, help="the checkout to compare against (e.g. a worktree of main)")
    ap.add_argument("--checkout", default=HERE, help="the checkout measured (default: this one)")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep both run folders here (default: deleted)")
    args = ap.parse_args()
    for repo in (args.reference, args.checkout):
        if not os.path.isfile(os.path.join(repo, "train.py")):
            ap.error(f"{repo}: no train.py, so not a checkout of the project")
    if args.keep and os.path.exists(args.keep):
        ap.error(f"--keep {args.keep} exists")
    print(f"{os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}; each run alone, "
          "from an empty MARL_CACHE", flush=True)
    results = {}
    for label, repo in (("reference", args.reference), ("this", args.checkout)):
        work = tempfile.mkdtemp(prefix=f"first-run-{label}-")
        r = results[label] = first_run(os.path.abspath(repo), work)
        print(f"  {label:<9} {r['commit']:<8} wall {r['wall']:6.0f} s | first step after {r['first step']:5.0f} s | "
              f"eval {100 * r['acc'][0]:.1f} -> {100 * r['acc'][1]:.1f} | toy model {r['sha'][:12]}", flush=True)
        if args.keep:
            shutil.copytree(r["out"], os.path.join(args.keep, label))
        shutil.rmtree(work, ignore_errors=True)
    ref, new = results["reference"], results["this"]
    print(f"ratio reference / this: wall {ref['wall'] / new['wall']:.2f}x, time to the first step "
          f"{ref['first step'] / new['first step']:.1f}x")


if __name__ == "__main__":
    main()
