"""Step time of the toy default run as 2 gloo ranks x 1 thread against 1 process x 2 threads.

    python bench/parallel.py                 # 6 steps of the default Voting run, each way
    python bench/parallel.py --steps 10 -- --workflow eval_opt --sharing isolated

Both runs are the same train.py command (the flags after `--` go to both) with evaluation
off after step 0 and no transcripts; one runs as `python train.py` with OMP_NUM_THREADS=2,
the other as `torchrun --standalone --nproc-per-node 2 train.py` with OMP_NUM_THREADS=1. The
median step time over the steps after the first (from each run's metrics.jsonl) is compared;
ratio > 1 means the 2 ranks are faster. On a 2-core machine this mostly proves the path: the
two ranks share the same cores and add a gradient all-reduce per optimizer step.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_times(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line)["time"]["step"] for line in f if line.strip()]


def run(cmd, threads):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:4])} ... failed:\n{r.stderr[-2000:]}")


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="training steps of each run (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is not timed)")
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["train.py", "--steps", str(args.steps), "--eval-every", "0", "--eval-problems", "64",
                 "--samples-every", "0", "--save-every", "0", "--quiet", *extra]
        one, two = os.path.join(tmp, "one"), os.path.join(tmp, "two")
        run([sys.executable, *flags, "--out", one], threads=2)
        run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             *flags, "--out", two], threads=1)
        t1, t2 = statistics.median(step_times(one)[1:]), statistics.median(step_times(two)[1:])
    print(f"1 process x 2 threads: {t1:.2f} s a step (median of steps 2-{args.steps})")
    print(f"2 ranks x 1 thread:    {t2:.2f} s a step")
    print(f"ratio (1 process / 2 ranks): {t1 / t2:.2f}x")


if __name__ == "__main__":
    main()
