"""Analyse run folders written by train.py: accuracy and the terminal cliff, role-level gradient
dynamics, cells over seeds, and the Markdown report.

    python eval.py --runs runs/matrix/* [--report runs/matrix/report.md] [--json] [--no-plots]
    eval.analyse(folders, report="runs/matrix/report.md")   # from code (sweep.py): this, plots, report

Reading (every file and field of a run folder: docs/RUNFOLDER.md): config.json, metrics.jsonl and
eval.jsonl, record by record. A line that does not parse (a run killed mid-write leaves a torn
last line), or lacks the step (and, in eval.jsonl, the acc) the analysis needs, is skipped with
one warning on stderr naming path:line. A step logged twice (a resumed run) counts once, the
later record winning. Any other key may be missing in a step; missing values are skipped. A run
without a `done` file is unfinished.

- One row per run: base accuracy (the step-0 evaluation, the untrained workflow), peak
  accuracy and its step (the earliest step at the maximum over all evaluations, step 0
  included), final accuracy (last evaluation), gains final - base and peak - base, and the
  run's outcome: a run learned when its peak comes after step 0 and lies at least M points
  above step 0, and fell when its last N evaluations all come after its peak and all lie at
  least D points below it; a terminal cliff is a fall after learning (the cliff step: the first
  evaluation of the final stretch that stays that far below the peak), an early collapse a fall
  without learning; the others did not learn or learned (and held). The paper's cliff is the
  terminal one, a fall from a learned peak. M = LEARN_MARGIN = 10, N = --cliff-window = 2 (one
  low last reading alone is noise as often as not), D = --cliff-drop = 10 (with 256 held-out
  problems one evaluation's standard error is about 3 points).
- Cells: runs that differ only in their seed, keyed by (workflow, task, scale, sharing, lr),
  with the mean, standard deviation (sample; 0 for one seed) and range (min..max) of each
  accuracy and gain, and the outcomes counted apart (terminal cliffs, early collapses, runs that
  did not learn, of n). The task reads TASK:DATA when the data set is not
  the scale's default.
- Mechanisms, from metrics.jsonl:
  * per-role gradient norm: roles[r].grad_norm_opt (mean over the role's optimizer steps of
    the norm of what it added to that step) when the run logged it, else roles[r].grad_norm
    (its contribution summed over the step's mini-batches); the sup/gen ratio is the mean over
    the roles workflows.ROLE_KINDS calls "supervisory" (evaluator, aggregator: they judge
    others' solutions) over the mean over its "solution" roles (generator, worker,
    synthesizer); "planning" roles (the orchestrator) are in neither group;
  * per-role mean gradient-mass share, and the dominant role: the role with the largest
    share in the most steps (a step where no role has any gradient has none, and counts as a
    no-grad step), with that fraction of the steps that have one, its longest streak and the
    role holding it most in the last tenth;
  * slot coherence ||sum_k g_k|| / sum_k ||g_k|| and the mean pairwise cosine of parallel
    same-role slots (1: the slots push the role one way, an amplified gradient); the coherence
    intervention's roles[r].damp_cos and damp_scale when the run logged them;
  * drift between the first and the last tenth of the records (at least one record each):
    per-role length in tokens (metrics.jsonl), code-block and parse-fail rates (eval.jsonl).
- Before a cliff: slot coherence and per-role gradient norm averaged over the training steps
  since the evaluation before the cliff step (or the last --pre-cliff-steps), "just before",
  against the average over every step before those, "earlier".
- Capture, for Shared runs: the dominant role's length, parse-fail and code-block drift.
- The failure signature of a run that fell: each role's length, parser fallback rate and
  gradient share that left where it stood up to the peak (DEPARTS, sustained for SUSTAIN
  steps), earliest first, so that which role changed first can be read beside the fall.

The report (`--report PATH`): the map, the cell table (with min..max), Shared against Isolated,
before the cliff, capture under Shared, the mechanism table and per-cell figures, and the run
table with links to each run's plots. The figures are plots.py's: each run's into its folder,
the cross-run ones into STEM-figures/ next to a report at STEM.md. This module draws nothing
and imports neither plots.py nor eval.py (plots.py reads runs through it); eval.analyse runs
the three steps, summaries, figures (skipped with one line when matplotlib is missing) and
`write_report`. `--json` prints the summaries, cells and figures.
"""
import gzip
import json
import math
import os
import sys
from collections import defaultdict

import taskkinds  # torch-free: the registry of task kinds
import workflows  # torch-free: the registry of workflows, roles and role kinds

CLIFF_DROP = 10.0      # D: points below the peak that an end must lie to count as a fall
CLIFF_WINDOW = 2       # last evaluations that must all be that far below it
LEARN_MARGIN = 10.0    # M: points above step 0 that a later peak must reach to count as learned
END_EVALS = 3          # evaluations a run's end (end_acc) is the mean of
OUTCOMES = ("terminal cliff", "early collapse", "did not learn", "learned")
OUTCOME_RULE = ("a run learned when its peak comes after step 0 and lies at least M points above step 0, and "
                "fell when its last N evaluations all come after its peak and all lie at least D points below "
                "it; a terminal cliff is a fall after learning (the cliff step: the first evaluation of the final "
                "stretch that stays that far below the peak), an early collapse a fall without learning; the "
                "others did not learn or learned (and held)")
DIP_RULE = ("a run's deepest dip is the largest fall of an evaluation below the best one before it; a run that "
            "dipped at least D points below that running best but did not end there (no fall) collapsed mid-run "
            "and recovered")
TABLE_WIDTH = 120


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ----------------------------------------------------------------------------- reading runs

def _warn(msg: str, quiet: bool = False):
    if not quiet:
        print(f"warning: {msg}", file=sys.stderr)


def is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_jsonl(path: str, required: tuple = (), quiet: bool = False) -> list:
    """Records of a JSONL file; [] if missing. A line that does not parse (a run killed
    mid-write leaves a torn last line) or lacks a numeric `required` field is skipped with
    one warning on stderr naming path:line."""
    if not os.path.isfile(path) and os.path.isfile(path + ".gz"):   # a log kept compressed (studies.py)
        path += ".gz"
    if not os.path.isfile(path):
        return []
    out = []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                _warn(f"{path}:{no}: not valid JSON (a torn line from a killed run?); skipped", quiet)
                continue
            missing = [k for k in required if not (isinstance(rec, dict) and is_num(rec.get(k)))]
            if not isinstance(rec, dict) or missing:
                what = "not a JSON object" if not isinstance(rec, dict) else f"no numeric {', '.join(missing)}"
                needs = f" (the analysis needs {', '.join(required)})" if required else ""
                _warn(f"{path}:{no}: {what}{needs}; skipped", quiet)
                continue
            out.append(rec)
    return out


def read_config(folder: str, quiet: bool = False) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        _warn(f"{path}: not valid JSON ({e.msg}); the run's settings are unknown", quiet)
        return {}
    return cfg if isinstance(cfg, dict) else {}


def load_run(folder: str, quiet: bool = False) -> dict:
    """config, metrics and evaluations of one run folder, each sorted by step, one per step."""
    def by_step(records):
        # a resumed run logs again from its last checkpoint: the later record of a step wins
        last = {r["step"]: r for r in records}
        return [last[s] for s in sorted(last)]

    return {"folder": folder, "config": read_config(folder, quiet),
            "metrics": by_step(read_jsonl(os.path.join(folder, "metrics.jsonl"), ("step",), quiet)),
            "evals": by_step(read_jsonl(os.path.join(folder, "eval.jsonl"), ("step", "acc"), quiet)),
            "finished": os.path.isfile(os.path.join(folder, "done"))}


def is_run_folder(path: str) -> bool:
    """A folder train.py wrote into: metrics.jsonl, eval.jsonl, or a config.json that names a
    workflow (a model folder has a config.json too)."""
    if not os.path.isdir(path):
        return False
    if any(os.path.isfile(os.path.join(path, f)) for f in ("metrics.jsonl", "eval.jsonl", "metrics.jsonl.gz")):
        return True
    return "workflow" in read_config(path, quiet=True)


def run_folders(paths: list) -> tuple:
    """(the run folders among `paths`, one note per other path saying why it was skipped)."""
    folders, notes = [], []
    for p in paths:
        if is_run_folder(p):
            folders.append(p)
        elif os.path.isdir(p) and any(is_run_folder(os.path.join(p, d)) for d in os.listdir(p)):
            notes.append(f"{p} holds run folders but is not one: pass {os.path.join(p, '*')}")
        elif os.path.isdir(p):
            notes.append(f"{p} is not a run folder (no metrics.jsonl, eval.jsonl or run config.json)")
        else:
            notes.append(f"{p} is not a run folder ({'a file' if os.path.exists(p) else 'no such folder'})")
    return folders, notes


# ----------------------------------------------------------------------------- roles

def role_kind(role: str) -> str | None:
    """"solution", "supervisory" or "planning" (workflows.ROLE_KINDS); None for an unknown role."""
    return workflows.ROLE_KINDS.get(role)


def _abbrev(role: str) -> str:
    return role[:3]  # as the step line: gen, agg, eva, orc, wor, syn


# ----------------------------------------------------------------------------- accuracy and cliffs

def _cliff_start(accs: list, peak_i: int, line: float) -> int:
    """Index where the final stretch of accuracies at or below `line` begins (after the peak)."""
    i = len(accs)
    while i > peak_i + 1 and accs[i - 1] <= line:
        i -= 1
    return i


def accuracy_summary(evals: list, cliff_drop: float = CLIFF_DROP, cliff_window: int = CLIFF_WINDOW,
                     learn_margin: float = LEARN_MARGIN) -> dict:
    """Base, peak, final accuracy, gains and the run's outcome (OUTCOME_RULE).

    `evals` are eval.jsonl records sorted by step; `cliff_drop` and `learn_margin` are in
    percentage points. tail_mean is the mean of the last `cliff_window` evaluations, end_acc of
    the last END_EVALS (a run's end read off more than one noisy evaluation). `cliff` is
    a terminal cliff, `collapse` an early collapse; `fall_step` is where either's final stretch
    begins, `cliff_step` the same for a terminal cliff only."""
    pts = [(r["step"], float(r["acc"])) for r in evals if is_num(r.get("acc"))]
    out = {"n_evals": len(pts), "base_acc": None, "peak_acc": None, "peak_step": None,
           "final_acc": None, "final_step": None, "gain_final": None, "gain_peak": None,
           "tail_mean": None, "end_acc": None, "cliff_line": None, "learned": False, "fell": False, "outcome": None,
           "cliff": False, "collapse": False, "cliff_step": None, "fall_step": None,
           "dip": None, "dip_from": None, "dip_step": None, "dipped": False}
    if not pts:
        return out
    accs = [a for _, a in pts]
    base = next((a for s, a in pts if s == 0), None)
    peak_i = max(range(len(pts)), key=lambda i: (accs[i], -i))  # earliest index at the max
    out.update(base_acc=base, peak_acc=accs[peak_i], peak_step=pts[peak_i][0],
               final_acc=accs[-1], final_step=pts[-1][0])
    if base is not None:
        out.update(gain_final=accs[-1] - base, gain_peak=accs[peak_i] - base)
    w = min(cliff_window, len(pts))
    out["tail_mean"] = sum(accs[-w:]) / w
    out["end_acc"] = sum(accs[-END_EVALS:]) / len(accs[-END_EVALS:])
    out["cliff_line"] = accs[peak_i] - cliff_drop / 100.0
    # 1e-9: 0.5 - 0.4 is 0.0999..., which must count as a drop of 10 points
    start = _cliff_start(accs, peak_i, out["cliff_line"] + 1e-9)
    fell = len(accs) - start >= cliff_window
    learned = base is not None and pts[peak_i][0] > 0 and accs[peak_i] - base >= learn_margin / 100.0 - 1e-9
    outcome = OUTCOMES[0] if learned and fell else OUTCOMES[1] if fell else OUTCOMES[3] if learned else OUTCOMES[2]
    out.update(learned=learned, fell=fell, outcome=outcome, cliff=learned and fell, collapse=fell and not learned,
               fall_step=pts[start][0] if fell else None, cliff_step=pts[start][0] if learned and fell else None)
    best, dip = 0, (0.0, pts[0][0], pts[0][0])   # (depth, running best's step, trough's step): DIP_RULE
    for i, (t, a) in enumerate(pts):
        if a > accs[best]:
            best = i
        elif accs[best] - a > dip[0]:
            dip = (accs[best] - a, pts[best][0], t)
    out.update(dip=dip[0], dip_from=dip[1], dip_step=dip[2],
               # a trough at the last evaluation has not recovered: one low reading, below the fall's window
               dipped=not fell and dip[0] >= cliff_drop / 100.0 - 1e-9 and dip[2] != pts[-1][0])
    return out


def outcome_counts(summaries: list) -> dict:
    """{outcome: runs} for every outcome in OUTCOMES (0 where none)."""
    return {o: sum(s.get("outcome") == o for s in summaries) for o in OUTCOMES}


def outcome_text(counts: dict, n: int | None = None, short: bool = False) -> str:
    """'1 cliff, 2 collapse, 0 flat of 7' (short: '1/2/0 of 7'): terminal cliffs, early
    collapses, runs that did not learn."""
    n = sum(counts.values()) if n is None else n
    c, x, f = counts["terminal cliff"], counts["early collapse"], counts["did not learn"]
    return f"{c}/{x}/{f} of {n}" if short else f"{c} cliff, {x} collapse, {f} flat of {n}"


# ----------------------------------------------------------------------------- mechanisms

def role_series(metrics: list, key: str) -> dict:
    """{role: [(step, value)]} for metrics[*]["roles"][role][key], skipping missing values."""
    out = defaultdict(list)
    for rec in metrics:
        for role, d in (rec.get("roles") or {}).items():
            v = d.get(key) if isinstance(d, dict) else None
            if is_num(v):
                out[role].append((rec["step"], float(v)))
    return dict(out)


def keyed_series(records: list, key: str) -> dict:
    """{role: [(step, value)]} for records[*][key][role] (coherence; eval.jsonl's per-role rates)."""
    out = defaultdict(list)
    for rec in records:
        d = rec.get(key)
        for role, v in (d.items() if isinstance(d, dict) else ()):
            if is_num(v):
                out[role].append((rec["step"], float(v)))
    return dict(out)


def _ratio(a, b):
    return a / b if is_num(a) and is_num(b) and b else None


def eval_rates(rec: dict) -> dict:
    """The rates behind one evaluation's counts (eval.jsonl's cut, graded_cut, uncut_correct and
    skill; each None where the record does not log it, as in runs made before they were logged):
    - cut: {role: share of its calls cut at the length cap}; uncut_acc: accuracy among the
      episodes whose graded answer the cap left whole;
    - the aggregator's picks ("picked": its pick right), against a uniformly random pick among
      the same candidates ("random"), the majority vote by the task's key ("majority") and the
      oracle, some candidate right ("oracle");
    - the evaluator's verdicts against the grade of the attempt each judged: "verdict accuracy",
      "false accept" (Correct on a wrong attempt, of the wrong ones), "false reject" (Incorrect
      on a right one, of the right ones), over the calls that gave a verdict; "verdicts", the
      share of its calls that gave one (a missing verdict counts as Incorrect in the workflow);
      "accepts", the share of its calls that said Correct, and "decision J", Youden's J of the
      workflow's gate (accept on Correct, revise otherwise) over every attempt judged, from -1
      to 1: 0 for a gate that ignores the grade (None where the record lacks the attempts'
      grades, or all were right or all wrong)."""
    calls, a, e = rec.get("calls") or {}, (rec.get("skill") or {}).get("aggregator"), (rec.get("skill") or {}).get("evaluator")
    cut = rec.get("cut")
    out = {"cut": {r: _ratio((cut or {}).get(r, 0), c) for r, c in calls.items()} if isinstance(cut, dict) else None,
           "uncut_acc": _ratio(rec.get("uncut_correct"), (rec.get("n") or 0) - (rec.get("graded_cut") or 0))
           if "uncut_correct" in rec else None}
    a = a or {}
    out.update({"picked": _ratio(a.get("picked"), a.get("resolved")), "random": _ratio(a.get("right_candidates"),
                a.get("candidates")), "majority": _ratio(a.get("majority"), a.get("resolved")),
                "oracle": _ratio(a.get("with_correct"), a.get("resolved"))})
    e = e or {}
    tp, fp, fn, tn = (e.get(k) for k in ("tp", "fp", "fn", "tn"))
    out.update({"verdict accuracy": _ratio((tp or 0) + (tn or 0), sum(x or 0 for x in (tp, fp, fn, tn))) if e else None,
                "false accept": _ratio(fp, (fp or 0) + (tn or 0)) if e else None,
                "false reject": _ratio(fn, (fn or 0) + (tp or 0)) if e else None,
                "verdicts": _ratio(sum(x or 0 for x in (tp, fp, fn, tn)), e.get("calls")) if e else None,
                "accepts": _ratio((tp or 0) + (fp or 0), e.get("calls")) if e else None,
                "decision J": _decision_j(e)})
    return out


def _decision_j(e: dict):
    """tp / right - fp / wrong over the attempts an evaluator judged (eval.jsonl's `judged`,
    `right`); None where they are not logged or one kind is missing."""
    right, judged = e.get("right"), e.get("judged")
    if not right or not judged or judged <= right:
        return None
    return (e.get("tp") or 0) / right - (e.get("fp") or 0) / (judged - right)


SKILL = {"aggregator": ("picked", "random", "majority", "oracle"),
         "evaluator": ("verdicts", "accepts", "verdict accuracy", "false accept", "false reject")}


def skill_series(evals: list) -> dict:
    """{"aggregator" | "evaluator": {measure: [(step, rate)]}} over a run's evaluations (eval_rates);
    a supervisor absent, or not logged, has no entry."""
    out = {}
    for who, keys in SKILL.items():
        series = {k: [(r["step"], v) for r in evals if (v := eval_rates(r)[k]) is not None] for k in keys}
        if any(series.values()):
            out[who] = {k: v for k, v in series.items() if v}
    return out


def cut_series(evals: list) -> dict:
    """{role: [(step, share of its calls cut at the length cap)]} where the evaluations log it."""
    out = defaultdict(list)
    for rec in evals:
        for role, v in (eval_rates(rec)["cut"] or {}).items():
            if v is not None:
                out[role].append((rec["step"], v))
    return dict(out)


def _slot_cos_series(metrics: list) -> dict:
    """{role: [(step, mean pairwise cosine of its slots)]}."""
    out = defaultdict(list)
    for rec in metrics:
        for role, pairs in (rec.get("slot_cos") or {}).items():
            vals = [float(v) for v in (pairs or {}).values() if is_num(v)]
            if vals:
                out[role].append((rec["step"], sum(vals) / len(vals)))
    return dict(out)


def grad_key(metrics: list) -> str:
    """grad_norm_opt (per optimizer step) when the run logged it, else grad_norm (per step)."""
    return "grad_norm_opt" if role_series(metrics, "grad_norm_opt") else "grad_norm"


def _means(series: dict) -> dict:
    return {r: _mean([v for _, v in s]) for r, s in series.items()}


def _tenths(values: list):
    """(mean of the first tenth, mean of the last tenth), at least one value each."""
    if not values:
        return None
    k = max(1, len(values) // 10)
    return (sum(values[:k]) / k, sum(values[-k:]) / k)


def _drifts(series: dict) -> dict:
    return {r: _tenths([v for _, v in s]) for r, s in series.items() if s}


def _longest_streak(seq: list, item) -> int:
    best = cur = 0
    for x in seq:
        cur = cur + 1 if x == item else 0
        best = max(best, cur)
    return best


def _shares(rec: dict) -> dict:
    shares = {r: v.get("grad_share") for r, v in (rec.get("roles") or {}).items() if isinstance(v, dict)}
    return {r: s for r, s in shares.items() if is_num(s)}


def _no_gradient(rec: dict) -> bool:
    """Every role's share is 0 (e.g. every reward of the step was 0, so every advantage)."""
    shares = _shares(rec)
    return bool(shares) and max(shares.values()) <= 0


def step_dominant(rec: dict) -> str | None:
    """The role with the largest gradient-mass share in one metrics record; None when no role
    has any gradient (every share 0) or no share was logged."""
    shares = _shares(rec)
    if _no_gradient(rec):
        return None
    if rec.get("dominant_role"):
        return rec["dominant_role"]
    return max(shares, key=shares.get) if shares else None


def _most(seq: list):
    return max(sorted(set(seq)), key=seq.count)


def dominance(metrics: list) -> dict:
    """Who holds the largest share: most often, for how long, and in the last tenth."""
    per_step = [step_dominant(rec) for rec in metrics]
    held = [d for d in per_step if d]
    out = {"dominant_role": None, "dominant_frac": None, "dominant_streak": None, "dominant_last": None,
           "dominant_counts": {r: held.count(r) for r in sorted(set(held))},
           "no_grad_steps": sum(_no_gradient(rec) for rec in metrics)}
    if held:
        dom = _most(held)
        out.update(dominant_role=dom, dominant_frac=held.count(dom) / len(held),
                   dominant_streak=_longest_streak(held, dom),
                   dominant_last=_most(held[-max(1, len(held) // 10):]))
    return out


def sup_gen_ratio(norms: dict):
    """Mean norm over "supervisory" roles over the mean over "solution" roles (ROLE_KINDS)."""
    sup = _mean([v for r, v in norms.items() if role_kind(r) == "supervisory"])
    gen = _mean([v for r, v in norms.items() if role_kind(r) == "solution"])
    return sup / gen if sup is not None and gen else None


def mechanisms(metrics: list, evals: list) -> dict:
    """Role-level dynamics of one run (see the module docstring); every field tolerates gaps."""
    key = grad_key(metrics)
    norms = _means(role_series(metrics, key))
    out = {"grad_norm_key": key, "grad_norm": norms, "grad_norm_step": _means(role_series(metrics, "grad_norm")),
           "grad_norm_opt_max": {r: max(v for _, v in s) for r, s in role_series(metrics, "grad_norm_opt_max").items()},
           "grad_share": _means(role_series(metrics, "grad_share")), "grad_ratio_sup_gen": sup_gen_ratio(norms)}
    out.update(dominance(metrics))
    out.update(coherence=_means(keyed_series(metrics, "coherence")), slot_cos=_means(_slot_cos_series(metrics)),
               damp_cos=_means(role_series(metrics, "damp_cos")),
               damp_scale=_means(role_series(metrics, "damp_scale")),
               len_drift=_drifts(role_series(metrics, "len")),
               code_block_drift=_drifts(keyed_series(evals, "code_block_rate")),
               parse_fail_drift=_drifts(keyed_series(evals, "parse_fail")))
    return out


def before_cliff(metrics: list, evals: list, cliff_step, steps: int | None = None) -> dict | None:
    """Slot coherence and per-role gradient norm just before a cliff against earlier.

    "just before" = the training steps after the evaluation that precedes the cliff step, up
    to the cliff step (where accuracy fell), or the last `steps` steps up to it; "earlier" =
    every step before those. Returns {"steps": [first, last] just before, "grad_norm_key",
    "coherence": {role: [earlier, just before]}, "grad_norm": {...}}."""
    if cliff_step is None:
        return None
    prev = [r["step"] for r in evals if r["step"] < cliff_step]
    lo = cliff_step - steps if steps else (max(prev) if prev else 0)
    key = grad_key(metrics)

    def split(series):
        out = {}
        for role, s in series.items():
            out[role] = [_mean([v for t, v in s if t <= lo]), _mean([v for t, v in s if lo < t <= cliff_step])]
        return out
    return {"steps": [lo + 1, cliff_step], "grad_norm_key": key,
            "coherence": split(keyed_series(metrics, "coherence")), "grad_norm": split(role_series(metrics, key))}


# A role's signal departs from where it stood up to the peak when it moves this far and stays
# there for SUSTAIN training steps in a row: length in tokens (and half of itself), the parser's
# fallback rate, the share of the step's gradient mass.
DEPARTS = {"len": lambda base: max(3.0, 0.5 * base), "fallback_rate": lambda base: 0.25, "grad_share": lambda base: 0.2}
SUSTAIN = 3


def _departure(series: list, ref_end: int, far):
    """(step, baseline, value) where `series` [(step, value)] first leaves its mean over the
    steps up to ref_end (the first SUSTAIN values when none is that early) by far(baseline) for
    SUSTAIN steps in a row; None if it never does."""
    ref = [v for t, v in series if t <= ref_end]
    after = [(t, v) for t, v in series if t > ref_end]
    if not ref:
        ref, after = [v for _, v in series[:SUSTAIN]], series[SUSTAIN:]
    if not ref:
        return None
    base, run = sum(ref) / len(ref), 0
    for i, (t, v) in enumerate(after):
        run = run + 1 if abs(v - base) >= far(base) else 0
        if run == SUSTAIN:
            first = after[i - SUSTAIN + 1]
            return first[0], base, first[1]
    return None


def failure_signature(metrics: list, s: dict) -> list:
    """For a run that fell (or dipped and recovered: DIP_RULE): each role's signal (DEPARTS) that
    left where it stood up to the peak (the running best before the dip, and only up to the dip's
    trough: what moved after it cannot have caused it), as (step, role, signal, before, after),
    earliest first; [] for a run that did neither."""
    if not (s.get("fell") or s.get("dipped")):
        return []
    ref_end, events = (s["peak_step"] if s.get("fell") else s["dip_from"]) or 0, []
    for key, far in DEPARTS.items():
        for role, series in role_series(metrics, key).items():
            d = _departure(series, ref_end, far)
            if d is not None and (s.get("fell") or d[0] <= s["dip_step"]):
                events.append((d[0], role, key, d[1], d[2]))
    return sorted(events)


def capture(metrics: list, evals: list, role: str | None) -> dict | None:
    """Drift of one role (the dominant one, under Shared) between the first and last tenth:
    length in tokens (metrics.jsonl), parse-fail and code-block rates (eval.jsonl)."""
    if role is None:
        return None
    pick = lambda series: _tenths([v for _, v in series.get(role, [])])  # noqa: E731
    return {"role": role, "len": pick(role_series(metrics, "len")),
            "parse_fail": pick(keyed_series(evals, "parse_fail")),
            "code_block_rate": pick(keyed_series(evals, "code_block_rate"))}


def _task_label(cfg: dict) -> str | None:
    """The task, with the data set when it is not the scale's default (math:gsm8k_test100)."""
    import tasks
    task, data = cfg.get("task"), cfg.get("data")
    try:
        default = tasks.default_data(cfg.get("scale") or "toy", task)
    except ValueError:   # a task kind this checkout does not register
        default = None
    if data and data not in (task, default):
        return f"{task}:{os.path.basename(data)}"
    return task


def analyse_run(folder: str, cliff_drop: float = CLIFF_DROP, cliff_window: int = CLIFF_WINDOW,
                run: dict | None = None, pre_cliff_steps: int | None = None) -> dict:
    """One run folder (or its `run = load_run(folder)`) -> one summary dict."""
    run = run or load_run(folder)
    cfg = run["config"]
    out = {"run": folder, "name": os.path.basename(os.path.normpath(folder)),
           "finished": run["finished"], "workflow": cfg.get("workflow"), "task": _task_label(cfg),
           "scale": cfg.get("scale"), "sharing": cfg.get("sharing"), "seed": cfg.get("seed"), "lr": cfg.get("lr"),
           "steps_logged": run["metrics"][-1]["step"] if run["metrics"] else 0,
           "steps_planned": cfg.get("steps"), "variant": "", "config": cfg}
    out.update(accuracy_summary(run["evals"], cliff_drop, cliff_window))
    out["mechanisms"] = m = mechanisms(run["metrics"], run["evals"])
    out["pre_cliff"] = before_cliff(run["metrics"], run["evals"], out["cliff_step"], pre_cliff_steps)
    out["capture"] = capture(run["metrics"], run["evals"], m["dominant_role"]) if out["sharing"] == "shared" else None
    out["signature"] = failure_signature(run["metrics"], out)
    out["plots"] = []
    return out


# ----------------------------------------------------------------------------- cells

CELL_KEYS = ("workflow", "task", "scale", "sharing", "lr", "variant")
# flags that do not change what a run computes: runs differing only in these (and the seed)
# are seeds of one cell; any other difference makes another cell (its `variant`)
SAME_RUN = ("seed", "out", "resume", "device", "quiet", "log_to", "kv_budget_gb", "max_rows", "cuda_graphs", "sampler", "samples_every",
            "save_every", "grad_checkpointing")   # checkpointing: the same gradient, bit for bit on a CPU
CELL_CONFIG = ("workflow", "task", "data", "scale", "sharing", "lr")   # in the cell key already


def _flag_value(v) -> str:
    if isinstance(v, dict):
        return ",".join(f"{k}={x:g}" if is_num(x) else f"{k}={x}" for k, x in sorted(v.items())) or "none"
    return "none" if v is None else f"{v:g}" if is_num(v) and not isinstance(v, bool) else str(v)


def _computed(cfg: dict, beside: tuple) -> dict:
    """What a run's configuration says it computed, but for the keys `beside`: its flags, and of
    its provenance the code (commit, "+dirty") and the base model's weights, so runs of other
    code or another toy model never pool; library versions are recorded but not split on."""
    out = {k: v for k, v in cfg.items() if k not in beside + ("provenance", "provenance_resumed")}
    p = cfg.get("provenance")
    if p:
        out["code"] = f"{(p.get('commit') or 'unknown')[:7]}{'+dirty' if p.get('dirty') else ''}"
        out["base_model"] = (p.get("model_sha256") or "unknown")[:8]
    return out


def label_variants(summaries: list) -> list:
    """Set each summary's `variant`: the flags (with this run's values) in which runs of the same
    workflow, task, scale, sharing and lr differ, beyond the seed and SAME_RUN, e.g.
    "kl-coef-role aggregator=0.1"; "" where they differ in nothing. Runs of one cell are then
    exactly the runs whose configurations differ only in the seed."""
    groups = defaultdict(list)
    for s in summaries:
        groups[tuple(s.get(k) for k in CELL_KEYS[:-1])].append(s)
    for group in groups.values():
        cfgs = [_computed(s.get("config") or {}, SAME_RUN + CELL_CONFIG) for s in group]
        keys = sorted(set().union(*cfgs))
        differ = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in cfgs}) > 1]
        for s, c in zip(group, cfgs):
            s["variant"] = ", ".join(f"{k.replace('_', '-')} {_flag_value(c.get(k))}" for k in differ)
    return summaries


CELL_STATS = ("base_acc", "peak_acc", "final_acc", "gain_final", "gain_peak")


def _stats(xs: list) -> dict | None:
    """mean, sd (sample; 0 for one value), min and max of the values that are there."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return {"mean": m, "sd": sd, "min": min(xs), "max": max(xs), "n": len(xs)}


def cell_order(key: tuple) -> tuple:
    """Cells by task, then workflows in registry order, shared before isolated, lr ascending,
    then variant."""
    wf, task, scale, sharing, lr, variant = (*key, "")[:6]
    wfs = list(workflows.WORKFLOWS)
    return (str(task), wfs.index(wf) if wf in wfs else len(wfs), str(wf), str(scale),
            sharing_order(sharing), lr if is_num(lr) else math.inf, str(variant or ""))


def cell_key(s: dict) -> tuple:
    return tuple(s.get(k) or "" if k == "variant" else s.get(k) for k in CELL_KEYS)


def cells(summaries: list) -> list:
    """Runs grouped by (workflow, task, scale, sharing, lr, variant): the seeds of one cell
    (label_variants sets the variant)."""
    groups = defaultdict(list)
    for s in summaries:
        groups[cell_key(s)].append(s)
    out = []
    for key in sorted(groups, key=cell_order):
        ss = groups[key]
        c = dict(zip(CELL_KEYS, key), runs=[s["name"] for s in ss], seeds=[s["seed"] for s in ss],
                 n=len(ss), cliffs=sum(s["cliff"] for s in ss), outcomes=outcome_counts(ss))
        c.update({k: _stats([s[k] for s in ss]) for k in CELL_STATS})
        out.append(c)
    return out


def lr_label(x) -> str:
    """1e-3, 2e-5, 1.5e-3."""
    if not is_num(x):
        return "-"
    mant, exp = f"{x:.2e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def scale_label(scale) -> str:
    """A scale as train.py names runs: a local model folder by its last part."""
    return os.path.basename(os.path.normpath(scale)) if scale else "-"


def sharing_order(sharing) -> int:
    return {"shared": 0, "isolated": 1}.get(sharing, 2)


# ----------------------------------------------------------------------------- dose-response

DOSE_ARMS = "damping"   # the knob of the intervention-against-placebo runs: none, damp or placebo


def dose_value(s: dict, knob: str):
    """A run's value of `knob`: a config key (a workflow parameter such as n_voters, eval_rounds,
    max_workers, or toy_check; a null is the default: the parameter's, the task kind's evaluator
    rounds, no check) or DOSE_ARMS."""
    cfg = s.get("config") or {}
    if knob == DOSE_ARMS:
        return "placebo" if cfg.get("damp_placebo") else "damp" if cfg.get("coherence_damp") else "none"
    kind = taskkinds.TASK_KINDS.get(cfg.get("task"))
    defaults = {"toy_check": 0, **{dest: next(iter(owners.values())).default
                                   for dest, owners in workflows.params_by_dest().items()}}
    defaults["eval_rounds"] = kind.rounds if kind else 3
    v = cfg.get(knob)
    return defaults.get(knob) if v is None else v


def _run_means(s: dict) -> dict:
    """One run's mechanism numbers a dose point averages: per role the per-optimizer-step gradient
    norm and the share; the coherence of the generators' slots; the supervisors' length and
    parse-failure drift (first -> last tenth); the damping scale."""
    m = s["mechanisms"]
    return {"norm": m["grad_norm"], "share": m["grad_share"], "coherence": m["coherence"],
            "len_first": {r: d[0] for r, d in m["len_drift"].items()},
            "len_last": {r: d[1] for r, d in m["len_drift"].items()},
            "parse_fail_last": {r: d[1] for r, d in m.get("parse_fail_drift", {}).items()},
            "damp_scale": m.get("damp_scale", {}), "dominant": m["dominant_role"]}


def _dose_keys(knob: str) -> tuple:
    """Config keys a dose-response varies on purpose: the knob's, the lr and what SAME_RUN holds."""
    return SAME_RUN + ("lr",) + (("coherence_damp", "damp_placebo") if knob == DOSE_ARMS else (knob,))


def _one_per_seed(ss: list) -> list:
    """The runs of one dose point, one per seed: a second run of a seed already there (the same
    run copied, or run twice) is the same draw, so it is left out, with one line."""
    seen, out = set(), []
    for s in ss:
        if s["seed"] in seen:
            print(f"warning: {s['name']} repeats seed {s['seed']}: counted once", file=sys.stderr)
            continue
        seen.add(s["seed"])
        out.append(s)
    return out


def dose(summaries: list, knob: str) -> list:
    """One point per (lr, knob value) over the runs given (seeds): n, peak / final accuracy
    stats, cliffs, and the mean over seeds of each mechanism number of _run_means, per role.
    The runs must differ in nothing else (a ValueError names what else differs)."""
    known = sorted({k for s in summaries for k in (s.get("config") or {})} - set(SAME_RUN + CELL_CONFIG))
    if knob != DOSE_ARMS and knob not in known:
        raise ValueError(f"--dose {knob.replace('_', '-')}: not a setting of these runs (one of "
                         f"{', '.join(k.replace('_', '-') for k in known)}, or {DOSE_ARMS})")
    cfgs = [_computed(s.get("config") or {}, _dose_keys(knob)) for s in summaries]
    differ = sorted(k for k in set().union(*cfgs) if len({json.dumps(c.get(k), sort_keys=True) for c in cfgs}) > 1)
    if differ:
        raise ValueError(f"a dose-response of {knob} takes runs that differ only in it, the lr and the seed; "
                         f"these also differ in {', '.join(differ)}")
    groups = defaultdict(list)
    for s in summaries:
        groups[(s.get("lr"), dose_value(s, knob))].append(s)
    order = ["none", "damp", "placebo"]
    out = []
    for (lr, value), ss in sorted(groups.items(), key=lambda kv: (
            kv[0][0] if is_num(kv[0][0]) else math.inf,
            order.index(kv[0][1]) if kv[0][1] in order else kv[0][1] if is_num(kv[0][1]) else 0)):
        ss = _one_per_seed(ss)
        means = [_run_means(s) for s in ss]
        point = {"lr": lr, "value": value, "n": len(ss), "seeds": [s["seed"] for s in ss],
                 "cliffs": sum(s["cliff"] for s in ss), "outcomes": outcome_counts(ss), "peak": _stats([s["peak_acc"] for s in ss]),
                 "final": _stats([s["final_acc"] for s in ss]), "base": _stats([s["base_acc"] for s in ss]),
                 "dominant": {r: sum(m["dominant"] == r for m in means) for r in sorted({m["dominant"] for m in means
                                                                                        if m["dominant"]})}}
        for key in ("norm", "share", "coherence", "len_first", "len_last", "parse_fail_last", "damp_scale"):
            roles = sorted({r for m in means for r in m[key]})
            point[key] = {r: _stats([m[key][r] for m in means if m[key].get(r) is not None]) for r in roles}
        out.append(point)
    return out


DOSE_HEADERS = ["lr", "value", "seeds", "base", "peak", "final", "outcomes", "norm/opt step", "coherence",
                "share", "len first->last", "dominant"]


def _role_stats(d: dict, fmt=".3g", short=True) -> str:
    return " ".join(f"{_abbrev(r) if short else r} {format(st['mean'], fmt)}" for r, st in d.items() if st) or "-"


def dose_rows(points: list) -> list:
    """The dose table (DOSE_HEADERS): accuracy in %, mean ±sd over seeds; mechanisms as means."""
    rows = []
    for p in points:
        lens = " ".join(f"{_abbrev(r)} {p['len_first'][r]['mean']:.1f}->{p['len_last'][r]['mean']:.1f}"
                        for r in p["len_first"] if p["len_first"][r] and p["len_last"].get(r))
        rows.append([lr_label(p["lr"]), str(p["value"]), str(p["n"]), _stat(p["base"]), _stat(p["peak"]),
                     _stat(p["final"]), outcome_text(p["outcomes"], p["n"]), _role_stats(p["norm"]),
                     _role_stats(p["coherence"], ".2f"), _role_stats(p["share"], ".2f"), lens or "-",
                     " ".join(f"{_abbrev(r)} {k}" for r, k in p["dominant"].items()) or "-"])
    return rows


def dose_slope(points: list, lr, role: str, key: str = "norm"):
    """The exponent b of key[role] ~ value^b over one lr's numeric points (least squares in
    log-log), or None with fewer than two positive points."""
    xy = [(math.log(p["value"]), math.log(p[key][role]["mean"])) for p in points
          if p["lr"] == lr and is_num(p["value"]) and p["value"] > 0 and p[key].get(role) and p[key][role]["mean"] > 0]
    if len(xy) < 2:
        return None
    mx, my = sum(x for x, _ in xy) / len(xy), sum(y for _, y in xy) / len(xy)
    sxx = sum((x - mx) ** 2 for x, _ in xy)
    return sum((x - mx) * (y - my) for x, y in xy) / sxx if sxx else None


# ----------------------------------------------------------------------------- tables

def _pct(x, sign=False):
    if x is None:
        return "-"
    return f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}"


def _num(x, fmt=".3g", none="-"):
    return none if x is None else format(x, fmt)


def _per_role(d: dict, fmt=".3g", short=False) -> str:
    return ", ".join(f"{_abbrev(r) if short else r} {_num(v, fmt)}" for r, v in sorted(d.items())
                     if v is not None) or "-"


def _drift(d: dict, fmt=".3g") -> str:
    return ", ".join(f"{r} {_num(a, fmt, 'n/a')}->{_num(b, fmt, 'n/a')}" for r, (a, b) in sorted(d.items())) or "-"


def _pair(p, fmt=".3g") -> str:
    return "-" if not p else f"{_num(p[0], fmt, 'n/a')}->{_num(p[1], fmt, 'n/a')}"


def _cliff_cell(s: dict) -> str:
    """CLIFF@step (terminal), collapse@step (early), or the outcome without a fall."""
    if s["cliff"]:
        return f"CLIFF@{s['cliff_step']}"
    if s.get("collapse"):
        return f"collapse@{s['fall_step']}"
    return {"did not learn": "flat", "learned": "no"}.get(s.get("outcome"), "-")


def _status(s: dict) -> str:
    return "done" if s["finished"] else f"unfinished ({s['steps_logged']}/{s['steps_planned'] or '?'})"


RUN_HEADERS = ["run", "cell", "status", "base", "peak", "@step", "final", "fin-base", "peak-base", "outcome"]


def run_legend(cliff_drop: float = CLIFF_DROP, cliff_window: int = CLIFF_WINDOW) -> str:
    return (f"accuracy %; base = step 0; peak = earliest max (@step); a fall: last {cliff_window} evals all "
            f">= {cliff_drop:g} pts below peak\nCLIFF@step: a fall after a learned peak (after step 0, "
            f">= {LEARN_MARGIN:g} pts above it); collapse@step: a fall without; flat: neither")


def _cell_label(s: dict) -> str:
    sharing = {"shared": "shr", "isolated": "iso"}.get(s["sharing"], s["sharing"] or "-")
    lr = f"/{lr_label(s['lr'])}" if s.get("lr") is not None else ""
    variant = f" [{s['variant']}]" if s.get("variant") else ""
    return f"{s['workflow'] or '-'}/{s['task'] or '-'}/{sharing}{lr}{variant}"


def run_rows(summaries: list) -> list:
    """The terminal run table (RUN_HEADERS): one compact row per run."""
    return [[s["name"], _cell_label(s), _status(s), _pct(s["base_acc"]), _pct(s["peak_acc"]),
             _num(s["peak_step"], "d"), _pct(s["final_acc"]), _pct(s["gain_final"], True),
             _pct(s["gain_peak"], True), _cliff_cell(s)] for s in summaries]


REPORT_RUN_HEADERS = ["run", "workflow", "task", "scale", "sharing", "lr", "seed", "status", "base", "peak",
                      "peak step", "final", "final-base", "peak-base", "outcome", "fall step"]


def report_run_rows(summaries: list) -> list:
    return [[s["name"], s["workflow"] or "-", s["task"] or "-", scale_label(s["scale"]), s["sharing"] or "-",
             lr_label(s["lr"]), _num(s["seed"], "d"), _status(s), _pct(s["base_acc"]), _pct(s["peak_acc"]),
             _num(s["peak_step"], "d"), _pct(s["final_acc"]), _pct(s["gain_final"], True),
             _pct(s["gain_peak"], True), s["outcome"] or "-", _num(s["fall_step"], "d")]
            for s in summaries]


MECH_HEADERS = ["run", "grad norm", "sup/gen", "grad share", "dominant (frac, streak); last tenth",
                "no-grad steps", "coherence", "slot cos", "damp cos", "damp scale", "length first->last",
                "code-block first->last", "parse-fail first->last"]


def _dominant(m: dict) -> str:
    if m["dominant_role"] is None:
        return "-"
    return f"{m['dominant_role']} ({m['dominant_frac']:.2f}, {m['dominant_streak']}); last {m['dominant_last']}"


def mechanism_rows(summaries: list) -> list:
    """The report's mechanism table (MECH_HEADERS), every role spelled out."""
    rows = []
    for s in summaries:
        m = s["mechanisms"]
        key = "opt" if m.get("grad_norm_key") == "grad_norm_opt" else "step"
        rows.append([s["name"], f"({key}) " + _per_role(m["grad_norm"]), _num(m["grad_ratio_sup_gen"], ".2f"),
                     _per_role(m["grad_share"], ".2f"), _dominant(m), _num(m.get("no_grad_steps"), "d"),
                     _per_role(m["coherence"], ".2f"), _per_role(m["slot_cos"], ".2f"),
                     _per_role(m.get("damp_cos", {}), ".2f"), _per_role(m.get("damp_scale", {}), ".2f"),
                     _drift(m["len_drift"], ".0f"), _drift(m["code_block_drift"], ".2f"),
                     _drift(m.get("parse_fail_drift", {}), ".2f")])
    return rows


TERM_MECH_HEADERS = ["run", "norm", "sup/gen", "dominant", "frac", "streak", "end", "no-grad", "coherence"]
TERM_MECH_LEGEND = ("norm: per opt. step or step sum; sup/gen: supervisory/solution; dominant: largest share most "
                    "often; end: last tenth")


def terminal_mechanism_rows(summaries: list) -> list:
    """The terminal mechanism table: the dominant role and ratios, roles abbreviated."""
    rows = []
    for s in summaries:
        m = s["mechanisms"]
        rows.append([s["name"], "opt" if m["grad_norm_key"] == "grad_norm_opt" else "step",
                     _num(m["grad_ratio_sup_gen"], ".2f"), m["dominant_role"] or "-", _num(m["dominant_frac"], ".2f"),
                     _num(m["dominant_streak"], "d"), m["dominant_last"] or "-", str(m["no_grad_steps"]),
                     _per_role(m["coherence"], ".2f", short=True)])
    return rows


def _stat(st, sign=False, spread=True, rng=False) -> str:
    if st is None:
        return "-"
    out = _pct(st["mean"], sign)
    if spread and st["n"] > 1:
        out += f"±{100 * st['sd']:.1f}" if st["n"] > 2 else ""   # two values: their range says it all
        if rng or st["n"] == 2:
            out += f" ({_pct(st['min'], sign)}..{_pct(st['max'], sign)})"
    return out


CELL_HEADERS = ["workflow", "task", "scale", "sharing", "lr", "seeds", "base", "peak", "final", "final-base",
                "peak-base", "outcomes", "variant"]
CELL_LEGEND = ("accuracy %, mean over seeds (±sd; two seeds: no sd); variant = the flags that set it apart\n"
               "outcomes = terminal cliffs, early collapses and runs that did not learn, of the seeds (c/c/f of n)")


def cell_table(summaries: list, report: bool = False) -> tuple:
    """(headers, rows) of the cell table, the variant column only when some cell has one."""
    rows = cell_rows(summaries, report)
    if all(r[-1] == "-" for r in rows):
        return CELL_HEADERS[:-1], [r[:-1] for r in rows]
    return CELL_HEADERS, rows


def cell_rows(summaries: list, report: bool = False) -> list:
    """One row per (workflow, task, scale, sharing, lr, variant); gains with ±sd (and min..max in the report)."""
    return [[c["workflow"] or "-", c["task"] or "-", scale_label(c["scale"]), c["sharing"] or "-", lr_label(c["lr"]),
             str(c["n"]), *(_stat(c[k], spread=report, rng=report) for k in CELL_STATS[:3]),
             *(_stat(c[k], True, rng=report) for k in CELL_STATS[3:]), outcome_text(c["outcomes"], c["n"], not report),
             c["variant"] or "-"]
            for c in cells(summaries)]


PRE_CLIFF_HEADERS = ["run", "cliff step", "steps just before", "norm", "coherence earlier->just before",
                     "grad norm earlier->just before"]


def pre_cliff_rows(summaries: list) -> list:
    rows = []
    for s in summaries:
        p = s.get("pre_cliff")
        if not p:
            continue
        key = "opt" if p["grad_norm_key"] == "grad_norm_opt" else "step"
        rows.append([s["name"], str(s["cliff_step"]), f"{p['steps'][0]}-{p['steps'][1]}", key,
                     _drift(p["coherence"], ".2f"), _drift(p["grad_norm"], ".3g")])
    return rows


def _rises(summaries: list, field: str) -> str:
    """'k of n': cliff runs where some role's value just before the cliff exceeds its earlier mean."""
    ps = [s["pre_cliff"][field] for s in summaries if s.get("pre_cliff") and s["pre_cliff"][field]]
    k = sum(any(a is not None and b is not None and b > a for a, b in d.values()) for d in ps)
    return f"{k} of {len(ps)}"


CAPTURE_HEADERS = ["run", "dominant (frac)", "last tenth", "length first->last", "parse-fail first->last",
                   "code-block first->last"]


def capture_rows(summaries: list) -> list:
    rows = []
    for s in summaries:
        c, m = s.get("capture"), s["mechanisms"]
        if not c:
            continue
        rows.append([s["name"], f"{c['role']} ({_num(m['dominant_frac'], '.2f')})", m["dominant_last"] or "-",
                     _pair(c["len"], ".1f"), _pair(c["parse_fail"], ".2f"), _pair(c["code_block_rate"], ".2f")])
    return rows


def _clip(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    left = (width - 2) // 2
    return text[:left] + ".." + text[len(text) - (width - 2 - left):]


def text_table(headers: list, rows: list, width: int | None = TABLE_WIDTH) -> str:
    """Columns padded to their widest cell; over `width` characters, the widest columns are
    shortened in the middle (a..b) until the table fits or every column is 8 wide."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    while width and sum(widths) + 2 * (len(widths) - 1) > width and max(widths) > 8:
        widths[widths.index(max(widths))] -= 1  # one character at a time: the widest ones share the cut
    line = lambda r: "  ".join(_clip(str(x), w).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def md_table(headers: list, rows: list) -> str:
    esc = lambda x: str(x).replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(out + ["| " + " | ".join(esc(x) for x in r) + " |" for r in rows])


# ----------------------------------------------------------------------------- report

def _link(p: str, base: str) -> str:
    return os.path.relpath(os.path.abspath(p), base)


def _figure_section(title: str, prefix: str, figures: list, base: str) -> list:
    paths = [p for p in figures if os.path.basename(p).startswith(prefix)]
    if not paths:
        return []
    return [f"## {title}", "", *(f"![{os.path.basename(p)}]({_link(p, base)})" for p in paths), ""]


def _intro(cliff_drop: float, cliff_window: int) -> list:
    rule = (OUTCOME_RULE.replace("N evaluations", f"{cliff_window} evaluations")
            .replace("D points", f"{cliff_drop:g} points").replace("M points", f"{LEARN_MARGIN:g} points"))
    return ["# Runs", "", "Accuracy in %. Base = step 0 (the untrained workflow); peak = the earliest step at the "
            f"maximum, step 0 included. Outcome: {rule}. Unfinished runs have no `done` file.", ""]


def _cells_section(summaries: list) -> list:
    return ["## Cells", "", CELL_LEGEND + "; (min..max) over seeds.", "",
            md_table(*cell_table(summaries, report=True)), ""]


def _pre_cliff_section(summaries: list) -> list:
    rows = pre_cliff_rows(summaries)
    if not rows:
        return ["## Before the cliff", "", "No run has a terminal cliff.", ""]
    return ["## Before the cliff", "", "For each run with a cliff: means over the training steps since the "
            "evaluation before the cliff step, or the last --pre-cliff-steps (just before), against every step "
            "before those (earlier; n/a when the cliff step is the first evaluation). Coherence rises in "
            f"{_rises(summaries, 'coherence')} cliff runs and some role's gradient norm in "
            f"{_rises(summaries, 'grad_norm')}.", "", md_table(PRE_CLIFF_HEADERS, rows), ""]


def _capture_section(summaries: list) -> list:
    if not capture_rows(summaries):
        return ["## Capture under Shared", "", "No Shared run with a dominant role.", ""]
    return ["## Capture under Shared", "", "The dominant role (largest gradient-mass share in the most steps) of "
            "each Shared run: its length in tokens (metrics.jsonl) and its parse-fail and code-block rates "
            "(eval.jsonl), first tenth -> last tenth of the records.", "",
            md_table(CAPTURE_HEADERS, capture_rows(summaries)), ""]


def _mechanism_section(summaries: list) -> list:
    return ["## Mechanisms", "", "Means over training steps. Grad norm (opt): per optimizer step, "
            "roles[r].grad_norm_opt; (step): summed over the step, roles[r].grad_norm. sup/gen = mean norm of the "
            "supervisory roles (evaluator, aggregator) over the solution roles (generator, worker, synthesizer). "
            "Dominant = role with the largest share in the most steps (fraction of the steps that have one, "
            "longest streak); last = the role holding it most in the last tenth; no-grad steps have none. "
            "Coherence and slot cos are over parallel same-role slots. Drifts compare the first and last tenth.",
            "", md_table(MECH_HEADERS, mechanism_rows(summaries)), ""]


def _runs_section(summaries: list, base: str) -> list:
    parts = ["## Runs", "", md_table(REPORT_RUN_HEADERS, report_run_rows(summaries)), ""]
    for s in summaries:
        if s["plots"]:
            parts.append(f"- {s['name']}: " + " ".join(f"[{os.path.basename(p)}]({_link(p, base)})" for p in s["plots"]))
    return parts + [""]


def write_report(summaries: list, path: str, cliff_drop: float = CLIFF_DROP, cliff_window: int = CLIFF_WINDOW,
                 figures: list = ()) -> str:
    """Markdown report: the map, cells, Shared vs Isolated, before the cliff, capture,
    mechanisms (table and per-cell figures) and runs (table and links to each run's plots)."""
    base = os.path.dirname(os.path.abspath(path))
    parts = (_intro(cliff_drop, cliff_window) + _figure_section("Map", "map", figures, base)
             + _cells_section(summaries) + _figure_section("Shared against Isolated", "acc-", figures, base)
             + _pre_cliff_section(summaries) + _capture_section(summaries) + _mechanism_section(summaries)
             + _figure_section("Mechanisms per cell", "mech-", figures, base) + _runs_section(summaries, base))
    os.makedirs(base, exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path


def figures_folder(report: str) -> str:
    """REPORT_DIR/STEM-figures for a report at REPORT_DIR/STEM.md."""
    return os.path.splitext(os.path.abspath(report))[0] + "-figures"
