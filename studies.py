"""The toy lab's studies as data: which runs each study holds, their logs kept under
results/STUDY/, and each study's table, effect sizes and figure regenerated from those logs.

    python studies.py keep amplification RUN [RUN ...]   # copy finished runs' logs into results/
    python studies.py keep damping ../study/runs/damping # every finished run under a folder
    python studies.py restore amplification ../study      # kept runs back into a new worktree's runs/
    python studies.py report                             # every study's table and contrasts
    python studies.py report amplification --write       # and its block in docs/RESULTS.md, its figure

Choices:
- A kept run is results/STUDY/SWEEP/RUN/ (its sweep's folder name and its own, e.g.
  amplification-frozen-aggregator/voting-math-isolated-toy-lr2e-3-n-voters8-s0) with
  config.json, metrics.jsonl and eval.jsonl (each gzip-compressed, as FILE.gz, past GZIP_OVER
  bytes) and an empty `done`: no checkpoints, and no samples but for a study that quotes them
  (Study.samples: samples.jsonl too). Only a finished run is kept (its
  folder has `done`); keeping it again replaces it.
- One study, one commit and one toy model: `keep` refuses a run whose provenance (the commit,
  a dirty tree, the base model's sha256; config.json's `provenance`) differs from the runs
  the study already holds, so runs of other code or another toy model are never pooled. Where
  the toy model is the study's knob (capture's `--toy-check L` warm-starts a model per L),
  it is one toy model per value of that knob.
- A run belongs to an arm, named from its configuration by the study's `arm` function
  (e.g. "N=8, equal steps"). Per arm: seeds, base / peak / final accuracy and the drop from
  the peak (mean ± standard error over seeds), terminal cliffs k/n (analysis.py's rule), and
  the study's mechanism columns.
- A contrast "A minus B" is the difference of the two arms' means of one measure, D ± E points
  with E = sqrt(se_A^2 + se_B^2) (the seeds of two arms are independent draws). Every study
  contrasts the final accuracy; a study names more measures (Study.measures): the drop from
  the peak, where the question is a collapse, and the gain (final minus the run's own step 0),
  where the arms start from different toy models (capture), so that final minus final would
  mix the toy models with the training. Where a seed's arms share the toy model, the problems
  and step 0's samples (Study.paired: amplification, damping), each contrast is also given
  paired by seed: the mean of the per-seed differences over the seeds both arms ran, with
  its standard error, which leaves out how far the seeds themselves lie apart.
- docs/RESULTS.md holds each study's block between `<!-- study NAME -->` and
  `<!-- end NAME -->`, written by `report --write`; tests/test_results.py regenerates every
  block from results/ and fails when the page and the logs drift apart.
"""
import argparse
import gzip
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field, replace

import analysis
import intervals
import workflows  # torch-free: the registry, for the roles of a run's workflow

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PAGE = os.path.join(HERE, "docs", "RESULTS.md")
FIGURES = os.path.join(HERE, "docs", "figures")
KEPT = ("config.json", "metrics.jsonl", "eval.jsonl")
ROLES = "roles.json"     # kept beside them where a run has it: its end evaluated role by role (role_evals)
GZIP_OVER = 1_000_000   # bytes: a larger log is kept compressed
ORIGIN = ("commit", "dirty", "model_sha256")   # what must be one across a study's runs
SENSITIVITY = (analysis.CLIFF_DROP, 20.0)      # the drops D (points) the outcomes are counted at


# ----------------------------------------------------------------------------- the studies

def _voters(cfg: dict) -> str:
    """Amplification's arm: the number of voters, and the control or lr that differs."""
    n = cfg.get("n_voters") or 3
    per_step = cfg.get("problems_per_step", 16) * cfg.get("group_size", 8)
    tags = []
    if (cfg.get("lr_role") or {}).get("aggregator") == 0:
        tags.append("aggregator frozen")
    if n > 1 and cfg.get("mini_batch") == n * per_step:
        tags.append("equal steps")
    if cfg.get("lr") != 2e-3:
        tags.append(f"lr {analysis.lr_label(cfg.get('lr'))}")
    return ", ".join([f"N={n}", *tags])


def _check_length(cfg: dict) -> str:
    return f"{cfg.get('workflow')}, L={cfg.get('toy_check') or 0}"


def _credit_arm(cfg: dict) -> str:
    """Credit's arm: the number of voters and what a voter is paid (N=1: its own answer is the
    graded one either way)."""
    n = cfg.get("n_voters") or 3
    return "N=1" if n == 1 else f"N={n}, {cfg.get('credit') or 'final'}"


def _voterfall_arm(cfg: dict) -> str:
    """The voter fall's arm: N, what a voter is paid, and the generator adapter's optimizer steps
    per training step (N x the step's rows over the mini-batch)."""
    n = cfg.get("n_voters") or 3
    if n == 1:
        return "N=1"
    steps = -(-n * cfg.get("problems_per_step", 16) * cfg.get("group_size", 8) // (cfg.get("mini_batch") or 128))
    return f"N={n}, {cfg.get('credit') or 'final'}, {steps} step{'s' * (steps != 1)}"


def _workflow_arm(cfg: dict) -> str:
    """The map's and study R's arm: the workflow and its sharing (single has one role: sharing
    means nothing there)."""
    return "single" if cfg.get("workflow") == "single" else f"{cfg.get('workflow')}, {cfg.get('sharing')}"


def _damping_arm(cfg: dict) -> str:
    arm = "placebo" if cfg.get("damp_placebo") else "damping" if cfg.get("coherence_damp") else "none"
    return f"{cfg.get('workflow')}, {arm}"


@dataclass
class Study:
    """One study: what it asks, how its runs split into arms, the contrasts it reports."""
    title: str
    arm: object                                   # config -> arm name
    order: list                                   # the arms, in the table's order
    contrasts: list                               # [(arm A, arm B[, measures])]: A minus B, in each measure
    roles: tuple = ()                             # roles whose mechanism columns the table shows
    runs: str = ""                                # how the runs were made (the page shows it)
    panel: tuple = ()                             # the figure's mechanism: (key, roles, label), the first role a run has
    model_by: str = ""                            # the config key whose value selects the toy model (a knob of the study)
    crossed: bool = False                         # model_by is a factor crossed with the arms: a run is (model, seed)
    mechanisms: list = field(default_factory=lambda: ["displacement", "len", "parse_fail"])
    measures: tuple = ("final_acc",)              # what the contrasts compare (MEASURES)
    gains: bool = False                           # each arm's gain over step 0, with its interval
    signatures: bool = False                      # each fallen run's failure signature (analysis.py)
    paired: bool = False                          # a seed's arms share model, problems, step 0: pair by seed
    borrows: str = ""                             # a study (one commit with this) whose kept runs of this one's arms join them
    samples: bool = False                         # keep samples.jsonl too (transcripts the page quotes)
    curve: str = ""                               # a second figure: "runs", every run's accuracy per workflow;
                                                  # "arms", each arm's mean accuracy and reward by step


MEASURES = {"final_acc": "final accuracy", "peak_acc": "peak accuracy", "gain": "the gain (final minus step 0)",
            "drop": "the drop from the peak", "dip": "the deepest dip",
            "end_acc": f"the end (mean of the last {analysis.END_EVALS} evaluations)"}
MAP_WORKFLOWS = ("voting", "eval_opt", "orch_workers")
Q_WORKFLOWS = ("voting", "eval_opt")   # study Q's workflows (Orch-Workers left out for the budget)


STUDIES = {
    "map": Study(
        "The map: every workflow under Shared and Isolated, math, the toy default lr (1e-3), 400 steps",
        _workflow_arm, ["single"] + [f"{w}, {sh}" for w in MAP_WORKFLOWS for sh in ("shared", "isolated")],
        [(f"{w}, isolated", f"{w}, shared") for w in MAP_WORKFLOWS]
        + [(f"{w}, {sh}", "single", ("final_acc",)) for w in MAP_WORKFLOWS for sh in ("shared", "isolated")],
        roles=("generator", "aggregator", "evaluator", "orchestrator", "worker", "synthesizer"),
        mechanisms=["len", "parse_fail"], measures=("peak_acc", "final_acc", "drop", "dip"), paired=True,
        gains=True, signatures=True, curve="runs",
        runs="python sweep.py --jobs 1 --tasks math --workflows voting eval_opt orch_workers single --seeds S "
             "--out runs/map -- --steps 400 --eval-every 20 --eval-problems 256 (results/lab.sh part M)"),
    "default": Study(
        "The default run: `python train.py` (Voting / Shared, math, the toy defaults)",
        lambda cfg: f"{cfg.get('workflow')}, {cfg.get('sharing')}", ["voting, shared"], [],
        roles=("generator", "aggregator"), mechanisms=["displacement", "len"],
        runs="MARL_CACHE=<empty folder> python train.py"),
    "amplification": Study(
        "Amplification: Voting / Isolated, math, the number of voters N and two controls",
        _voters,
        ["N=1", "N=2", "N=4", "N=8", "N=4, equal steps", "N=8, equal steps", "N=4, aggregator frozen",
         "N=8, aggregator frozen", "N=1, lr 1e-3", "N=8, lr 1e-3"],
        [("N=8", "N=1"), ("N=8", "N=8, equal steps"), ("N=8", "N=8, aggregator frozen"), ("N=4", "N=1"), ("N=2", "N=1"),
         ("N=4", "N=4, equal steps"), ("N=4", "N=4, aggregator frozen"), ("N=8, lr 1e-3", "N=1, lr 1e-3")],
        roles=("generator", "aggregator"), panel=("displacement", ("generator",), "generator adapter's ‖Δθ‖ / step"),
        paired=True,
        runs="python sweep.py --jobs 1 --tasks math --workflows voting --sharings isolated --lrs 2e-3 --seeds S "
             "--axis n-voters=8,4,2,1 -- --steps 60 --eval-every 10 --eval-problems 256; equal steps: "
             "--axis n-voters=N --axis mini-batch=128N; aggregator frozen: -- --lr-role aggregator=0; "
             "lr 1e-3: --lrs 1e-3 --axis n-voters=8,1 -- --steps 100"),
    "capture": Study(
        "Capture: Shared, math, the supervisors' check length L (their gradient mass)",
        _check_length,
        [f"{w}, L={L}" for w in ("voting", "eval_opt") for L in (0, 8, 24)],
        [(f"{w}, L={L}", f"{w}, L=0") for w in ("voting", "eval_opt") for L in (8, 24)],
        roles=("generator", "aggregator", "evaluator"),
        mechanisms=["share", "move_cos", "displacement", "len", "parse_fail"],
        panel=("share", ("aggregator", "evaluator"), "supervisor's gradient share"), model_by="toy_check",
        measures=("final_acc", "gain", "drop"),
        runs="python sweep.py --jobs 1 --tasks math --workflows voting eval_opt --sharings shared --lrs 2e-3 "
             "--seeds S --axis toy-check=0,8,24 -- --steps 60 --eval-every 10 --eval-problems 256"),
    "credit": Study(
        "Credit: Voting / Isolated, math, lr 2e-3, what a voter is paid (the final grade or its own), "
        "on three toy models",
        _credit_arm, ["N=1", "N=2, final", "N=2, own", "N=8, final", "N=8, own"],
        [("N=2, own", "N=2, final"), ("N=8, own", "N=8, final"), ("N=8, own", "N=1"), ("N=2, final", "N=1"),
         ("N=8, final", "N=1")],
        roles=("generator", "aggregator"), mechanisms=["displacement", "paid_apart"],
        panel=("displacement", ("generator",), "generator adapter's ‖Δθ‖ / step"),
        paired=True, model_by="toy_seed", crossed=True,
        runs="python sweep.py --jobs 1 --tasks math --workflows voting --sharings isolated --lrs 2e-3 --seeds S "
             "--axis n-voters=8,2 --axis credit=final,own --axis toy-seed=M -- --steps 60 --eval-every 10 "
             "--eval-problems 256 (and --axis n-voters=1); M = 0 (the shipped model) with S = 0, 1, 2, "
             "M = 1 and 2 (toy_models/math-seed1, -seed2) with S = 0, 1: results/lab.sh parts D and E"),
    "voterfall": Study(
        "The voter fall's 2x2: Voting / Isolated, math, lr 2e-3, N=8, what a voter is paid x the generator's "
        "optimizer steps per training step, on three toy models",
        _voterfall_arm, ["N=1", "N=8, final, 8 steps", "N=8, own, 8 steps", "N=8, final, 1 step", "N=8, own, 1 step"],
        [("N=8, own, 1 step", "N=1"), ("N=8, final, 1 step", "N=1"), ("N=8, own, 1 step", "N=8, final, 8 steps"),
         ("N=8, final, 1 step", "N=8, final, 8 steps"), ("N=8, own, 1 step", "N=8, own, 8 steps"),
         ("N=8, own, 1 step", "N=8, final, 1 step")],
        roles=("generator", "aggregator"), mechanisms=["displacement", "own_change"],
        panel=("own_change", ("generator",), "generator's own accuracy, end - start (points)"),
        paired=True, model_by="toy_seed", crossed=True, borrows="credit",
        runs="the credit study's N=8 cells with --axis mini-batch=1024 (one generator step per training step; "
             "results/lab.sh part F); N=1 and the 8-step arms are the credit study's runs; every N=8 run's end "
             "evaluated role by role with `python studies.py roles RUN...`"),
    "real": Study(
        "A real model learns: SmolLM2-135M-Instruct on arith (a + b, 1-20, graded on the last number), "
        "on a CPU", _workflow_arm, ["single", "voting, shared", "voting, isolated"],
        [("voting, isolated", "voting, shared")],
        roles=("generator", "aggregator"), mechanisms=["len0", "len", "step_s"], measures=("final_acc", "gain"),
        gains=True, samples=True, curve="arms",
        runs="python sweep.py --jobs 1 --scale smollm2-135m --tasks arith --workflows single --seeds S "
             "--out runs/real -- " + " ".join(["--problems-per-step 8 --group-size 8 --steps 24 --eval-every 6",
                                              "--eval-problems 0 --lr 1e-4 --warmup-steps 2 --lora-rank 16",
                                              "--grad-checkpointing off --device cpu"]) + ": results/lab.sh part R; the "
             "Voting arms: --workflows voting --sharings shared isolated and --problems-per-step 4 (part V)"),
    "q": Study(
        "The paper's question on a real model: SmolLM2-135M-Instruct on arith (split by pair), every workflow "
        "under Shared and Isolated, on a CPU",
        _workflow_arm, ["single"] + [f"{w}, {sh}" for w in Q_WORKFLOWS for sh in ("shared", "isolated")],
        [(f"{w}, isolated", f"{w}, shared") for w in Q_WORKFLOWS]
        + [(f"{w}, {sh}", "single") for w in Q_WORKFLOWS for sh in ("shared", "isolated")],
        roles=("generator", "aggregator", "evaluator"), mechanisms=["len0", "len", "parse_fail", "step_s"],
        measures=("end_acc", "peak_acc"), paired=True, gains=True, signatures=True, samples=True, curve="runs",
        runs="python sweep.py --jobs 1 --scale smollm2-135m --tasks arith --workflows single voting "
             "--seeds S --out runs/q -- " + " ".join(["--problems-per-step 4 --group-size 8 --steps 48",
                                                     "--eval-every 6 --eval-problems 0 --lr 1e-4 --warmup-steps 2",
                                                     "--lora-rank 16 --grad-checkpointing off --device cpu"])
             + ", then --workflows eval_opt with the same flags and --eval-rounds 1 (results/lab.sh part Q); "
             "the base rates: results/q/base/"),
    "damping": Study(
        "Coherence damping against its placebo and against nothing: Isolated, math, lr 2e-3",
        _damping_arm,
        [f"{w}, {a}" for w in ("orch_workers", "eval_opt") for a in ("none", "damping", "placebo")],
        [(f"{w}, damping", f"{w}, {b}") for w in ("orch_workers", "eval_opt") for b in ("none", "placebo")],
        roles=("worker", "generator"), mechanisms=["displacement", "damp_scale"],
        panel=("displacement", ("worker", "generator"), "damped role's adapter ‖Δθ‖ / step"),
        measures=("final_acc", "drop"), paired=True,
        runs="python sweep.py --jobs 1 --tasks math --workflows W --sharings isolated --lrs 2e-3 --seeds S "
             "-- --steps 60 --eval-every 10 --eval-problems 256 [--coherence-damp worker=0.5 | generator=0.5] "
             "[--damp-placebo]"),
}


# ----------------------------------------------------------------------------- keeping runs

def shipped_models() -> dict:
    """{sha256 of model.safetensors: name} of the toy models the repository ships (toy_models/,
    toy.py), read from their manifest: a study on another toy model says so on the page."""
    path = os.path.join(HERE, "toy_models", "MANIFEST.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return {e["files"]["model.safetensors"]: name for name, e in json.load(f).items()}


def origin(cfg: dict, study: str | None = None) -> tuple:
    """(commit, dirty, model_sha256), and for a study whose toy model is one of its knobs
    (Study.model_by) that knob's value: runs of one study share the rest of the tuple."""
    p = cfg.get("provenance") or {}
    by = STUDIES[study].model_by if study else None
    return tuple(p.get(k) for k in ORIGIN) + ((cfg.get(by) or 0,) if by else ())


def kept_runs(study: str) -> list:
    """The run folders a study holds (results/STUDY/SWEEP/RUN), in order."""
    folder = os.path.join(RESULTS, study)
    return run_folders(folder) if os.path.isdir(folder) else []


def kept_name(run: str) -> str:
    """Where a run is kept under results/STUDY/: SWEEP/RUN, its sweep's folder name and its own.
    The run's name alone is not enough: sweep.py names a cell by its axes only, so the cells of
    two arms that differ in a pass-through flag (N=8 and N=8 with the aggregator frozen) share
    one name, in two sweep folders."""
    run = os.path.normpath(os.path.abspath(run))
    return os.path.join(os.path.basename(os.path.dirname(run)), os.path.basename(run))


def keep(study: str, run: str) -> str:
    """Copy a finished run's logs into results/STUDY/SWEEP/RUN (see the module's choices); the
    folder written. A ValueError says why a run cannot be kept."""
    if study not in STUDIES:
        raise ValueError(f"no study {study!r} (studies: {', '.join(STUDIES)})")
    if not os.path.isfile(os.path.join(run, "done")):
        raise ValueError(f"{run}: not finished (no `done`): only finished runs are kept")
    cfg = analysis.read_config(run, quiet=True)
    if not cfg.get("provenance"):
        raise ValueError(f"{run}: its config.json records no provenance (a run of older code)")
    name = kept_name(run)
    dest = os.path.join(RESULTS, study, name)
    mine = origin(cfg, study)
    borrowed = kept_runs(STUDIES[study].borrows) if STUDIES[study].borrows else []   # pairs with those: one commit
    others = {origin(analysis.read_config(r, quiet=True), study) for r in kept_runs(study) + borrowed
              if os.path.normpath(r) != os.path.normpath(dest)}
    # one commit for the study; one toy model per value of the knob that selects it (if any)
    if any(o[:2] != mine[:2] or (o[3:] == mine[3:] and o[2] != mine[2]) for o in others):
        raise ValueError(f"{run}: commit / dirty / toy model {mine[:3]} differ from the study's runs {sorted(others)}")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for f in kept_files(study) + ((ROLES,) if os.path.isfile(os.path.join(run, ROLES)) else ()):
        src = os.path.join(run, f)
        if os.path.getsize(src) > GZIP_OVER:
            with open(src, "rb") as a, gzip.open(os.path.join(dest, f + ".gz"), "wb") as b:
                shutil.copyfileobj(a, b)
        else:
            shutil.copy(src, dest)
    open(os.path.join(dest, "done"), "w").close()
    return dest


def kept_files(study: str) -> tuple:
    """The files a kept run of `study` holds, beside `done` (and ROLES where it has one): KEPT,
    and samples.jsonl where the study quotes transcripts (Study.samples)."""
    return KEPT + (("samples.jsonl",) if STUDIES[study].samples else ())


def restore(study: str, worktree: str) -> list:
    """Put each kept run's logs (decompressed) and `done` back where the study's worktree had
    it: the part of config.json's `out` from its last `runs` folder on, under `worktree`. A
    sweep rerun there then skips those cells instead of running them again (on a new machine,
    where the worktree's runs/ is gone). Returns the folders written; a run whose folder is
    already there, or whose `out` has no `runs` folder, is left alone with a line."""
    written = []
    for kept in kept_runs(study):
        parts = os.path.normpath(analysis.read_config(kept, quiet=True).get("out") or "").split(os.sep)
        if "runs" not in parts:
            print(f"skipped {kept}: its config.json's out has no runs/ folder", file=sys.stderr)
            continue
        dest = os.path.join(worktree, *parts[len(parts) - 1 - parts[::-1].index("runs"):])
        if os.path.exists(dest):
            print(f"skipped {kept}: {dest} is already there", file=sys.stderr)
            continue
        os.makedirs(dest)
        for f in kept_files(study) + ((ROLES,) if os.path.isfile(os.path.join(kept, ROLES)) else ()):
            src = os.path.join(kept, f)
            with (open(src, "rb") if os.path.isfile(src) else gzip.open(src + ".gz", "rb")) as a, \
                    open(os.path.join(dest, f), "wb") as b:
                shutil.copyfileobj(a, b)
        open(os.path.join(dest, "done"), "w").close()
        written.append(dest)
    return written


def _read_roles(folder: str) -> dict | None:
    path = os.path.join(folder, ROLES)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _evaluate(args: list, problems: int) -> dict:
    """One `eval.py ... --json` of this checkout, one thread: the accuracy, and the aggregator's
    selection accuracy and oracle rate where it has them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.join(HERE, "eval.py"), *args, "--problems", str(problems), "--json",
                          "--quiet"], cwd=HERE, env=env, capture_output=True, text=True)
    if out.returncode:
        raise ValueError(f"eval.py {' '.join(args)} failed: {out.stderr.strip().splitlines()[-1:]}")
    r = json.loads(out.stdout)
    agg = r["quality"].get("aggregator") or {}
    return {"acc": r["pass@k"]["1"], "selection_acc": agg.get("selection_acc"), "oracle_rate": agg.get("oracle_rate")}


def role_evals(run: str, problems: int = 256, cache: dict | None = None) -> dict:
    """Which role carries a Voting run's end: its last checkpoint and its untrained toy model,
    each evaluated by this checkout's eval.py (`commit` records which: the toy's evaluations are
    the same bytes from the studies' commits on, results/checks/) on the run's `problems`
    held-out problems and its seed's draws, with one voter (the generator's own accuracy: one
    candidate leaves nothing to choose) and with the run's voters (the aggregator's selection
    accuracy: its pick is right given that some voter is right). `cache` keeps the untrained
    model's evaluations across runs."""
    cfg = analysis.read_config(run, quiet=True)
    n, seed = cfg.get("n_voters") or 3, str(cfg.get("seed") or 0)
    start = ["--workflow", "voting", "--task", cfg.get("task") or "math", "--scale", "toy", "--seed", seed,
             "--toy-seed", str(cfg.get("toy_seed") or 0), "--sharing", cfg.get("sharing") or "shared"]
    end = ["--checkpoint", os.path.join(os.path.abspath(run), "ckpt-last"), "--seed", seed]
    cache = {} if cache is None else cache
    out = {"problems": problems, "voters": n, "commit": _head()}
    for when, args in (("start", start), ("end", end)):
        out[when] = {}
        for k in (1, n):
            key = (tuple(args), k)
            if when == "end" or key not in cache:
                cache[key] = _evaluate([*args, "--n-voters", str(k)], problems)
            out[when]["one voter" if k == 1 else f"{n} voters"] = cache[key]
    return out


def _head() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() + ("+dirty" if dirty else "")) if out.returncode == 0 else None


# ----------------------------------------------------------------------------- the analysis

def _per_step(run: dict, role: str, key: str):
    """Mean over training steps of one of a role's per-step numbers (metrics.jsonl `roles`)."""
    xs = [m["roles"][role][key] for m in run["metrics"]
          if role in m.get("roles", {}) and m["roles"][role].get(key) is not None]
    return sum(xs) / len(xs) if xs else None


def _adapter_move(run: dict, role: str):
    """Mean displacement per training step of the adapter `role` trains. Under shared every
    role trains the one adapter: its move is given once, under the run's first role."""
    first = next(iter((run["metrics"] or [{}])[-1].get("roles", {})), None)
    if run["config"].get("sharing") == "shared" and role != first:
        return None
    return _per_step(run, role, "displacement")


def _mechanism(run: dict, s: dict, key: str, role: str):
    """One mechanism number of one run for a role: its adapter's displacement per step, its
    gradient share, its length and parse-failure rate at the end (the last tenth / the last
    evaluation), the damping's mean scale, and under shared the cosine between the role's
    descent direction and the one adapter's move (`move_cos`: which role the move followed); its
    length in the first tenth of training (`len0`); the run's wall seconds per training step
    (`step_s`, the median, under its first role: a run paused for a benchmark on a shared machine
    logs that step's pause, which the mean would spread over the run)."""
    m = s["mechanisms"]
    if key == "displacement":
        return _adapter_move(run, role)
    if key == "share":
        return m["grad_share"].get(role)
    if key == "len":
        return (m["len_drift"].get(role) or (None, None))[1]
    if key == "parse_fail":
        return (m.get("parse_fail_drift", {}).get(role) or (None, None))[1]
    if key == "move_cos":
        return _per_step(run, role, "move_cos")
    if key == "damp_scale":
        return m.get("damp_scale", {}).get(role)
    if key == "paid_apart":
        return _per_step(run, role, "paid_apart")
    if key == "len0":
        return (m["len_drift"].get(role) or (None, None))[0]
    if key == "step_s":   # the run's, shown once: under its first role
        first = next(iter((run["metrics"] or [{}])[-1].get("roles", {})), None)
        times = [x["time"]["step"] for x in run["metrics"] if (x.get("time") or {}).get("step") is not None]
        return statistics.median(times) if role == first and times else None   # a paused step is an outlier
    if key == "own_change":
        return role_change(run.get("roles"), role)
    raise KeyError(key)


def role_change(roles: dict | None, role: str):
    """From a run's roles.json (role_evals): end minus start, in points, of the generator's own
    accuracy (one voter) or of the aggregator's selection accuracy (the run's voters)."""
    if not roles:
        return None
    key, what = ("one voter", "acc") if role == "generator" else (f"{roles['voters']} voters", "selection_acc")
    a, b = roles["start"][key].get(what), roles["end"][key].get(what)
    return None if a is None or b is None else 100 * (b - a)


def unit(st: Study, run: dict, s: dict):
    """What one run of an arm stands for: its seed, or (model, seed) where the toy model is a
    factor crossed with the arms (Study.crossed)."""
    return (run["config"].get(st.model_by) or 0, s["seed"]) if st.crossed else s["seed"]


def arms(study: str, folders: list | None = None) -> dict:
    """{arm: [(run, summary)]} of a study's kept runs (or of `folders`), one run per unit; a
    study that borrows (Study.borrows) adds the other study's runs of the arms it lists."""
    st = STUDIES[study]
    out = {}
    if folders is None:
        folders = kept_runs(study) + (kept_runs(st.borrows) if st.borrows else [])
    for folder in folders:
        run = analysis.load_run(folder, quiet=True)
        run["roles"] = _read_roles(folder)
        name = st.arm(run["config"])
        if st.borrows and name not in st.order:
            continue
        s = analysis.analyse_run(folder, run=run)
        group = out.setdefault(name, [])
        if unit(st, run, s) not in [unit(st, r, x) for r, x in group]:
            group.append((run, s))
    return out


def by_model(study: str, groups: dict) -> dict:
    """{model: {arm: [(run, summary)]}}: a crossed study's arms split by toy model."""
    st, out = STUDIES[study], {}
    for name, runs in groups.items():
        for run, s in runs:
            out.setdefault(unit(st, run, s)[0], {}).setdefault(name, []).append((run, s))
    return dict(sorted(out.items()))


def run_measures(s: dict) -> dict:
    """One run's MEASURES in points (None where an accuracy is missing)."""
    def points(a, b=None):
        return None if s[a] is None or (b and s[b] is None) else 100 * (s[a] - (s[b] if b else 0))
    return {"base_acc": points("base_acc"), "peak_acc": points("peak_acc"), "final_acc": points("final_acc"),
            "end_acc": points("end_acc"),
            "gain": points("final_acc", "base_acc"), "drop": points("peak_acc", "final_acc"),
            "dip": None if s.get("dip") is None else 100 * s["dip"]}


def arm_row(st: Study, name: str, runs: list) -> dict:
    """An arm's numbers: each measure as an intervals.Estimate over its units (points), the
    outcomes counted at each drop of SENSITIVITY, per role the mechanism means."""
    row = {"arm": name, "seeds": sorted(unit(st, run, s) for run, s in runs),
           "cliffs": sum(bool(s["cliff"]) for _, s in runs),
           "outcomes": {d: analysis.outcome_counts([analysis.accuracy_summary(run["evals"], d) for run, _ in runs])
                        for d in SENSITIVITY}}
    row["by_seed"] = {unit(st, run, s): run_measures(s) for run, s in runs}
    row["dipped"] = sum(bool(s.get("dipped")) for _, s in runs)
    for m in ("base_acc", "peak_acc", "final_acc", "end_acc", "gain", "drop", "dip"):
        row[m] = intervals.sample([row["by_seed"][k][m] for k in row["seeds"]])
    for key in st.mechanisms:
        for role in st.roles:
            e = intervals.sample([_mechanism(run, s, key, role) for run, s in runs])
            row[f"{key}:{role}"] = e and e.mean
    return row


def contrast(st: Study, rows: dict, a: str, b: str, measure: str = "final_acc"):
    """(how, intervals.Estimate) of arm a minus arm b in a measure (points): paired over the
    units both arms ran where the study's arms share a unit's model, problems and step 0
    (Study.paired), else unpaired (Welch); None when either arm lacks runs."""
    if a not in rows or b not in rows:
        return None
    sa, sb = rows[a]["by_seed"], rows[b]["by_seed"]
    if st.paired:
        e = intervals.paired({k: v[measure] for k, v in sa.items()}, {k: v[measure] for k, v in sb.items()})
        if e is not None:
            return f"paired by {'model and seed' if st.crossed else 'seed'}", e
    e = intervals.welch([v[measure] for v in sa.values()], [v[measure] for v in sb.values()])
    return (None if e is None else ("unpaired", e))


# ----------------------------------------------------------------------------- the page

def _pm(e, digits: int = 1) -> str:
    """A table cell: mean ± standard error from 3 units on; 2 units give no error (n=2). Units
    that all agree give no error either ("all n equal", not "± 0.0"), and an error too small to
    print is written as a bound ("± <0.1")."""
    if e is None:
        return "-"
    if e.se is None or e.n < 3:
        return f"{e.mean:.{digits}f}" + (" (n=2)" if e.n == 2 else " (1 run)" if e.n == 1 else "")
    if e.se == 0:
        return f"{e.mean:.{digits}f} (all {e.n} equal)"
    if round(e.se, digits) == 0:
        return f"{e.mean:.{digits}f} ± <{10 ** -digits:.{digits}f}"
    return f"{e.mean:.{digits}f} ± {e.se:.{digits}f}"


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def table(study: str, rows: dict) -> str:
    """The study's arms as a Markdown table."""
    st = STUDIES[study]
    # a column that is nowhere measured or everywhere 0 (a generator's parse failures) says nothing
    mech = [(k, r) for k in st.mechanisms for r in st.roles if any(row.get(f"{k}:{r}") for row in rows.values())]
    gain = "gain" in st.measures   # the arms start from different toy models: show final minus step 0
    dip = "dip" in st.measures     # long runs: a fall that recovered is not in the outcomes
    head = ["arm", "seeds", "base", "peak", "final"] + ["final - base"] * gain + ["peak - final"] \
        + ["deepest dip", f"dipped {SENSITIVITY[0]:g}+ and recovered"] * dip \
        + [f"cliff/collapse/flat, D={d:g}" for d in SENSITIVITY] + [f"{k} {r}" for k, r in mech]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in [a for a in st.order if a in rows] + sorted(set(rows) - set(st.order)):
        row = rows[name]
        cells = [name, _seeds_cell(row["seeds"]), _pm(row["base_acc"]), _pm(row["peak_acc"]), _pm(row["final_acc"])] \
            + [_pm(row["gain"])] * gain + [_pm(row["drop"])] \
            + [_pm(row["dip"]), f"{row['dipped']} of {len(row['seeds'])}"] * dip \
            + [analysis.outcome_text(row["outcomes"][d], short=True) for d in SENSITIVITY] \
            + [_num(row[f"{k}:{r}"]) for k, r in mech]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seeds_cell(units: list) -> str:
    """0,1,2; or, for (model, seed) units, each model's seeds: m0: 0,1,2; m1: 0,1."""
    if not units or not isinstance(units[0], tuple):
        return ",".join(map(str, units))
    models = dict.fromkeys(m for m, _ in units)
    return "; ".join(f"m{m}: " + ",".join(str(s) for n, s in units if n == m) for m in models)


def model_lines(study: str, groups: dict, a: str, b: str, measure: str) -> list:
    """A crossed study's contrast model by model (paired by seed where it can be), then across
    models: the mean of the per-model effects with each model's own error carried through
    (intervals.across), and whether every model's effect has the sign of that mean."""
    st, per = STUDIES[study], []
    for m, g in by_model(study, groups).items():
        rows = {name: arm_row(st, name, runs) for name, runs in g.items()}
        c = contrast(replace(st, crossed=False), rows, a, b, measure)
        if c is not None:
            per.append((m, c[1]))
    if not per:
        return []
    out = ["  - per toy model: " + "; ".join(f"m{m} {e.text()}" for m, e in per)]
    if len(per) > 1:
        e = intervals.across([e for _, e in per])
        mean = sum(x.mean for _, x in per) / len(per)
        same = all((x.mean > 0) == (mean > 0) and x.mean != 0 for _, x in per)
        what = (f"{e.text()}: {e.verdict()}" if e else f"{mean:+.1f} (a model with one unit has no error of its "
                "own: no interval)")
        out.append(f"  - across toy models (each model weighing the same, its own error carried through): {what}; "
                   f"the sign {'held' if same else 'did not hold'} on every model")
    return out


def contrast_lines(study: str, rows: dict, groups: dict | None = None) -> list:
    """Each contrast in each of its measures (a contrast (a, b, measures) names its own; else the
    study's), then, per measure read in several contrasts, which survive Holm (holm_line)."""
    st, out, family = STUDIES[study], [], {}
    for a, b, *own in st.contrasts:
        for measure in (own[0] if own else st.measures):
            c = contrast(st, rows, a, b, measure)
            if c is None:
                continue
            how, e = c
            out.append(f"- {MEASURES[measure]}, {a} minus {b}, {how}, in points: {e.text()}; {e.verdict()}")
            family.setdefault(measure, []).append((f"{a} minus {b}", e))
            if st.crossed and groups:
                out += model_lines(study, groups, a, b, measure)
    return out + [line for measure, es in family.items() if (line := holm_line(measure, es))]


def holm_line(measure: str, family: list) -> str | None:
    """The contrasts of one measure read together: how many exclude 0 each at 95%, and which
    still do at a family-wise 5% (intervals.holm); None for fewer than two with an interval."""
    ps = [e.p() for _, e in family]
    if sum(p is not None for p in ps) < 2:
        return None
    alone = [name for (name, e) in family if e.excludes_zero()]
    kept = [name for (name, _), k in zip(family, intervals.holm(ps)) if k]
    return (f"- read together, the {sum(p is not None for p in ps)} contrasts of {MEASURES[measure]}: "
            f"{len(alone)} exclude 0 each at 95%; at a family-wise 5% (Holm) {len(kept)} do"
            + (f" ({'; '.join(kept)})" if kept else ""))


def report_text(study: str) -> str:
    """The study's block of docs/RESULTS.md, from its kept runs alone."""
    st = STUDIES[study]
    groups = arms(study)
    if not groups:
        return "\n".join([f"No runs kept yet in results/{study}/.", *(["", *base] if (base := base_rate_lines(study)) else [])])
    rows = {name: arm_row(st, name, runs) for name, runs in groups.items()}
    origins = sorted({origin(run["config"], study) for runs in groups.values() for run, _ in runs}, key=str)
    by = f" ({st.model_by} {{}})" if st.model_by else ""
    shipped = shipped_models()
    scales = sorted({run["config"].get("scale") or "toy" for runs in groups.values() for run, _ in runs})
    if scales == ["toy"]:
        model, where = "toy model", lambda sha: (f", shipped as toy_models/{shipped[sha]}" if sha in shipped
                                                 else ", not shipped")
    else:   # a real model: named by its scale; the toy models' manifest does not hold it
        model, where = f"model ({', '.join(scales)})", lambda sha: ""
    code = "; ".join(f"commit {(o[0] or '?')[:7]}{' (dirty)' if o[1] else ''} and {model} {(o[2] or '?')[:12]}"
                     + by.format(*o[3:]) + where(o[2]) for o in origins)
    mine = os.path.join(RESULTS, study) + os.sep
    n = sum(run["folder"].startswith(mine) for r in groups.values() for run, _ in r)
    lent = sum(len(r) for r in groups.values()) - n
    borrowed = f" and {lent} of results/{st.borrows}/ (the arms they share)" if st.borrows else ""
    parts = [f"{n} run{'s' if n != 1 else ''} in results/{study}/{borrowed}, from {code}. "
             "Accuracy in % (base: at step 0; peak: the best evaluation; final: the last one), mean ± standard "
             "error over seeds (two seeds: no error, n=2); outcomes: terminal "
             "cliffs / early collapses / runs that did not learn, of n, at two drops D (analysis.OUTCOME_RULE, "
             f"a learned peak {analysis.LEARN_MARGIN:g} points above step 0); contrasts: mean, standard error and "
             "t-based 95% interval, paired where the arms share a unit (intervals.py)" + _glossary(st) + ".",
             "", table(study, rows), "", *contrast_lines(study, rows, groups)]
    if st.gains:
        parts += ["", *gain_lines(study, rows)]
    if st.signatures:
        parts += ["", signature_table(study, groups)]
    if "own_change" in st.mechanisms:
        parts += ["", roles_table(study, groups)]
    skill = skill_lines(study, groups)
    if skill:
        parts += ["", *skill]
    base = base_rate_lines(study)
    if base:
        parts += ["", *base]
    return "\n".join(parts).rstrip()


MECHANISM_TEXT = {   # what a block's header says of each mechanism column it shows, in this order
    "displacement": "displacement: the adapter's move per training step",
    "len": "len: tokens a call of the role wrote in the training rollouts of the last tenth of the steps",
    "parse_fail": "parse_fail: at the last evaluation",
    "share": "share: of the step's gradient mass",
    "move_cos": "move_cos: cosine between the role's descent direction and the shared adapter's move, whose "
                "displacement is shown once, under the first role",
    "paid_apart": "paid_apart: the share of the role's calls paid a reward other than their episode's",
    "damp_scale": "damp_scale: the factor coherence damping put on the role's gradient (damping.py), over the steps",
    "len0": "len0: as len, over the first tenth of the steps",
    "step_s": "step_s: median wall seconds of a training step, under the first role",
    "own_change": "own_change: the run's end minus its untrained model, in points, of the generator's own "
                  "accuracy (one voter) and of the aggregator's selection accuracy (right picks when some voter "
                  "is right)",
}


def _glossary(st) -> str:
    """The header's words on the block's mechanism columns (and the deepest dip, if it is a measure)."""
    said = [text for name, text in MECHANISM_TEXT.items() if name in st.mechanisms]
    if "dip" in st.measures:
        said.append("deepest dip: " + analysis.DIP_RULE + f" (D = {SENSITIVITY[0]:g})")
    return "; mechanisms: means over seeds (" + "; ".join(said) + ")" if said else ""


def base_rate_lines(study: str) -> list:
    """The untrained model's evaluations kept in results/STUDY/base/ (eval.py --json outputs,
    one file each: the task's own instruction, or another given with --instruction): pass@1
    over problems x samples, the share cut at the cap and the accuracy among the uncut."""
    folder = os.path.join(RESULTS, study, "base")
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name)) as f:
            r = json.load(f)
        n, cut = r["episodes"], r["cut"]
        uncut = cut["uncut_correct"] / (n - cut["graded_cut"]) if n > cut["graded_cut"] else None
        said = (f"the instruction {r['instruction']!r}" if r.get("instruction") else "the task's own instruction")
        length = r["quality"]["roles"]["generator"]["len_tokens"]
        out.append(f"- base rate, {r['workflow']} under {said} ({name}): {100 * r['pass@k']['1']:.1f}% of "
                   f"{r['problems']} problems x {r['samples']} samples, T = {r['temperature']}, at most "
                   f"{r['max_new_tokens']} new tokens; {100 * cut['graded_cut'] / n:.1f}% cut at that cap, "
                   f"{'-' if uncut is None else f'{100 * uncut:.1f}'}% right among the uncut; "
                   f"{length:.1f} tokens on average")
    return out


def _skill_at(run: dict, where: int) -> dict:
    """analysis.eval_rates of the run's first (where=0) or last (-1) evaluation, in points."""
    rates = analysis.eval_rates(run["evals"][where]) if run["evals"] else {}
    return {k: None if v is None else 100 * v for k, v in rates.items() if not isinstance(v, dict)}


# each supervisor's skill, by the measure a run that logged it has (analysis.eval_rates)
SKILL_OF = {"aggregator": "picked", "evaluator": "verdicts"}


def skill_lines(study: str, groups: dict) -> list:
    """The supervisors' skill per arm with an aggregator or an evaluator, at the untrained
    workflow (step 0) and at the end (the last evaluation): the aggregator's right picks against
    a uniformly random pick among the same voters (chance) and against the majority vote, with
    the oracle; the shares of the evaluator's calls that gave a verdict and that said Correct,
    over its verdicts their accuracy, false accepts and rejects, and Youden's J = 1 - false
    accept - false reject (0: verdicts independent of the attempt's grade, as by chance), and the
    J of the workflow's gate over every attempt judged, a missing verdict taken as Incorrect
    (analysis.eval_rates' "decision J"). Differences over the arm's runs with their interval;
    kept runs whose evaluations did not log it are "not logged"."""
    st, out = STUDIES[study], []
    for name in [a for a in st.order if a in groups] + sorted(set(groups) - set(st.order)):
        runs = [run for run, _ in groups[name]]
        roles = {r for run in runs for r in workflows_roles(run["config"])}
        for who in [w for w in SKILL_OF if w in roles]:
            logged = [run for run in runs if _skill_at(run, -1).get(SKILL_OF[who]) is not None]
            if not logged:
                out.append(f"- the {who}'s skill, {name}: not logged (its runs' evaluations predate eval.jsonl's `skill`)")
                continue
            for when, where in (("step 0", 0), ("the last evaluation", -1)):
                out.append(f"- the {who}'s skill, {name}, {when}: " + _skill_text(who, [_skill_at(r, where) for r in logged]))
    return out


def workflows_roles(cfg: dict) -> tuple:
    """The roles of a run's workflow (this checkout's registry; none for a workflow it lacks)."""
    return workflows.ROLES.get(cfg.get("workflow"), ())


def _skill_text(who: str, per_run: list) -> str:
    def mean(k):
        e = intervals.sample([x[k] for x in per_run if x.get(k) is not None])
        return "-" if e is None else f"{e.mean:.1f}"
    if who == "aggregator":
        head = (f"picks right {mean('picked')}% (random pick {mean('random')}%, majority {mean('majority')}%, "
                f"oracle {mean('oracle')}%)")
        diffs = [("picked minus random", "chance", [x["picked"] - x["random"] for x in per_run]),
                 ("picked minus majority", "the majority vote", [x["picked"] - x["majority"] for x in per_run])]
    else:
        head = (f"a verdict in {mean('verdicts')}% of its calls, a Correct in {mean('accepts')}%; of the verdicts, "
                f"verdict accuracy {mean('verdict accuracy')}%, false accepts {mean('false accept')}%, "
                f"false rejects {mean('false reject')}%")
        if per_run and all(x.get("accepts") == 0 for x in per_run):
            head += (f" ({'no verdict' if all(x.get('verdicts') == 0 for x in per_run) else 'no Correct'} in any run: "
                     "a missing verdict counts as Incorrect, so every attempt was revised whatever its grade, "
                     "and the workflow's gate is at chance by construction, J = 0)")
        diffs = [("J over its verdicts", "chance", [100 - x["false accept"] - x["false reject"] for x in per_run
                                                    if x.get("false accept") is not None and x.get("false reject") is not None]),
                 ("J of the gate (accept on Correct, else revise)", "chance",
                  [x["decision J"] for x in per_run if x.get("decision J") is not None])]
    parts = []
    for label, against, xs in diffs:
        e = intervals.sample(xs)
        if e is not None:
            parts.append(f"{label} {e.text()}{_against(e, against)}")
    return head + ("; " + "; ".join(parts) if parts else "")


def _against(e, what: str) -> str:
    """A skill's difference read: above or below `what` where its interval excludes 0, else not
    told apart, with the largest difference the interval leaves open; nothing without one."""
    c = e.ci()
    if c is None or e.se == 0:
        return ""
    if e.excludes_zero():
        return f": {'above' if e.mean > 0 else 'below'} {what}"
    return f": not told apart from {what} (up to {max(abs(c[0]), abs(c[1])):.1f} points could hide)"


def gain_lines(study: str, rows: dict) -> list:
    """Each arm's gain over its runs' own step 0 (final and peak), with its interval."""
    st, out = STUDIES[study], []
    for name in [a for a in st.order if a in rows]:
        e = rows[name]["gain"]
        peak = intervals.sample([v["peak_acc"] - v["base_acc"] for v in rows[name]["by_seed"].values()
                                 if v["peak_acc"] is not None and v["base_acc"] is not None])
        out.append(f"- gain over step 0, {name}, in points: final {e.text()}; peak {peak.text()}")
    return out


def signature_table(study: str, groups: dict, shown: int = 3) -> str:
    """Each run that fell: its outcome and fall step, and the first `shown` role signals that
    left where they stood up to the peak (analysis.failure_signature), earliest first."""
    st = STUDIES[study]
    lines = ["| arm | seed | outcome | peak -> fall step | first changes (step: role signal before -> after) |",
             "|---|---|---|---|---|"]
    for name in [a for a in st.order if a in groups]:
        for run, s in sorted(groups[name], key=lambda x: str(unit(st, *x))):
            if not (s.get("fell") or s.get("dipped")):
                continue
            sig = "; ".join(f"{t}: {r} {k} {a:.3g} -> {b:.3g}" for t, r, k, a, b in s["signature"][:shown]) or "none"
            what, steps = (s["outcome"], f"{s['peak_step']} -> {s['fall_step']}") if s.get("fell") else (
                f"{s['outcome']}; dipped {100 * s['dip']:.1f} points and recovered", f"{s['dip_from']} -> {s['dip_step']}")
            lines.append(f"| {name} | {unit(st, run, s)} | {what} | {steps} | {sig} |")
    return "\n".join(lines) if len(lines) > 2 else "No run fell or dipped."


def roles_table(study: str, groups: dict) -> str:
    """Each run evaluated role by role (ROLES): the run's accuracy, the generator's own and the
    aggregator's selection accuracy, untrained -> end, in %."""
    st = STUDIES[study]
    lines = ["| arm | unit | run: step 0 -> end | generator alone | selection (oracle at the end) |", "|---|---|---|---|---|"]
    for name in [a for a in st.order if a in groups]:
        for run, s in sorted(groups[name], key=lambda x: str(unit(st, *x))):
            r = run.get("roles")
            if not r:
                continue
            many = f"{r['voters']} voters"
            pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
            lines.append(f"| {name} | {unit(st, run, s)} | {pct(s['base_acc'])} -> {pct(s['final_acc'])} | "
                         f"{pct(r['start']['one voter']['acc'])} -> {pct(r['end']['one voter']['acc'])} | "
                         f"{pct(r['start'][many]['selection_acc'])} -> {pct(r['end'][many]['selection_acc'])} "
                         f"({pct(r['end'][many]['oracle_rate'])}) |")
    if len(lines) == 2:
        return "No run has been evaluated role by role yet (studies.py roles)."
    return "\n".join(lines + [""] + role_lines(study, groups))


def role_lines(study: str, groups: dict) -> list:
    """Per arm, each role's end minus its untrained model (role_change) over the arm's runs
    evaluated role by role: the mean with its interval, and on how many runs it fell."""
    st, out = STUDIES[study], []
    for name in [a for a in st.order if a in groups]:
        for role, what in (("generator", "the generator alone"), ("aggregator", "the aggregator's selection")):
            xs = [x for x in (role_change(run.get("roles"), role) for run, _ in groups[name]) if x is not None]
            if xs:
                out.append(f"- {what}, {name}, end minus untrained, in points: {intervals.sample(xs).text()}; "
                           f"lower on {sum(x < 0 for x in xs)} of {len(xs)} runs")
        rs = [run["roles"] for run, _ in groups[name] if run.get("roles")]
        if rs:   # a random pick among the voters is right with one voter's accuracy: chance
            over = {w: intervals.sample([100 * (r[w][f"{r['voters']} voters"]["acc"] - r[w]["one voter"]["acc"])
                                         for r in rs]) for w in ("start", "end")}
            out.append(f"- the aggregator over a random pick (the run's voters' accuracy minus one voter's), {name}, "
                       f"in points: untrained {over['start'].text()}; end {over['end'].text()}")
    return out


def write_block(study: str, text: str, page: str = PAGE) -> None:
    """Replace the study's block in the page (between its markers), or append one."""
    start, end = f"<!-- study {study} -->", f"<!-- end {study} -->"
    body = open(page).read() if os.path.isfile(page) else ""
    block = f"{start}\n{text}\n{end}"
    if start in body:
        body = body[:body.index(start)] + block + body[body.index(end) + len(end):]
    else:
        body = body.rstrip() + "\n\n" + block + "\n"
    with open(page + ".tmp", "w") as f:
        f.write(body)
    os.replace(page + ".tmp", page)


def read_block(study: str, page: str = PAGE) -> str | None:
    body = open(page).read() if os.path.isfile(page) else ""
    start, end = f"<!-- study {study} -->", f"<!-- end {study} -->"
    if start not in body:
        return None
    return body[body.index(start) + len(start):body.index(end)].strip("\n")


# ----------------------------------------------------------------------------- command line

def run_folders(folder: str) -> list:
    """[folder] if it is a run folder, else the run folders inside it (a sweep's --out, or a
    folder of sweeps), in order."""
    if analysis.is_run_folder(folder) or not os.path.isdir(folder):
        return [folder]
    return [r for n in sorted(os.listdir(folder)) for r in run_folders(os.path.join(folder, n))
            if os.path.isdir(os.path.join(folder, n))]


def main(argv=None):
    p = argparse.ArgumentParser(prog="studies.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("keep", help="copy finished runs' logs into results/STUDY/")
    k.add_argument("study", choices=list(STUDIES))
    k.add_argument("runs", nargs="+", help="run folders, or folders holding them such as a sweep's --out "
                   "(unfinished runs are skipped with a line)")
    rs = sub.add_parser("restore", help="put the kept runs back into a study worktree's runs/, so that "
                        "a sweep rerun there skips them (on a new machine)")
    rs.add_argument("study", choices=list(STUDIES))
    rs.add_argument("worktree", help="the study's git worktree (pinned at the study's commit)")
    ro = sub.add_parser("roles", help="evaluate finished Voting runs' ends role by role with this checkout's "
                        "eval.py (ROLES in each run folder, which keep then keeps)")
    ro.add_argument("runs", nargs="+", help="run folders, or folders holding them; a run with ROLES is skipped")
    ro.add_argument("--problems", type=int, default=256, help="held-out problems per evaluation (default: %(default)s)")
    r = sub.add_parser("report", help="print each study's table and contrasts, from results/ alone")
    r.add_argument("studies", nargs="*", metavar="STUDY", help=f"of {', '.join(STUDIES)} (default: all)")
    r.add_argument("--write", action="store_true", help="also rewrite their blocks in docs/RESULTS.md and figures")
    args = p.parse_args(argv)
    unknown = [x for x in getattr(args, "studies", []) if x not in STUDIES]
    if unknown:
        p.error(f"no study {unknown[0]!r} (studies: {', '.join(STUDIES)})")
    if args.cmd == "keep":
        for run in [r for folder in args.runs for r in run_folders(folder)]:
            try:
                print(f"kept {keep(args.study, run)}")
            except (ValueError, OSError) as e:
                print(f"skipped: {e}", file=sys.stderr)
        return
    if args.cmd == "roles":
        return _roles_cli(args)
    if args.cmd == "restore":
        for folder in restore(args.study, args.worktree):
            print(f"restored {folder}")
        return
    for study in args.studies or list(STUDIES):
        text = report_text(study)
        print(f"## {study}\n\n{text}\n")
        if args.write:
            write_block(study, text)
            figure = write_figure(study)
            if figure:
                print(f"figure: {figure}")


def _roles_cli(args) -> None:
    cache = {}
    for run in [r for folder in args.runs for r in run_folders(folder)]:
        why = ("has " + ROLES if os.path.isfile(os.path.join(run, ROLES)) else
               "not finished (no `done`): its ckpt-last is not its end" if not os.path.isfile(os.path.join(run, "done"))
               else "no ckpt-last" if not os.path.isdir(os.path.join(run, "ckpt-last")) else None)
        if why:
            print(f"skipped {run}: {why}", file=sys.stderr)
            continue
        roles = role_evals(run, args.problems, cache)
        # the end's evaluation with the run's own voters is the run's last eval.jsonl line, draw for
        # draw (the same checkpoint, problems, seed and stream): a difference means other code
        last = analysis.load_run(run, quiet=True)["evals"][-1]["acc"]
        got = roles["end"][f"{roles['voters']} voters" if roles["voters"] > 1 else "one voter"]["acc"]
        if got != last:
            print(f"skipped {run}: its end evaluates to {got} here, its eval.jsonl says {last}", file=sys.stderr)
            continue
        with open(os.path.join(run, ROLES + ".tmp"), "w") as f:
            json.dump(roles, f, indent=1)
        os.replace(os.path.join(run, ROLES + ".tmp"), os.path.join(run, ROLES))
        print(f"{run}: generator alone {100 * roles['start']['one voter']['acc']:.1f} -> "
              f"{100 * roles['end']['one voter']['acc']:.1f}", flush=True)


def figure_values(study: str) -> tuple:
    """(arms in the study's order, {panel label: {arm: [one value per seed]}}): final accuracy
    in %, then the study's other measures in points (its gain, its drop; the peak where it has
    none), and the study's mechanism panel where its runs log it."""
    groups, st = arms(study), STUDIES[study]
    names = [a for a in st.order if a in groups] + sorted(set(groups) - set(st.order))

    def per_seed(value):
        return {a: [v for v in (value(run, s) for run, s in groups[a]) if v is not None] for a in names}

    labels = {"final_acc": "final accuracy (%)", "end_acc": "end accuracy (%)", "gain": "final - step 0 (points)",
              "drop": "peak - final (points)", "peak_acc": "peak accuracy (%)", "dip": "deepest dip (points)"}
    shown = ["final_acc"] + ([m for m in st.measures if m != "final_acc"] or ["peak_acc"])
    values = {labels[m]: per_seed(lambda run, s, m=m: run_measures(s)[m]) for m in shown}
    if st.panel:
        key, roles, label = st.panel
        mech = per_seed(lambda run, s: next((v for v in (_mechanism(run, s, key, r) for r in roles) if v is not None), None))
        if any(mech.values()):
            values[label] = mech
    return names, values


def curve_values(study: str) -> dict:
    """{workflow: [(sharing + seed label, [(step, accuracy %)])]}: every run's evaluations."""
    out = {}
    for name, runs in arms(study).items():
        for run, s in runs:
            wf, _, sharing = name.partition(", ")
            pts = [(r["step"], 100 * r["acc"]) for r in run["evals"]]
            out.setdefault(wf, []).append((f"{sharing or 'single'} seed {s['seed']}", pts))
    order = {a.partition(", ")[0]: i for i, a in enumerate(STUDIES[study].order)}
    return {wf: sorted(out[wf]) for wf in sorted(out, key=lambda w: order.get(w, len(order)))}


def write_figure(study: str) -> str | None:
    """docs/figures/study-STUDY.png: figure_values's panels, each seed a dot, mean ± se a bar; and
    for a study with a curve (Study.curve) a second figure: study-STUDY-curves.png, every run's
    accuracy by workflow ("runs"), or study-STUDY-curve.png, each arm's held-out accuracy and
    training reward by step, its mean over seeds with their range ("arms")."""
    names, values = figure_values(study)
    if not names:
        return None
    import plots
    os.makedirs(FIGURES, exist_ok=True)
    st = STUDIES[study]
    if st.curve == "runs":
        plots.plot_curves(st.title + ": every run", curve_values(study), os.path.join(FIGURES, f"study-{study}-curves.png"))
    elif st.curve == "arms":
        groups = arms(study)
        plots.plot_overlay(st.title, {a: [(s, run) for run, s in groups[a]] for a in names},
                           os.path.join(FIGURES, f"study-{study}-curve.png"))
    return plots.plot_arms(st.title, names, values, os.path.join(FIGURES, f"study-{study}.png"))


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:   # the reader closed the pipe (`| head`): stop quietly, as eval.py does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
