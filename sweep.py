"""Sweep: run a matrix of training cells one after another into one folder, then analyse them.

    python sweep.py --workflows single voting eval_opt orch_workers --tasks math code \
                    --sharings shared isolated --scale toy --seeds 0 --out runs/matrix \
                    [--dry-run] [-- --steps 200 ...flags passed to train.py]

Choices:
- A cell is workflow x task x sharing x seed at one scale; it runs as
  `python train.py --workflow W --task T --sharing S --scale SC --seed N --out OUT/W-T-S-SC-sN`
  (SC in the name is the last part of the path when --scale is a model folder)
  followed by everything after `--`, in a subprocess, one cell at a time (each cell already
  uses every core).
- A cell whose folder has a `done` file is skipped; a folder without one (an interrupted run)
  gets the same command plus `--resume OUT/cell`.
- `single` has one role, so shared and isolated are the same run: it runs once, with `shared`
  if that is listed, else the first sharing given.
- A cell that fails is reported and the sweep goes on; the exit status is 1 if any failed.
- At the end eval.py's analysis writes OUT/report.md (and the plots into each cell's folder)
  over every cell folder that exists. `--dry-run` only prints the commands and writes nothing.
"""
import argparse
import os
import shlex
import subprocess
import sys
import time

import eval as evaluation  # the analysis half of eval.py

HERE = os.path.dirname(os.path.abspath(__file__))


def cells(workflows, tasks, sharings, scale, seeds):
    """(name, train.py flags) for every cell, in the order they run."""
    tag = os.path.basename(os.path.normpath(scale))  # a model folder path names the cell by its last part
    out = []
    for wf in workflows:
        shs = sharings if wf != "single" else ["shared" if "shared" in sharings else sharings[0]]
        for task in tasks:
            for sh in shs:
                for seed in seeds:
                    name = f"{wf}-{task}-{sh}-{tag}-s{seed}"
                    flags = ["--workflow", wf, "--task", task, "--sharing", sh, "--scale", scale,
                             "--seed", str(seed)]
                    out.append((name, flags))
    return out


def command(name, flags, out, extra):
    """The train.py command of one cell, or None when the cell is already done."""
    folder = os.path.join(out, name)
    if os.path.isfile(os.path.join(folder, "done")):
        return None
    cmd = [sys.executable, os.path.join(HERE, "train.py"), *flags, "--out", folder]
    if os.path.isdir(folder):  # started before and interrupted: pick up from its checkpoint
        cmd += ["--resume", folder]
    return cmd + list(extra)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = []
    if "--" in argv:  # everything after `--` goes to train.py untouched
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Everything after `--` is passed to every train.py command.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workflows", nargs="+", default=["single", "voting", "eval_opt", "orch_workers"],
                   help="workflows to run")
    p.add_argument("--tasks", nargs="+", default=["math", "code"], help="tasks to run")
    p.add_argument("--sharings", nargs="+", default=["shared", "isolated"], help="sharing modes to run")
    p.add_argument("--scale", default="toy", help="model scale for every cell")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds; one run per seed per cell")
    p.add_argument("--out", default="runs/matrix", help="folder that holds one sub-folder per cell")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing, write nothing")
    p.add_argument("--cliff-drop", type=float, default=10.0, help="eval.py's cliff threshold (points) for the report")
    p.add_argument("--cliff-window", type=int, default=3, help="eval.py's cliff window for the report")
    args = p.parse_args(argv)
    assert set(args.sharings) <= {"shared", "isolated"}, "--sharings takes shared and/or isolated"

    todo = cells(args.workflows, args.tasks, args.sharings, args.scale, args.seeds)
    failed = []
    for k, (name, flags) in enumerate(todo, 1):
        cmd = command(name, flags, args.out, extra)
        if cmd is None:
            print(f"[{k}/{len(todo)}] skip {name}: done")
            continue
        print(f"[{k}/{len(todo)}] {shlex.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        t0 = time.time()
        rc = subprocess.run(cmd, cwd=HERE).returncode
        print(f"[{k}/{len(todo)}] {name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)

    report = os.path.join(args.out, "report.md")
    if args.dry_run:
        print(f"would write {report}")
        return 0
    folders = [os.path.join(args.out, n) for n, _ in todo if os.path.isdir(os.path.join(args.out, n))]
    summaries = evaluation.analyse(folders, args.cliff_drop, args.cliff_window, report=report)
    print(evaluation.text_table(evaluation.RUN_HEADERS, evaluation.run_rows(summaries)))
    print(f"report: {report}")
    if failed:
        print(f"failed cells: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
