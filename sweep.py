"""Sweep: run a matrix of train.py cells in parallel worker processes, then analyse them.

    python sweep.py --out runs/matrix                          # every workflow x task x sharing, seed 0
    python sweep.py --workflows voting eval_opt orch_workers --tasks math \\
                    --lrs 1e-3 3e-3 --seeds 0 1 --out runs/stability   # a stability map: lrs x seeds
    python sweep.py --workflows voting --tasks math --out runs/kl-agg \\
                    -- --kl-coef-role aggregator=0.05          # an intervention: flags after `--` go to every cell
    python sweep.py --workflows voting --tasks math --axis n-voters=1,3,8 --out runs/voters  # a workflow's parameter
    python sweep.py ... --dry-run                              # print the commands, run and write nothing

Choices:
- A cell is workflow x task x sharing [x lr] [x axis values] x seed at one scale. The workflows
  and tasks are the registered ones (workflows.WORKFLOWS, taskkinds.TASK_KINDS; --help lists
  them), by default less, at --scale toy, those the toy world cannot run (a fork's new role or
  task kind), each said in one line; sharings: shared, isolated. A workflow with one role (single) is the same run shared or
  isolated: it runs once per task, as `shared` if that is listed, else as the first sharing
  given. The paper's four workflows and two tasks make 3 x 2 x 2 + 2 = 14 cells per seed (and
  per lr).
- `--axis FLAG=V1,V2,...` makes each value of train.py's --FLAG a cell of its own, named with
  -FLAGVALUE. A workflow's parameter (workflows.PARAMS; --help lists them) multiplies only the
  cells of the workflows that have it; any other flag multiplies every cell.
- Cell W-T-S-SC-sN runs, from the current folder,
  `python train.py --workflow W --task T --sharing S --scale SC --seed N --out OUT/W-T-S-SC-sN`
  followed by everything after `--` (SC in the name is the last part of --scale's path). With
  `--lrs`, each lr is a cell of its own, named W-T-S-SC-lr3e-3-sN and run with `--lr 0.003`.
  Relative paths (--out, --scale, paths after `--`) are read from the current folder, for the
  runs and for the report alike.
- Workers: --jobs cells at once (default: the cores this process may use), each child with one
  thread (OMP_NUM_THREADS=1, which torch takes for its intra-op threads, and MKL_NUM_THREADS=1):
  the toy model gains little from more, and threads that outnumber the free cores spin-wait and
  run several times slower. A child's output is appended to
  OUT/logs/NAME.log, never shown on the terminal, which shows one progress bar. Cells with the
  most LLM calls per episode start first, so that the last ones to finish are short.
- At --scale toy the toy model of each task (and --toy-check, --toy-seed) is looked up first,
  once, by `python toy.py --task T`: at once when it is shipped or cached, else built, so that
  parallel cells never warm-start the same model twice.
- Rerunning the same command skips a cell whose folder has `done`, resumes one that has
  config.json but no `done` (the same command plus `--resume OUT/NAME`), and starts the rest.
- A cell that fails (non-zero exit) is reported with its exit status and the last lines of its
  log, and the others go on; the exit status is then 1.
- At the end the analysis (analysis.py, as `eval.py --runs`) writes OUT/report.md (and the
  plots into each cell's folder) over every cell folder that exists; the run table and the
  wall time are printed.
- Ctrl-C: the children run in their own session, so the terminal's Ctrl-C reaches the sweep
  only. The first one stops launching cells and forwards one SIGINT to each running cell:
  train.py finishes its step, saves ckpt-last and exits; the sweep waits for them, names the
  interrupted cells and exits 130, and rerunning the same command resumes them. A second Ctrl-C
  forwards a second SIGINT (train.py stops without saving; a rerun resumes from its last
  checkpoint) and the sweep exits at once. If the sweep itself dies (killed, terminal closed),
  Linux sends each child a SIGINT (PR_SET_PDEATHSIG), so that no cell runs on unattended.
"""
import argparse
import contextlib
import ctypes
import itertools
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import analysis   # the run-folder analysis (eval.py --runs): cliff defaults, tables
import eval as evaluation  # analyse: summaries, plots and the report
import taskkinds  # torch-free: the task kinds
import workflows  # torch-free: the workflows and their parameters

HERE = os.path.dirname(os.path.abspath(__file__))
SHARINGS = ["shared", "isolated"]
CELL_FLAGS = ("--workflow", "--task", "--sharing", "--scale", "--seed", "--out", "--resume")  # set per cell
# most LLM calls per episode first (eval_opt up to 7 on math, orch_workers up to 5, voting 4):
# long cells start early, so no worker sits idle while the last long one finishes
CALLS = {"eval_opt": 7, "orch_workers": 5, "voting": 4, "single": 1}
INTERRUPTED = (130, -signal.SIGINT)  # train.py saved and stopped; or stopped by SIGINT before its handler was set
POLL_S = 0.2
TAIL = 12  # log lines shown for a failed cell


@dataclass
class Job:
    """One child process: a cell's train.py, or a toy model build."""
    name: str
    cmd: list
    log: str
    workflow: str = ""
    task: str = ""
    proc: subprocess.Popen | None = None
    offset: int = 0        # where this launch's output starts in the (appended) log
    started: float = 0.0
    signals: int = 0       # SIGINTs forwarded to it so far
    rc: int | None = None  # None while it runs, or when a second Ctrl-C left it behind


# ----------------------------------------------------------------------------- the matrix

def usable_cores():
    try:
        return len(os.sched_getaffinity(0))  # what taskset or a container allows, not the machine
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def lr_tag(lr):
    """`3e-3` for 0.003: short, and the same however the lr was typed."""
    mantissa, exponent = f"{lr:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def axis_owners(flag):
    """The workflows whose parameter train.py's `flag` is, or None for a flag of every cell."""
    owners = workflows.params_by_dest().get(flag.lstrip("-").replace("-", "_"))
    return list(owners) if owners else None


def cells(wfs, tasks, sharings, scale, seeds, lrs=None, axes=(), skip=()):
    """(name, train.py flags) for every cell, in the order of the report. `axes`: (flag, values)
    pairs, each value a cell of its own, named by the flag and the value (`-n-voters5`); the
    axis of a workflow's parameter only for the workflows that have it. `skip`: (workflow, task)
    pairs left out (left_out)."""
    tag = os.path.basename(os.path.normpath(scale))  # a model folder path names the cell by its last part
    out = []
    for wf, task in itertools.product(wfs, tasks):
        if (wf, task) in skip:
            continue
        shs = sharings if len(workflows.ROLES[wf]) > 1 else ["shared" if "shared" in sharings else sharings[0]]
        own = [(flag, values) for flag, values in axes if wf in (axis_owners(flag) or [wf])]
        for sh, lr, *point, seed in itertools.product(shs, lrs or [None], *(values for _, values in own), seeds):
            extra = [x for (flag, _), v in zip(own, point) for x in (flag, v)]
            name = (f"{wf}-{task}-{sh}-{tag}" + (f"-lr{lr_tag(lr)}" if lr else "")
                    + "".join(f"-{flag.lstrip('-')}{v}" for (flag, _), v in zip(own, point)) + f"-s{seed}")
            flags = ["--workflow", wf, "--task", task, "--sharing", sh, "--scale", scale, "--seed", str(seed)]
            out.append((name, flags + (["--lr", str(lr)] if lr else []) + extra))
    return out


def parse_axis(p, text):
    """`FLAG=V1,V2,...` (FLAG with or without its dashes) -> ("--FLAG", [values])."""
    flag, _, values = text.partition("=")
    values = [v for v in values.split(",") if v]
    if not flag or not values:
        p.error(f"--axis {text!r}: expected FLAG=V1,V2,... (e.g. --axis n-voters=1,3,5)")
    return "--" + flag.lstrip("-"), list(dict.fromkeys(values))


def check_axes(p, flags_of_axes, wfs):
    """Refuse an axis given twice, one the sweep sets itself, or a workflow's parameter that no
    workflow of the sweep has."""
    if len(set(flags_of_axes)) < len(flags_of_axes) or set(flags_of_axes) & set(CELL_FLAGS + ("--lr",)):
        p.error("--axis: each flag once, and none the sweep sets itself (workflow, task, sharing, scale, seed, "
                "out, resume, lr: use --workflows ... --lrs)")
    for flag in flags_of_axes:
        owners = axis_owners(flag)
        if owners is not None and not set(owners) & set(wfs):
            p.error(f"--axis {flag.lstrip('-')}: a parameter of {', '.join(owners)}, which --workflows does not run")


def command(name, flags, out, extra):
    """The train.py command of one cell, or None when the cell is already done."""
    folder = os.path.join(out, name)
    if os.path.isfile(os.path.join(folder, "done")):
        return None
    cmd = [sys.executable, os.path.join(HERE, "train.py"), *flags, "--out", folder]
    if os.path.isfile(os.path.join(folder, "config.json")):  # started before and interrupted
        cmd += ["--resume", folder]
    return cmd + list(extra)


def toy_builds(args, jobs):
    """At --scale toy, one `toy.py --task T [--check L] [--seed S]` per toy model the cells still
    to run use (it returns at once when the model is shipped or cached)."""
    if args.scale != "toy":
        return []

    def value(job, flag):
        return job.cmd[job.cmd.index(flag) + 1] if flag in job.cmd else "0"
    models = list(dict.fromkeys((j.task, value(j, "--toy-check"), value(j, "--toy-seed")) for j in jobs))
    builds = []
    for t, c, s in sorted(models, key=lambda m: (args.tasks.index(m[0]), int(m[1]), int(m[2]))):
        name = f"toy-{t}" + (f"-check{c}" if c != "0" else "") + (f"-seed{s}" if s != "0" else "")
        cmd = [sys.executable, os.path.join(HERE, "toy.py"), "--task", t, *(["--check", c] if c != "0" else []),
               *(["--seed", s] if s != "0" else [])]
        builds.append(Job(name, cmd, os.path.join(args.out, "logs", name + ".log")))
    return builds


# ----------------------------------------------------------------------------- flags

def positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def check_extra(p, extra, owned):
    """Refuse a flag after `--` that the sweep sets itself: train.py would take the last one given."""
    for flag in extra:
        own = flag.split("=")[0]
        if own in owned:
            hint = {"--scale": "pass --scale to the sweep", "--out": "pass --out to the sweep",
                    "--resume": "rerun the same sweep command"}.get(own, f"pass {own}s to the sweep")
            p.error(f"{flag} after `--`: the sweep sets {own} for each cell; {hint} instead")


def check_cells(p, matrix, extra):
    """Refuse, before anything runs, flags that train.py would refuse for a cell: every cell is
    parsed as its train.py command would be (nothing loads; run folders are not looked at)."""
    import contextlib
    import io

    import flags
    for name, cell in matrix:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                flags.parse_args([*cell, *extra, "--out", os.path.join(os.devnull, name)])
        except SystemExit as e:
            if e.code:
                lines = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
                msg = lines[-1][len("error: "):].split(" (see python train.py --help)")[0] if lines else f"exit {e.code}"
                p.error(f"cell {name}: train.py refuses its flags: {msg}")


def default_axes(wfs, tasks, scale):
    """(workflows, tasks) of the sweep: the ones given, else every registered one, less (one line
    each) what the scale cannot run by default: at --scale toy a workflow with a role the toy
    model never learned and a task kind with no toy data (a fork's own, which run on a real
    model); at a real scale a task kind with no default data set there (a fork's own, whose data
    comes with `--tasks KIND -- --data FILE`)."""
    out_wfs = list(wfs or [])
    if scale == "toy" and not wfs:
        import toy   # it imports torch: only at --scale toy
        for wf in workflows.WORKFLOWS:
            try:
                toy.check_roles(wf, workflows.ROLES[wf])
                out_wfs.append(wf)
            except ValueError as e:
                print(f"sweep: leaving out {e}", file=sys.stderr)
    elif not wfs:
        out_wfs = list(workflows.WORKFLOWS)
    out_tasks, world = list(tasks or []), "toy" if scale == "toy" else "real"
    for task in [] if tasks else taskkinds.TASK_KINDS:
        if taskkinds.TASK_KINDS[task].data.get(world) is not None:
            out_tasks.append(task)
        elif world == "toy":
            print(f"sweep: leaving out --task {task}: the toy world has no data of it; name it in --tasks with a "
                  "real --scale", file=sys.stderr)
        else:
            print(f"sweep: leaving out --task {task}: it has no default data set at real scales; name it in --tasks "
                  "and give its data to every cell: -- --data FILE", file=sys.stderr)
    return out_wfs, out_tasks


def left_out(wfs, tasks, given: bool) -> set:
    """(workflow, task) pairs of a matrix that the registry leaves unwritten (a role with no
    instruction on the task: workflows.unwritten), each said in one line, where the sweep chose
    the workflows or the tasks itself; where both were named (`given`) the cell's refusal stands."""
    out = set()
    for wf, task in itertools.product(wfs, tasks):
        why = None if given else workflows.unwritten(wf, task)
        if why:
            print(f"sweep: leaving out {wf} on --task {task}: {why}", file=sys.stderr)
            out.add((wf, task))
    return out


def parse_args(argv=None):
    """(flags, the train.py flags given after `--`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = []
    if "--" in argv:  # everything after `--` goes to train.py untouched
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    from flags import Parser   # one-line errors
    p = Parser(prog="sweep.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="Everything after `--` is passed to every train.py command.")
    # --- the matrix
    p.add_argument("--workflows", nargs="+", default=None, choices=list(workflows.WORKFLOWS),
                   metavar="WORKFLOW", help="workflows to run, of %(choices)s (default: all that the scale can run)")
    p.add_argument("--tasks", nargs="+", default=None, choices=list(taskkinds.TASK_KINDS),
                   metavar="TASK", help="tasks to run, of %(choices)s (default: all that the scale can run)")
    p.add_argument("--sharings", nargs="+", default=SHARINGS, choices=SHARINGS, metavar="SHARING",
                   help="sharing modes to run, of %(choices)s (default: all)")
    p.add_argument("--scale", default="toy",
                   help="model scale of every cell, train.py's --scale (default: %(default)s)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds, one cell each (default: 0)")
    p.add_argument("--lrs", nargs="+", type=positive_float, default=None,
                   help="learning rates, one cell each, passed as --lr (default: none: train.py's lr, "
                        "names without lr)")
    params = "; ".join(f"{next(iter(o.values())).flag} ({', '.join(o)})" for o in workflows.params_by_dest().values())
    p.add_argument("--axis", action="append", default=[], metavar="FLAG=V1,V2,...",
                   help="one more axis: train.py's --FLAG at each value, a cell each (repeatable), e.g. "
                        "--axis n-voters=1,2,3,5,8; the cell names end in -FLAGVALUE. A workflow's parameter "
                        f"multiplies only that workflow's cells: {params}")
    # --- running
    p.add_argument("--out", default="runs/matrix",
                   help="folder of the cell folders, logs/ and report.md (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=usable_cores(),
                   help="cells run at once (default: the usable cores, here %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing, write nothing")
    # --- the report
    p.add_argument("--cliff-drop", type=float, default=analysis.CLIFF_DROP,
                   help="the analysis's cliff threshold (points) for the report (default: %(default)s)")
    p.add_argument("--cliff-window", type=int, default=analysis.CLIFF_WINDOW,
                   help="the analysis's cliff window for the report (default: %(default)s)")
    args = p.parse_args(argv)

    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    given = bool(args.workflows and args.tasks)
    args.workflows, args.tasks = default_axes(args.workflows, args.tasks, args.scale)
    args.skip = left_out(args.workflows, args.tasks, given)
    args.axes = [parse_axis(p, a) for a in args.axis]
    flags_of_axes = tuple(f for f, _ in args.axes)
    check_axes(p, flags_of_axes, args.workflows)
    check_extra(p, extra, CELL_FLAGS + (("--lr",) if args.lrs else ()) + flags_of_axes)
    for name in ("workflows", "tasks", "sharings", "seeds", "lrs"):  # a value given twice is one cell
        setattr(args, name, getattr(args, name) and list(dict.fromkeys(getattr(args, name))))
    check_cells(p, cells(args.workflows, args.tasks, args.sharings, args.scale, args.seeds, args.lrs, args.axes,
                         args.skip), extra)
    args.out = os.path.abspath(args.out)  # runs and report under the same folder, whatever the cwd
    return args, extra


# ----------------------------------------------------------------------------- children

def child_env():
    """This environment with every thread pool of a child at one thread."""
    # torch sizes its intra-op pool from OMP_NUM_THREADS; the tokenizer's own pool stays off
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def die_with_parent():
    """A preexec_fn (Linux) that has the kernel send the child SIGINT when the sweep dies, so it
    saves and stops rather than run on unattended. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
    parent = os.getpid()

    def preexec():
        prctl(1, int(signal.SIGINT))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:    # the sweep died before prctl took effect: nobody would tell us
            os._exit(130)
    return preexec


def launch(job, env, preexec):
    """Start a job in its own session (so the terminal's Ctrl-C reaches only the sweep, which
    forwards it), its output appended to its log after a header line."""
    with open(job.log, "ab") as log:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} sweep: {shlex.join(job.cmd)}\n".encode())
        log.flush()
        job.offset, job.started = log.tell(), time.time()
        job.proc = subprocess.Popen(job.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True, preexec_fn=preexec)


def log_tail(job, n=TAIL):
    """The last n lines of this launch's output; a progress bar redraws its line with \\r, so
    each line keeps its last drawing."""
    with open(job.log, "rb") as f:
        f.seek(job.offset)
        text = f.read().decode(errors="replace")
    lines = [line.rstrip("\r").rsplit("\r", 1)[-1].rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return [line for line in lines if line][-n:]


def exit_text(rc):
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"


def minutes(seconds):
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


# ----------------------------------------------------------------------------- the pool

@contextlib.contextmanager
def counted_sigint():
    """Within: each Ctrl-C (SIGINT) is appended to the yielded list instead of raising."""
    hits = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        yield hits
    finally:
        signal.signal(signal.SIGINT, old)


def reap(running, bar):
    """Remove the jobs that ended from `running`, with one line each; returns them."""
    ended = [j for j in running if j.proc.poll() is not None]
    for j in ended:
        running.remove(j)
        j.rc = j.proc.returncode
        took = minutes(time.time() - j.started)
        if j.rc == 0:
            bar.write(f"done {j.name} ({took})")
        elif j.rc not in INTERRUPTED:
            bar.write(f"failed {j.name}: {exit_text(j.rc)} after {took} (log {j.log})")
    return ended


def run_pool(jobs, n_workers, env, bar, hits):
    """Run the jobs, n_workers at a time, until all have ended or a second Ctrl-C came; every
    Ctrl-C in `hits` is forwarded once to every running job."""
    pending, running, preexec = list(jobs), [], die_with_parent()
    while pending or running:
        while pending and len(running) < n_workers and not hits:
            job = pending.pop(0)
            launch(job, env, preexec)
            running.append(job)
        for job in running:
            while job.signals < len(hits):
                job.proc.send_signal(signal.SIGINT)
                job.signals += 1
        ended = reap(running, bar)
        failed = sum(j.rc not in (None, 0, *INTERRUPTED) for j in jobs)
        bar.set_postfix_str(f"running {len(running)}, failed {failed}", refresh=False)
        bar.update(sum(j.rc == 0 for j in ended))  # redraws at most once a second (mininterval)
        if len(hits) >= 2 or (hits and not running):
            return
        time.sleep(POLL_S)


def run_phase(jobs, n_workers, desc, total, done, hits):
    """One progress bar over `total` items of which `done` are finished before the start."""
    from tqdm import tqdm
    tqdm.monitor_interval = 0  # no monitor thread: the children are forked with a preexec_fn
    with tqdm(total=total, initial=done, desc=desc, unit="cell", dynamic_ncols=True, mininterval=1.0) as bar:
        run_pool(jobs, n_workers, child_env(), bar, hits)


# ----------------------------------------------------------------------------- main

def plan(args, extra):
    """(every cell of the matrix, jobs of the cells still to run, the toy builds they need)."""
    matrix = cells(args.workflows, args.tasks, args.sharings, args.scale, args.seeds, args.lrs, args.axes, args.skip)
    jobs = []
    for name, flags in matrix:
        cmd = command(name, flags, args.out, extra)
        if cmd is not None:
            opts = dict(zip(flags[::2], flags[1::2]))
            jobs.append(Job(name, cmd, os.path.join(args.out, "logs", f"{name}.log"),
                            workflow=opts["--workflow"], task=opts["--task"]))
    jobs.sort(key=lambda j: -CALLS.get(j.workflow, 1))  # stable: the matrix order within a workflow
    return matrix, jobs, toy_builds(args, jobs)


def print_failures(jobs):
    """Name, exit status and last log lines of every job that failed; returns their names."""
    failed = [j for j in jobs if j.rc not in (None, 0, *INTERRUPTED)]
    for j in failed:
        print(f"\nFAILED {j.name}: {exit_text(j.rc)}; last lines of {j.log}:", file=sys.stderr)
        for line in log_tail(j):
            print(f"    {line}", file=sys.stderr)
    return [j.name for j in failed]


def stopped(jobs, hits):
    """The one line after a Ctrl-C; the exit status 130."""
    if len(hits) >= 2:  # those still running were sent the second SIGINT: they stop without saving
        cut = ", ".join(j.name for j in jobs if j.proc is not None and j.rc is None) or "no cell was running"
        print(f"aborted: {cut}; run the same command again to resume from their last checkpoints")
    else:
        cut = ", ".join(j.name for j in jobs if j.rc in INTERRUPTED) or "no cell was running"
        print(f"interrupted: {cut}; run the same command again to resume")
    return 130


def analyse(args, matrix):
    """OUT/report.md over every cell folder that exists; prints the run table."""
    report = os.path.join(args.out, "report.md")
    folders = [os.path.join(args.out, n) for n, _ in matrix if os.path.isdir(os.path.join(args.out, n))]
    summaries = evaluation.analyse(folders, args.cliff_drop, args.cliff_window, report=report)
    # whole cell names: a name cut in the middle hides the sharing mode or an axis value
    print(analysis.text_table(analysis.RUN_HEADERS, analysis.run_rows(summaries), width=None))
    print(f"report: {report}")


def main(argv=None):
    t0 = time.time()
    args, extra = parse_args(argv)
    matrix, jobs, builds = plan(args, extra)
    workers = min(args.jobs, max(1, len(jobs)))
    resumes = sum("--resume" in j.cmd for j in jobs)
    print(f"{len(matrix)} cells: {len(matrix) - len(jobs)} done (skipped), {resumes} to resume, {len(jobs) - resumes} "
          f"to start; {workers} at a time, one thread each; logs in {os.path.join(args.out, 'logs')}")
    if args.dry_run:
        to_run = {j.name for j in jobs}
        for name in (n for n, _ in matrix if n not in to_run):
            print(f"skip {name}: done")
        for j in builds + jobs:
            print(shlex.join(j.cmd))
        print(f"would write {os.path.join(args.out, 'report.md')}")
        return 0
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    with counted_sigint() as hits:
        if builds:
            run_phase(builds, min(args.jobs, len(builds)), "toy models", len(builds), 0, hits)
        if print_failures(builds):
            return 1  # every cell of that task would try to build the model itself
        if not hits:
            run_phase(jobs, workers, "sweep", len(matrix), len(matrix) - len(jobs), hits)
    if hits:
        return stopped(builds + jobs, hits)
    try:
        analyse(args, matrix)
    except KeyboardInterrupt:
        print("interrupted while writing the report; run the same command again to write it")
        return 130
    failed = print_failures(jobs)
    print(f"wall time {minutes(time.time() - t0)}: {len(jobs) - len(failed)} cells ran, {len(failed)} failed, "
          f"{len(matrix) - len(jobs)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # a Ctrl-C outside the cell loop (imports, the last line): no traceback
        sys.exit(130)
