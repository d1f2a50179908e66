"""Evaluate a workflow, and analyse training runs: peaks, cliffs and role-level gradient dynamics.

Two modes.

Evaluate a base model or a checkpoint through a workflow on a test split:

    python eval.py --workflow voting --task math --scale toy [--samples 4] [--problems 256] [--json]
    python eval.py --checkpoint runs/voting-math-shared-toy-s0          # its ckpt-best, its settings

- With `--checkpoint RUN` (a run folder: its ckpt-best, else ckpt-last) or `RUN/ckpt-N`, the
  workflow, task, data (the run's --eval-data when it had one), scale, sharing, isolation and
  length limits come from RUN/config.json; a flag given on the command line wins.
- The test set: the whole test split of the data, or the run's own evaluation set (its
  --eval-problems) for a checkpoint; `--problems N` draws N (capped at the split's size).
- Sampling at temperature 0.7, top-p 1 (the training temperature), `--samples` episodes per
  problem. pass@1 is the mean over problems of c/n; pass@k is the unbiased estimator
  1 - C(n-c, k) / C(n, k) averaged over problems (n episodes, c correct), reported for
  k = 1, 2, 4, ... up to n.
- Per-role quality where the task gives ground truth (every judged or candidate solution is
  scored with rewards.score):
  * evaluator: a verdict "Correct" counts as a positive; precision = P(solution correct |
    said Correct), recall = P(said Correct | solution correct), over the evaluator calls that
    gave a verdict (workflows.parse_verdict without a fallback), each compared with the
    generator turn just before it;
  * aggregator: selection accuracy = P(the chosen candidate is correct | at least one of its
    candidates is correct), next to that oracle rate and the plain rate of correct choices;
  * orchestrator: parse rate (at least one `STRATEGY k:` line) and mean number of strategies
    (0 when none parsed);
  * every role: mean output length (characters, and tokens where the calls carry
    completion ids), code-block rate (rewards.last_code_block finds a block), parser
    fallbacks per call (from Episode.fallbacks).

Analyse run folders written by train.py (every file and field: docs/RUNFOLDER.md):

    python eval.py --runs runs/matrix/* [--report runs/matrix/report.md] [--json] [--no-plots]

- One row per run: base accuracy (the step-0 evaluation, the untrained workflow), peak
  accuracy and its step (the earliest step at the maximum over all evaluations, step 0
  included), final accuracy (last evaluation), gains final - base and peak - base, and the
  terminal cliff: a run has a terminal cliff when its last N evaluations (--cliff-window)
  all come after its peak and all lie at least D points (--cliff-drop) below it; the cliff
  step is the first evaluation of the final stretch that stays that far below the peak.
  (N = 2 by default: one low last reading alone is noise as often as not; D = 10.) A run
  without a `done` file is marked unfinished.
- Cells: runs that differ only in their seed, keyed by (workflow, task, scale, sharing, lr),
  with the mean, standard deviation and range of each accuracy, and cliffs as k/n runs.
- Mechanisms, from metrics.jsonl (any key may be missing in a step; missing values are skipped):
  * per-role gradient norm: roles[r].grad_norm_opt (mean over the role's optimizer steps of
    the norm of what it added to that step) when the run logged it, else roles[r].grad_norm
    (its contribution summed over the step's mini-batches); the sup/gen ratio is the mean over
    the roles workflows.ROLE_KINDS calls "supervisory" (evaluator, aggregator: they judge
    others' solutions) over the mean over its "solution" roles (generator, worker,
    synthesizer); "planning" roles (the orchestrator) are in neither group;
  * per-role mean gradient-mass share, and the dominant role: the role with the largest
    share in the most steps (a step where no role has any gradient has none), with that
    fraction of steps, its longest streak and the role holding it most in the last tenth;
  * slot coherence ||sum_k g_k|| / sum_k ||g_k|| and the mean pairwise cosine of parallel
    same-role slots (1: the slots push the role one way, an amplified gradient); the coherence
    intervention's roles[r].damp_cos and damp_scale when the run logged them;
  * drift between the first and the last tenth of the records (at least one record each):
    per-role length in tokens (metrics.jsonl), code-block and parse-fail rates (eval.jsonl).
  * before a cliff: slot coherence and per-role gradient norm averaged over the training steps
    since the evaluation before the cliff step (or the last --pre-cliff-steps), against the
    average over every step before those;
  * capture, for Shared runs: the dominant role's length, parse-fail and code-block drift.
- PNG plots, written by both --runs and --report (--no-plots: none; needs matplotlib). Into
  each run folder: acc.png (evaluation accuracy with base, peak and cliff; training reward in
  its own panel), grad.png (per-role gradient norm, share, coherence, damping), length.png
  (per-role length; code-block and parse-fail rates when any is non-zero). With --report,
  next to it in REPORT-figures/: map.png (one panel per task, a row per workflow x sharing
  (x lr), coloured by final - base), mech-CELL.png (a cell's mechanisms over steps, seeds as
  mean and range) and acc-WORKFLOW-TASK.png (Shared against Isolated, seeds as mean and range).
- `--report PATH` writes a Markdown report: the map, the cell table, the pre-cliff and capture
  tables, the per-run mechanism and run tables, and the figures. `--json` prints it all.
"""
import argparse
import json
import math
import os
import sys
import zlib
from collections import defaultdict

import workflows  # torch-free: the registry of workflows, roles and role kinds

CLIFF_DROP = 10.0      # percentage points below the peak
CLIFF_WINDOW = 2       # last evaluations that must all be that far below it
CLIFF_RULE = ("a run has a terminal cliff when its last N evaluations (--cliff-window) all come after "
              "its peak and all lie at least D points (--cliff-drop) below it; the cliff step is the first "
              "evaluation of the final stretch that stays that far below the peak")
PLOT_NAMES = ("acc.png", "grad.png", "length.png")
# one colour per role in every plot, so a reader can follow a role from plot to plot
ROLE_COLORS = {"generator": "tab:blue", "worker": "tab:cyan", "synthesizer": "tab:green",
               "evaluator": "tab:orange", "aggregator": "tab:purple", "orchestrator": "tab:brown"}
# roles a fork adds get one of these by a hash of their name (red is kept for cliffs)
EXTRA_COLORS = ("tab:pink", "tab:olive", "tab:gray", "gold", "teal", "navy", "darkkhaki", "black")
SHARING_COLORS = {"shared": "tab:blue", "isolated": "tab:orange"}
MATPLOTLIB_MISSING = "plots need matplotlib, which is not installed: pip install matplotlib"
TABLE_WIDTH = 120


# ----------------------------------------------------------------------------- pass@k

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i): no huge binomials, exact to rounding."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def _ks(samples: int) -> list:
    """k = 1, 2, 4, ... up to samples, and samples itself."""
    ks = {1, samples}
    k = 2
    while k < samples:
        ks.add(k)
        k *= 2
    return sorted(ks)


# ----------------------------------------------------------------------------- role quality

def _parsers():
    """The role-output parsers of workflows.py (None, with a note, for any that is missing)."""
    verdict = getattr(workflows, "parse_verdict", None)
    choice = getattr(workflows, "parse_choice", None)
    strategies = getattr(workflows, "parse_strategies", None)
    notes = [f"workflows.{name} not found: {what}" for name, fn, what in (
        ("parse_verdict", verdict, "evaluator precision/recall skipped"),
        ("parse_choice", choice, "aggregator choice read from the graded text instead"),
        ("parse_strategies", strategies, "strategies counted as the worker calls made")) if fn is None]
    return verdict, choice, strategies, notes


def _unpack(res):
    """workflows' parsers return (value, fallback_taken); accept a bare value too."""
    if isinstance(res, tuple) and len(res) == 2 and isinstance(res[1], bool):
        return res
    return res, False


def _count(x) -> float:
    """A fallback record as a number: a count, a flag, or a list of fallbacks taken."""
    if isinstance(x, (int, float)):
        return float(x)
    return float(len(x)) if isinstance(x, (list, tuple, set, dict)) else 0.0


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _div(a, b):
    return a / b if b else None


def _scorer(episodes: list, task: str, scored: dict):
    """correct(ep, text) for every generator text, scored with rewards.score in one batch."""
    import rewards
    scored = dict(scored)
    need = {(ep.problem_id, c.text): ep.problem for ep in episodes for c in ep.calls
            if c.role == "generator" and (ep.problem_id, c.text) not in scored}
    if need:
        keys = list(need)
        rs = rewards.score([t for _, t in keys], [need[k] for k in keys], task)
        scored.update({k: float(r) for k, r in zip(keys, rs)})
    return lambda ep, text: scored.get((ep.problem_id, text), 0.0) > 0.5


def _role_outputs(episodes: list) -> dict:
    """{role: calls, len_chars, len_tokens (None unless every call has ids), code_block_rate,
    fallbacks_per_call}."""
    import rewards
    acc = defaultdict(lambda: {"calls": 0, "chars": 0, "tokens": 0, "all_ids": True, "blocks": 0})
    fallbacks = defaultdict(float)
    for ep in episodes:
        for role, n in (ep.fallbacks or {}).items():
            fallbacks[role] += _count(n)
        for call in ep.calls:
            r = acc[call.role]
            r["calls"] += 1
            r["chars"] += len(call.text)
            r["tokens"] += len(call.completion_ids or [])
            r["all_ids"] &= bool(call.completion_ids)
            r["blocks"] += rewards.last_code_block(call.text) is not None
    return {role: {"calls": r["calls"], "len_chars": _div(r["chars"], r["calls"]),
                   "len_tokens": _div(r["tokens"], r["calls"]) if r["all_ids"] else None,
                   "code_block_rate": _div(r["blocks"], r["calls"]),
                   "fallbacks_per_call": _div(fallbacks.get(role, 0.0), r["calls"])}
            for role, r in sorted(acc.items())}


def _evaluator_quality(episodes: list, correct, parse_verdict) -> dict | None:
    """Each verdict against the generator turn just before it; no verdict counts only in
    verdict_rate."""
    c = {"calls": 0, "verdicts": 0, "tp": 0, "fp": 0, "fn": 0, "tn": 0}
    for ep in episodes:
        last_gen = None
        for call in ep.calls:
            if call.role == "generator":
                last_gen = call.text
            if call.role != "evaluator":
                continue
            c["calls"] += 1
            if parse_verdict is None or last_gen is None:
                continue
            said_correct, fallback = _unpack(parse_verdict(call.text))
            if fallback or said_correct is None:
                continue
            c["verdicts"] += 1
            truth = correct(ep, last_gen)
            c[("tp" if truth else "fp") if said_correct else ("fn" if truth else "tn")] += 1
    if not c["calls"]:
        return None
    return {"calls": c["calls"], "verdict_rate": _div(c["verdicts"], c["calls"]),
            "precision": _div(c["tp"], c["tp"] + c["fp"]), "recall": _div(c["tp"], c["tp"] + c["fn"]),
            "accuracy": _div(c["tp"] + c["tn"], c["verdicts"]),
            "confusion": {k: c[k] for k in ("tp", "fp", "fn", "tn")}}


def _chosen(ep, call, candidates, parse_choice):
    """The candidate text an aggregator call chose, or None."""
    if parse_choice is not None and candidates:
        k, _ = _unpack(parse_choice(call.text, len(candidates)))
        return candidates[k - 1] if isinstance(k, int) and 1 <= k <= len(candidates) else None  # 1-based
    if ep.final_text in candidates:  # without the parser: Voting grades the chosen text
        return ep.final_text
    return None


def _aggregator_quality(episodes: list, correct, parse_choice) -> dict | None:
    c = {"calls": 0, "with_correct": 0, "picked_given_any": 0, "picked": 0, "resolved": 0}
    for ep in episodes:
        candidates = []
        for call in ep.calls:
            if call.role == "generator":
                candidates.append(call.text)
            if call.role != "aggregator":
                continue
            c["calls"] += 1
            chosen = _chosen(ep, call, candidates, parse_choice)
            if chosen is None:
                continue
            c["resolved"] += 1
            picked = correct(ep, chosen)
            c["picked"] += picked
            if any(correct(ep, t) for t in candidates):
                c["with_correct"] += 1
                c["picked_given_any"] += picked
    if not c["calls"]:
        return None
    return {"calls": c["calls"], "resolved": c["resolved"],
            "selection_acc": _div(c["picked_given_any"], c["with_correct"]),
            "oracle_rate": _div(c["with_correct"], c["resolved"]),
            "picked_correct_rate": _div(c["picked"], c["resolved"])}


def _strategies(ep, i, parse_strategies) -> int:
    """How many strategies the orchestrator call ep.calls[i] gave (0 when none parsed)."""
    if parse_strategies is None:  # one worker per parsed strategy; a failed parse still runs one
        k = sum(c.role == "worker" for c in ep.calls[i + 1:])
        return k if _count((ep.fallbacks or {}).get("orchestrator")) == 0 else 0
    strategies, fallback = _unpack(parse_strategies(ep.calls[i].text))
    # nothing parsed: the workflow substitutes one direct strategy, as a fallback
    none = fallback and list(strategies or []) == [getattr(workflows, "DIRECT_STRATEGY", None)]
    return 0 if none else len(strategies or [])


def _orchestrator_quality(episodes: list, parse_strategies) -> dict | None:
    ks = [_strategies(ep, i, parse_strategies) for ep in episodes
          for i, call in enumerate(ep.calls) if call.role == "orchestrator"]
    if not ks:
        return None
    return {"calls": len(ks), "parse_rate": sum(k > 0 for k in ks) / len(ks), "mean_strategies": _mean(ks)}


def role_quality(episodes: list, task: str, scored: dict | None = None) -> dict:
    """Per-role quality of a batch of workflows.Episode records against ground truth.

    Every solution a role judged or chose from is scored with rewards.score (batched once);
    `scored` maps (problem id, text) -> reward already known, to skip re-running code tests.
    Returns {"roles": {role: {"calls", "len_chars", "len_tokens", "code_block_rate",
    "fallbacks_per_call"}}, "evaluator": {...}, "aggregator": {...}, "orchestrator": {...},
    "notes": [...]}; a section is present only when its role appears."""
    parse_verdict, parse_choice, parse_strategies, notes = _parsers()
    correct = _scorer(episodes, task, scored or {})
    out = {"roles": _role_outputs(episodes), "notes": notes}
    for name, section in (("evaluator", _evaluator_quality(episodes, correct, parse_verdict)),
                          ("aggregator", _aggregator_quality(episodes, correct, parse_choice)),
                          ("orchestrator", _orchestrator_quality(episodes, parse_strategies))):
        if section is not None:
            out[name] = section
    return out


# ----------------------------------------------------------------------------- evaluate

def _pass_at_ks(episodes: list, samples: int) -> dict:
    counts = defaultdict(lambda: [0, 0])  # problem id -> [n, c]
    for e in episodes:
        counts[e.problem_id][0] += 1
        counts[e.problem_id][1] += e.reward > 0.5
    return {k: _mean([pass_at_k(n, c, k) for n, c in counts.values() if n >= k]) for k in _ks(samples)}


def evaluate(llm, workflow: str, problems: list, task: str, samples: int = 1, batch_size: int = 16,
             progress: bool = True, **wf_params) -> dict:
    """Run `workflow` with `llm` on every problem `samples` times, score, and measure.

    Returns {"workflow", "task", "problems", "samples", "episodes", "pass@k": {k: mean over
    problems}, "quality": role_quality(...)}; "pass@1" is the mean per-problem fraction correct."""
    import rewards
    import rollout
    from tqdm import tqdm

    assert samples >= 1 and problems, "need at least one problem and one sample"
    episodes = []
    bar = tqdm(total=len(problems), desc=f"eval {workflow}/{task}", disable=not progress)
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        eps = rollout.run_episodes(llm, workflow, chunk, samples, task, **wf_params)
        rs = rewards.score([e.final_text for e in eps], [e.problem for e in eps], task)
        for e, r in zip(eps, rs):
            e.reward = float(r)
        episodes += eps
        bar.update(len(chunk))
    bar.close()
    known = {(e.problem_id, e.final_text): e.reward for e in episodes}
    return {"workflow": workflow, "task": task, "problems": len({e.problem_id for e in episodes}),
            "samples": samples, "episodes": len(episodes), "pass@k": _pass_at_ks(episodes, samples),
            "quality": role_quality(episodes, task, scored=known)}


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
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
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
    if any(os.path.isfile(os.path.join(path, f)) for f in ("metrics.jsonl", "eval.jsonl")):
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


def role_color(role: str) -> str:
    """The role's fixed colour; a role a fork adds gets one derived from its name."""
    return ROLE_COLORS.get(role) or EXTRA_COLORS[zlib.crc32(role.encode()) % len(EXTRA_COLORS)]


def _abbrev(role: str) -> str:
    return role[:3]  # as train.py's step line: gen, agg, eva, orc, wor, syn


# ----------------------------------------------------------------------------- accuracy and cliffs

def _cliff_start(accs: list, peak_i: int, line: float) -> int:
    """Index where the final stretch of accuracies at or below `line` begins (after the peak)."""
    i = len(accs)
    while i > peak_i + 1 and accs[i - 1] <= line:
        i -= 1
    return i


def accuracy_summary(evals: list, cliff_drop: float = CLIFF_DROP, cliff_window: int = CLIFF_WINDOW) -> dict:
    """Base, peak, final accuracy, gains and the terminal cliff (CLIFF_RULE).

    `evals` are eval.jsonl records sorted by step; `cliff_drop` is in percentage points.
    tail_mean is the mean of the last `cliff_window` evaluations."""
    pts = [(r["step"], float(r["acc"])) for r in evals if is_num(r.get("acc"))]
    out = {"n_evals": len(pts), "base_acc": None, "peak_acc": None, "peak_step": None,
           "final_acc": None, "final_step": None, "gain_final": None, "gain_peak": None,
           "tail_mean": None, "cliff_line": None, "cliff": False, "cliff_step": None}
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
    out["cliff_line"] = accs[peak_i] - cliff_drop / 100.0
    # 1e-9: 0.5 - 0.4 is 0.0999..., which must count as a drop of 10 points
    start = _cliff_start(accs, peak_i, out["cliff_line"] + 1e-9)
    if len(accs) - start >= cliff_window:
        out.update(cliff=True, cliff_step=pts[start][0])
    return out


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
                   dominant_last=_most(held[-max(1, len(held) // 10):]))  # who holds it at the end
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
    except KeyError:
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
           "steps_planned": cfg.get("steps")}
    out.update(accuracy_summary(run["evals"], cliff_drop, cliff_window))
    out["mechanisms"] = m = mechanisms(run["metrics"], run["evals"])
    out["pre_cliff"] = before_cliff(run["metrics"], run["evals"], out["cliff_step"], pre_cliff_steps)
    out["capture"] = capture(run["metrics"], run["evals"], m["dominant_role"]) if out["sharing"] == "shared" else None
    out["plots"] = []
    return out


# ----------------------------------------------------------------------------- cells

CELL_KEYS = ("workflow", "task", "scale", "sharing", "lr")
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
    """Cells by task, then workflows in registry order, shared before isolated, lr ascending."""
    wf, task, scale, sharing, lr = key
    wfs = list(workflows.WORKFLOWS)
    return (str(task), wfs.index(wf) if wf in wfs else len(wfs), str(wf), str(scale),
            sharing_order(sharing), lr if is_num(lr) else math.inf)


def cells(summaries: list) -> list:
    """Runs grouped by (workflow, task, scale, sharing, lr): the seeds of one cell."""
    groups = defaultdict(list)
    for s in summaries:
        groups[tuple(s.get(k) for k in CELL_KEYS)].append(s)
    out = []
    for key in sorted(groups, key=cell_order):
        ss = groups[key]
        c = dict(zip(CELL_KEYS, key), runs=[s["name"] for s in ss], seeds=[s["seed"] for s in ss],
                 n=len(ss), cliffs=sum(s["cliff"] for s in ss))
        c.update({k: _stats([s[k] for s in ss]) for k in CELL_STATS})
        out.append(c)
    return out


def lr_label(x) -> str:
    """1e-3, 2e-5, 1.5e-3."""
    if not is_num(x):
        return "-"
    mant, exp = f"{x:.2e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def cell_title(c: dict, seed=True) -> str:
    """workflow, task, sharing[, seed S][, lr L] of a run summary or a cell."""
    parts = [str(c.get("workflow") or "?"), str(c.get("task") or "?"), str(c.get("sharing") or "?")]
    if seed and c.get("seed") is not None:
        parts.append(f"seed {c['seed']}")
    if c.get("lr") is not None:
        parts.append(f"lr {lr_label(c['lr'])}")
    return ", ".join(parts)


def scale_label(scale) -> str:
    """A scale as train.py names runs: a local model folder by its last part."""
    return os.path.basename(os.path.normpath(scale)) if scale else "-"


def _slug(*parts) -> str:
    return "-".join(str(p).replace(os.sep, "_").replace(":", "_").replace(" ", "") for p in parts if p is not None)


# ----------------------------------------------------------------------------- plots of one run

def _figure_class():
    try:
        from matplotlib.figure import Figure  # a bare Figure needs no GUI backend or pyplot state
    except ImportError:
        raise ImportError(MATPLOTLIB_MISSING) from None
    return Figure


def _mark_cliffs(ax, steps, label=True):
    for i, step in enumerate(steps):
        ax.axvline(step, color="tab:red", ls="--", lw=1.2, label="cliff step" if label and i == 0 else None)


def _log_axis(ax, values):
    """Log scale (supervisory and solution norms differ by several times) with plain ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    if values and all(v > 0 for v in values):
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())


def _role_lines(ax, series: dict, ylabel: str, **kw):
    for role, s in sorted(series.items()):
        ax.plot(*zip(*s), lw=1.2, label=role, color=role_color(role), **kw)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _panels(Figure, n: int, title: str, height=2.0, ratios=None):
    fig = Figure(figsize=(8, 1.2 + height * n if ratios is None else 1.2 + height * sum(ratios)))
    axes = fig.subplots(n, 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": ratios} if ratios else None)
    fig.suptitle(title, fontsize=12)
    return fig, [a[0] for a in axes]


def _finish(fig, axes):
    from matplotlib.ticker import MaxNLocator
    axes[-1].set_xlabel("training step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()


def _draw_accuracy(Figure, run: dict, s: dict):
    pts = [(r["step"], 100 * r["acc"]) for r in run["evals"]]
    if not pts:
        return None
    rew = [(r["step"], 100 * r["reward"]) for r in run["metrics"] if is_num(r.get("reward"))]
    fig, axes = _panels(Figure, 2 if rew else 1, cell_title(s) + ("" if s["finished"] else " (unfinished)"),
                        ratios=[2.2, 1] if rew else None)
    ax = axes[0]
    ax.plot(*zip(*pts), marker="o", ms=3, color="black", label="eval accuracy")
    if s["base_acc"] is not None:
        ax.axhline(100 * s["base_acc"], color="0.4", ls=":", lw=1, label=f"base {100 * s['base_acc']:.1f}")
    ax.plot([s["peak_step"]], [100 * s["peak_acc"]], "*", ms=14, color="tab:green",
            label=f"peak {100 * s['peak_acc']:.1f} @ {s['peak_step']}")
    if s["cliff"]:
        ax.axhline(100 * s["cliff_line"], color="tab:red", ls=":", lw=1, label="peak - cliff drop")
        ax.axvspan(s["cliff_step"], s["final_step"], color="tab:red", alpha=0.12)
        _mark_cliffs(ax, [s["cliff_step"]])
    ax.set(ylabel="eval accuracy (%)")
    ax.grid(alpha=0.3)
    if rew:
        axes[1].plot(*zip(*rew), color="0.45", lw=1)
        axes[1].set(ylabel="train reward (%)")
        axes[1].grid(alpha=0.3)
    _finish(fig, axes)
    return fig


def _norm_label(key: str) -> str:
    return "grad norm per opt. step" if key == "grad_norm_opt" else "grad norm (step sum)"


def _nonzero(series: dict) -> dict:
    """Drop a panel's data when every value is 0 (a code-block rate on math, say)."""
    return series if any(v for ser in series.values() for _, v in ser) else {}


DAMP_LABEL = "damping"


def _mechanism_series(metrics: list) -> list:
    """(ylabel, {role: series}) of every mechanism panel over training steps, {} where every
    value is 0; the damping panel's series are {(role, "scale" | "cos"): series}."""
    key = grad_key(metrics)
    damp = {**{(r, "scale"): s for r, s in role_series(metrics, "damp_scale").items()},
            **{(r, "cos"): s for r, s in role_series(metrics, "damp_cos").items()}}
    panels = [(_norm_label(key), role_series(metrics, key)),
              ("gradient-mass share", role_series(metrics, "grad_share")),
              ("slot coherence", keyed_series(metrics, "coherence")),
              ("length (tokens)", role_series(metrics, "len")),
              (DAMP_LABEL, damp)]
    return [(ylabel, _nonzero(series)) for ylabel, series in panels]


def _damp_note(ax, ylabel: str):
    """The damping panel's own legend: solid lines are the scale, dashed the cosine."""
    if ylabel == DAMP_LABEL:
        from matplotlib.lines import Line2D
        ax.legend([Line2D([], [], color="0.3"), Line2D([], [], color="0.3", ls="--")], ["scale", "cos"],
                  fontsize=8, loc="best")


def _style(key):
    """(role, line style) of a panel's series key."""
    return (key[0], "--" if key[1] == "cos" else "-") if isinstance(key, tuple) else (key, "-")


def _draw_gradients(Figure, run: dict, s: dict):
    panels = [(y, ser) for y, ser in _mechanism_series(run["metrics"]) if ser and not y.startswith("length")]
    if not panels:
        return None
    fig, axes = _panels(Figure, len(panels), cell_title(s) + ": per-role gradient")
    for ax, (ylabel, series) in zip(axes, panels):
        for key, ser in sorted(series.items()):
            role, ls = _style(key)
            ax.plot(*zip(*ser), lw=1.2, ls=ls, color=role_color(role), label=None if ls == "--" else role)
        ax.set_ylabel(ylabel)
        _damp_note(ax, ylabel)
        ax.grid(alpha=0.3)
        if ax is axes[0]:
            _log_axis(ax, [v for ser in series.values() for _, v in ser])
        _mark_cliffs(ax, [s["cliff_step"]] if s["cliff"] else [], label=ax is axes[0])
    _finish(fig, axes)
    return fig


def _draw_outputs(Figure, run: dict, s: dict):
    panels = [("length (tokens)", role_series(run["metrics"], "len")),
              ("code-block rate (eval)", _nonzero(keyed_series(run["evals"], "code_block_rate"))),
              ("parse-fail rate (eval)", _nonzero(keyed_series(run["evals"], "parse_fail")))]
    panels = [p for p in panels if p[1]]
    if not panels:
        return None
    fig, axes = _panels(Figure, len(panels), cell_title(s) + ": per-role output")
    for ax, (ylabel, series) in zip(axes, panels):
        _role_lines(ax, series, ylabel, marker="o" if "eval" in ylabel else None, ms=3)
        _mark_cliffs(ax, [s["cliff_step"]] if s["cliff"] else [], label=ax is axes[0])
    _finish(fig, axes)
    return fig


def _save(fig, folder, name):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def plot_run(folder: str, cliff_drop: float = CLIFF_DROP, cliff_window: int = CLIFF_WINDOW,
             run: dict | None = None, summary: dict | None = None) -> list:
    """Write acc.png, grad.png and length.png into the run folder; returns the paths written.
    A plot with nothing to show (no evaluations, no gradient) is not written, and one left
    by an earlier analysis is removed, so no plot in the folder is older than its data."""
    Figure = _figure_class()
    run = run or load_run(folder)
    s = summary or analyse_run(folder, cliff_drop, cliff_window, run=run)
    written = []
    for name, draw in zip(PLOT_NAMES, (_draw_accuracy, _draw_gradients, _draw_outputs)):
        fig = draw(Figure, run, s)
        if fig is not None:
            written.append(_save(fig, folder, name))
        elif os.path.isfile(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    return written


# ----------------------------------------------------------------------------- plots across runs

def sharing_order(sharing) -> int:
    return {"shared": 0, "isolated": 1}.get(sharing, 2)


def _band(series_list: list):
    """(steps, mean, min, max) over several runs' [(step, value)], step by step."""
    at = defaultdict(list)
    for ser in series_list:
        for step, v in ser:
            at[step].append(v)
    steps = sorted(at)
    return (steps, [sum(at[t]) / len(at[t]) for t in steps], [min(at[t]) for t in steps], [max(at[t]) for t in steps])


def _band_line(ax, series_list: list, color, label, ls="-"):
    steps, mean, lo, hi = _band(series_list)
    if not steps:
        return
    ax.plot(steps, mean, color=color, lw=1.3, ls=ls, label=label)
    if len(series_list) > 1:
        ax.fill_between(steps, lo, hi, color=color, alpha=0.18, lw=0)


def _map_label(row: tuple, several_lr: bool, several_scales: bool) -> str:
    wf, scale, sharing, lr = row
    return " · ".join([str(wf), str(sharing)] + ([f"lr {lr_label(lr)}"] if several_lr else [])
                      + ([scale_label(scale)] if several_scales else []))


def _map_text(c: dict) -> tuple:
    """(final - base, peak - base, cliffs) of a cell as text; ±sd with several seeds."""
    def gain(st):
        return "-" if st is None else f"{100 * st['mean']:+.1f}" + (f" ±{100 * st['sd']:.1f}" if st["n"] > 1 else "")
    return gain(c["gain_final"]), gain(c["gain_peak"]), f"{'▼ ' if c['cliffs'] else ''}{c['cliffs']}/{c['n']}"


def _map_panel(ax, cs: list, task: str, norm, cmap):
    """One task: column 0 coloured by final - base, then peak - base and cliffs as text;
    `cs` holds a cell or None per row."""
    import numpy as np
    vals = np.array([[100 * c["gain_final"]["mean"] if c and c["gain_final"] else np.nan] for c in cs])
    im = ax.imshow(vals, cmap=cmap, norm=norm, aspect="auto", extent=(-0.5, 0.5, len(cs) - 0.5, -0.5))
    for i, c in enumerate(cs):
        if c is None:
            ax.text(0, i, "no runs", ha="center", va="center", fontsize=9, color="0.5")
            continue
        inside, peak, cliff = _map_text(c)
        dark = not np.isnan(vals[i, 0]) and abs(norm(vals[i, 0]) - 0.5) > 0.3
        ax.text(0, i, inside, ha="center", va="center", fontsize=10, color="white" if dark else "black")
        ax.text(1, i, peak, ha="center", va="center", fontsize=10)
        ax.text(2, i, cliff, ha="center", va="center", fontsize=10, color="tab:red" if c["cliffs"] else "0.4",
                fontweight="bold" if c["cliffs"] else None)
    ax.set_xlim(-0.5, 2.5)
    ax.set_xticks([0, 1, 2], ["final - base", "peak - base", "cliffs"])
    ax.xaxis.tick_top()
    ax.set_title(f"task: {task}", fontsize=12)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(length=0)
    return im


def plot_map(cell_list: list, path: str) -> str | None:
    """One panel per task, the same rows in each (workflow x sharing, x lr when several),
    coloured by the mean final - base accuracy (diverging, centred at 0)."""
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm
    Figure = _figure_class()
    gains = [abs(100 * c["gain_final"]["mean"]) for c in cell_list if c["gain_final"]]
    if not gains:
        return None
    at = {(c["task"], c["workflow"], c["scale"], c["sharing"], c["lr"]): c for c in cell_list}
    rows = sorted({k[1:] for k in at}, key=lambda r: cell_order((r[0], None, *r[1:])))
    task_names = sorted({k[0] for k in at}, key=str)
    v = max(max(gains), 1.0)
    norm, cmap = TwoSlopeNorm(0.0, -v, v), colormaps["RdBu"]
    fig = Figure(figsize=(1.8 + 4.2 * len(task_names) + 1.0, 1.4 + 0.45 * len(rows)), layout="constrained")
    axes = fig.subplots(1, len(task_names), squeeze=False, sharey=True)[0]
    for ax, task in zip(axes, task_names):
        im = _map_panel(ax, [at.get((task, *r)) for r in rows], task, norm, cmap)
    axes[0].set_yticks(range(len(rows)), [_map_label(r, len({r[3] for r in rows}) > 1, len({r[1] for r in rows}) > 1)
                                           for r in rows])
    fig.colorbar(im, ax=list(axes), label="final - base accuracy (points)", shrink=0.9)
    several = max(c["n"] for c in cell_list) > 1
    fig.suptitle("Accuracy map: gains in points" + (" (mean ±sd over seeds)" if several else "")
                 + "; ▼ k/n = runs with a terminal cliff", fontsize=12)
    fig.savefig(path, dpi=110)
    return path


def _cell_panels(group: list) -> list:
    """(ylabel, {series key: [series of each run]}) of a cell's mechanism figure."""
    panels = defaultdict(lambda: defaultdict(list))
    labels = []
    for _, run in group:
        for ylabel, series in _mechanism_series(run["metrics"]):
            labels += [ylabel] if ylabel not in labels else []
            for key, ser in series.items():
                panels[ylabel][key].append(ser)
    return [(y, dict(panels[y])) for y in labels if panels[y]]


def plot_cell(c: dict, group: list, path: str) -> str | None:
    """A cell's mechanisms over training steps (seeds as mean and min..max band), cliffs marked."""
    Figure = _figure_class()
    panels = _cell_panels(group)
    if not panels:
        return None
    seeds = f"{len(group)} seeds (mean, band = min..max)" if len(group) > 1 else "1 seed"
    fig, axes = _panels(Figure, len(panels), f"{cell_title(c, seed=False)}: mechanisms, {seeds}", height=1.9)
    cliff_steps = [s["cliff_step"] for s, _ in group if s["cliff"]]
    for ax, (ylabel, per_key) in zip(axes, panels):
        for key, sers in sorted(per_key.items()):
            role, ls = _style(key)
            _band_line(ax, sers, role_color(role), None if ls == "--" else role, ls=ls)
        if ax is axes[0]:
            _log_axis(ax, [v for sers in per_key.values() for ser in sers for _, v in ser])
        ax.set_ylabel(ylabel)
        _damp_note(ax, ylabel)
        ax.grid(alpha=0.3)
        _mark_cliffs(ax, cliff_steps, label=ax is axes[0])
    _finish(fig, axes)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def plot_overlay(title: str, groups: dict, path: str) -> str | None:
    """Eval accuracy and train reward of one workflow and task: a line (seeds' mean, band)
    per sharing mode; each seed's cliff step marked with a triangle."""
    Figure = _figure_class()
    fig, axes = _panels(Figure, 2, title, ratios=[2.2, 1])
    for sharing, group in sorted(groups.items(), key=lambda kv: sharing_order(kv[0])):
        color = SHARING_COLORS.get(sharing, "tab:gray")
        accs = [[(r["step"], 100 * r["acc"]) for r in run["evals"]] for _, run in group]
        rews = [[(r["step"], 100 * r["reward"]) for r in run["metrics"] if is_num(r.get("reward"))] for _, run in group]
        _band_line(axes[0], accs, color, f"{sharing} ({len(group)} seed{'s' if len(group) > 1 else ''})")
        _band_line(axes[1], rews, color, sharing)
        for s, run in group:
            at = [100 * r["acc"] for r in run["evals"] if r["step"] == s["cliff_step"]]
            if s["cliff"] and at:
                axes[0].plot([s["cliff_step"]], at, "v", ms=10, color=color, mec="tab:red", mew=1.5)
    axes[0].set_ylabel("eval accuracy (%)")
    axes[1].set_ylabel("train reward (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].plot([], [], "v", color="white", mec="tab:red", label="cliff step (a seed)")
    _finish(fig, axes)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _lr_slug(lr):
    return lr and f"lr{lr_label(lr)}"


def _cell_figures(summaries: list, runs: dict, folder: str) -> list:
    """mech-WORKFLOW-TASK-SCALE-SHARING-lrLR.png for every cell."""
    written = []
    for c in cells(summaries):
        key = tuple(c[k] for k in CELL_KEYS)
        group = [(s, runs[s["run"]]) for s in summaries if tuple(s.get(k) for k in CELL_KEYS) == key]
        name = "mech-" + _slug(c["workflow"], c["task"], scale_label(c["scale"]), c["sharing"], _lr_slug(c["lr"]))
        written.append(plot_cell(c, group, os.path.join(folder, name + ".png")))
    return written


def _overlay_figures(summaries: list, runs: dict, folder: str) -> list:
    """acc-WORKFLOW-TASK-SCALE-lrLR.png: each sharing mode of a workflow, task and lr."""
    groups = defaultdict(lambda: defaultdict(list))
    for s in summaries:
        groups[(s["workflow"], s["task"], s["scale"], s["lr"])][s["sharing"]].append((s, runs[s["run"]]))
    written = []
    for (wf, task, scale, lr), by_sharing in sorted(groups.items(), key=lambda kv: cell_order((*kv[0][:3], None, kv[0][3]))):
        title = ", ".join(str(x) for x in (wf, task) if x) + (f", lr {lr_label(lr)}" if lr is not None else "")
        title += ": " + " vs ".join(str(g).capitalize() for g in sorted(by_sharing, key=sharing_order))
        name = "acc-" + _slug(wf, task, scale_label(scale), _lr_slug(lr))
        written.append(plot_overlay(title, by_sharing, os.path.join(folder, name + ".png")))
    return written


def plot_runs(summaries: list, runs: dict, folder: str) -> list:
    """The cross-run figures into `folder`: map.png, one mech-*.png per cell, one acc-*.png
    per workflow, task and lr. Returns the paths written."""
    os.makedirs(folder, exist_ok=True)
    written = [plot_map(cells(summaries), os.path.join(folder, "map.png"))]
    written += _cell_figures(summaries, runs, folder) + _overlay_figures(summaries, runs, folder)
    return [p for p in written if p]


# ----------------------------------------------------------------------------- tables

def _pct(x, sign=False):
    if x is None:
        return "-"
    return f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}"


def _num(x, fmt=".3g"):
    return "-" if x is None else format(x, fmt)


def _per_role(d: dict, fmt=".3g", short=False) -> str:
    return ", ".join(f"{_abbrev(r) if short else r} {_num(v, fmt)}" for r, v in sorted(d.items())
                     if v is not None) or "-"


def _drift(d: dict, fmt=".3g") -> str:
    return ", ".join(f"{r} {_num(a, fmt)}->{_num(b, fmt)}" for r, (a, b) in sorted(d.items())) or "-"


def _pair(p, fmt=".3g") -> str:
    return "-" if not p else f"{_num(p[0], fmt)}->{_num(p[1], fmt)}"


def _cliff_cell(s: dict) -> str:
    return f"CLIFF@{s['cliff_step']}" if s["cliff"] else "no"


def _status(s: dict) -> str:
    return "done" if s["finished"] else f"unfinished ({s['steps_logged']}/{s['steps_planned'] or '?'})"


RUN_HEADERS = ["run", "cell", "status", "base", "peak", "@step", "final", "fin-base", "peak-base", "cliff"]


def run_legend(cliff_drop: float = CLIFF_DROP, cliff_window: int = CLIFF_WINDOW) -> str:
    return (f"accuracy %; base = step 0; peak = earliest max (@step); CLIFF@cliff step: last {cliff_window} evals "
            f"all >= {cliff_drop:g} pts below peak")


def _cell_label(s: dict) -> str:
    sharing = {"shared": "shr", "isolated": "iso"}.get(s["sharing"], s["sharing"] or "-")
    lr = f"/{lr_label(s['lr'])}" if s.get("lr") is not None else ""
    return f"{s['workflow'] or '-'}/{s['task'] or '-'}/{sharing}{lr}"


def run_rows(summaries: list) -> list:
    """The terminal run table (RUN_HEADERS): one compact row per run."""
    return [[s["name"], _cell_label(s), _status(s), _pct(s["base_acc"]), _pct(s["peak_acc"]),
             _num(s["peak_step"], "d"), _pct(s["final_acc"]), _pct(s["gain_final"], True),
             _pct(s["gain_peak"], True), _cliff_cell(s)] for s in summaries]


REPORT_RUN_HEADERS = ["run", "workflow", "task", "scale", "sharing", "lr", "seed", "status", "base", "peak",
                      "peak step", "final", "final-base", "peak-base", "cliff", "cliff step"]


def report_run_rows(summaries: list) -> list:
    return [[s["name"], s["workflow"] or "-", s["task"] or "-", scale_label(s["scale"]), s["sharing"] or "-",
             lr_label(s["lr"]), _num(s["seed"], "d"), _status(s), _pct(s["base_acc"]), _pct(s["peak_acc"]),
             _num(s["peak_step"], "d"), _pct(s["final_acc"]), _pct(s["gain_final"], True),
             _pct(s["gain_peak"], True), "CLIFF" if s["cliff"] else "no", _num(s["cliff_step"], "d")]
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
        out += f"±{100 * st['sd']:.1f}"
        if rng:
            out += f" ({_pct(st['min'], sign)}..{_pct(st['max'], sign)})"
    return out


CELL_HEADERS = ["workflow", "task", "scale", "sharing", "lr", "seeds", "base", "peak", "final", "final-base",
                "peak-base", "cliffs"]
CELL_LEGEND = "accuracy %, mean over seeds (±sd); cliffs = runs with a terminal cliff / runs"


def cell_rows(summaries: list, report: bool = False) -> list:
    """One row per (workflow, task, scale, sharing, lr); gains with ±sd (and min..max in the report)."""
    return [[c["workflow"] or "-", c["task"] or "-", scale_label(c["scale"]), c["sharing"] or "-", lr_label(c["lr"]),
             str(c["n"]), *(_stat(c[k], spread=report, rng=report) for k in CELL_STATS[:3]),
             *(_stat(c[k], True, rng=report) for k in CELL_STATS[3:]), f"{c['cliffs']}/{c['n']}"]
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
    rule = CLIFF_RULE.replace("N evaluations", f"{cliff_window} evaluations").replace("D points", f"{cliff_drop:g} points")
    return ["# Runs", "", "Accuracy in %. Base = step 0 (the untrained workflow); peak = the earliest step at the "
            f"maximum, step 0 included. Cliff: {rule}. Unfinished runs have no `done` file.", ""]


def _cells_section(summaries: list) -> list:
    return ["## Cells", "", CELL_LEGEND + "; (min..max) over seeds.", "",
            md_table(CELL_HEADERS, cell_rows(summaries, report=True)), ""]


def _pre_cliff_section(summaries: list) -> list:
    rows = pre_cliff_rows(summaries)
    if not rows:
        return ["## Before the cliff", "", "No run has a terminal cliff.", ""]
    return ["## Before the cliff", "", "For each run with a cliff: means over the training steps since the "
            "evaluation before the cliff step, or the last --pre-cliff-steps (just before), against every step "
            f"before those (earlier). Coherence rises in {_rises(summaries, 'coherence')} cliff runs and some "
            f"role's gradient norm in {_rises(summaries, 'grad_norm')}.", "", md_table(PRE_CLIFF_HEADERS, rows), ""]


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


def _write_plots(summaries: list, runs: dict, report: str | None, quiet: bool) -> list:
    """Each run's plots into its folder; with a report, the cross-run figures next to it."""
    try:
        for s in summaries:
            s["plots"] = plot_run(s["run"], run=runs[s["run"]], summary=s)
        return plot_runs(summaries, runs, figures_folder(report)) if report and summaries else []
    except ImportError as e:
        if not quiet:
            print(str(e), file=sys.stderr)
        return []


def analysis(folders: list, cliff_drop: float = CLIFF_DROP, cliff_window: int = CLIFF_WINDOW, plots: bool = True,
             report: str | None = None, quiet: bool = False, pre_cliff_steps: int | None = None) -> tuple:
    """(summaries, cross-run figures written) of every run folder among `folders`."""
    folders, notes = run_folders(folders)
    if not quiet:
        for note in notes:  # e.g. a shell glob that also caught report.md
            print(f"skipped: {note}", file=sys.stderr)
    runs = {f: load_run(f, quiet) for f in folders}
    summaries = [analyse_run(f, cliff_drop, cliff_window, run=runs[f], pre_cliff_steps=pre_cliff_steps)
                 for f in folders]
    figures = _write_plots(summaries, runs, report, quiet) if plots else []
    if report:
        write_report(summaries, report, cliff_drop, cliff_window, figures)
    return summaries, figures


def analyse(folders: list, cliff_drop: float = CLIFF_DROP, cliff_window: int = CLIFF_WINDOW, plots: bool = True,
            report: str | None = None, quiet: bool = False, pre_cliff_steps: int | None = None) -> list:
    """Summaries of every run folder among `folders`; plots written into each folder (when
    matplotlib is there), and a Markdown report with its figures at `report`. Used by sweep.py."""
    return analysis(folders, cliff_drop, cliff_window, plots, report, quiet, pre_cliff_steps)[0]


# ----------------------------------------------------------------------------- CLI: evaluate

def _is_checkpoint(path: str) -> bool:
    """A folder train.py's save_checkpoint wrote: state.pt (always), or LoRA adapter folders."""
    if not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, "state.pt")) or any(
        os.path.isfile(os.path.join(path, d, "adapter_config.json")) for d in os.listdir(path))


def resolve_checkpoint(path: str) -> tuple:
    """(checkpoint folder, its run folder, a note or None) for RUN/ckpt-N, or for a run folder
    RUN (its ckpt-best, else its ckpt-last); ValueError in one line for anything else."""
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise ValueError(f"--checkpoint {path}: no such folder; pass a run folder RUN, or RUN/ckpt-best or RUN/ckpt-last")
    if _is_checkpoint(path):
        return path, os.path.dirname(path), None
    if os.path.isfile(os.path.join(path, "config.json")):
        for name, why in (("ckpt-best", "its best evaluation"), ("ckpt-last", "no ckpt-best, so its last save")):
            if _is_checkpoint(os.path.join(path, name)):
                return os.path.join(path, name), path, f"checkpoint: {os.path.join(path, name)} ({why})"
        raise ValueError(f"--checkpoint {path}: the run has no checkpoint yet (no ckpt-best or ckpt-last)")
    raise ValueError(f"--checkpoint {path}: not a checkpoint; pass a run folder RUN, or RUN/ckpt-best or RUN/ckpt-last")


def _checkpoint_config(checkpoint: str, run_dir: str) -> dict:
    """How a checkpoint's run was configured: RUN/config.json, with rank and alpha from the
    adapters' own adapter_config.json when there."""
    cfg = read_config(run_dir)
    for name in sorted(os.listdir(checkpoint)):
        path = os.path.join(checkpoint, name, "adapter_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                a = json.load(f)
            cfg.update(lora_rank=a.get("r", cfg.get("lora_rank")), lora_alpha=a.get("lora_alpha", cfg.get("lora_alpha")))
            break
    return cfg


RUN_SETTINGS = ("workflow", "task", "scale", "sharing", "isolation", "max_new_tokens", "max_prompt_tokens",
                "max_embed_tokens")
FALLBACKS = {"scale": "toy", "sharing": "shared", "isolation": "lora"}


def resolve_settings(args) -> tuple:
    """(settings, notes): each of RUN_SETTINGS and data from the flag, else the checkpoint run's
    config.json, else the default; the test set is the run's --eval-data, else its --data."""
    import tasks
    checkpoint, run_dir, notes, cfg = None, None, [], {}
    if args.checkpoint:
        checkpoint, run_dir, note = resolve_checkpoint(args.checkpoint)
        notes += [note] if note else []
        cfg = _checkpoint_config(checkpoint, run_dir)
    st = {k: getattr(args, k) if getattr(args, k) is not None else cfg.get(k, FALLBACKS.get(k)) for k in RUN_SETTINGS}
    if not st["workflow"] or not st["task"]:
        raise ValueError("give --workflow and --task, or --checkpoint of a run that has them in its config.json")
    run_data = cfg.get("eval_data") or cfg.get("data")
    st.update(checkpoint=checkpoint, data=args.data or run_data or tasks.default_data(st["scale"], st["task"]),
              lora_rank=int(cfg.get("lora_rank", 64)), lora_alpha=float(cfg.get("lora_alpha", 32.0)))
    # scoring a run on its own evaluation set: the same subset, so the number compares with eval.jsonl
    st["problems"] = args.problems or (cfg.get("eval_problems") if run_data and st["data"] == run_data else None)
    default_new, default_prompt, default_embed = tasks.length_limits(st["scale"], st["task"])
    st["max_new_tokens"] = st["max_new_tokens"] or default_new
    st["max_prompt_tokens"] = st["max_prompt_tokens"] or default_prompt
    st["max_embed_tokens"] = st.get("max_embed_tokens") or default_embed
    taken = [k for k in (*RUN_SETTINGS, "data") if cfg.get(k) is not None and getattr(args, k) is None]
    if taken:
        notes.append(f"from {os.path.join(run_dir, 'config.json')}: " + ", ".join(f"{k} {st[k]}" for k in taken))
    return st, notes


def load_problems(data: str, kind: str, n: int | None, seed: int) -> tuple:
    """(test problems, note): the whole test split, or n drawn from it; n past its size is capped."""
    import tasks
    if tasks.task_kind(data) != kind:
        raise ValueError(f"--data {data} is not a {kind} data set")
    split = tasks.load_task(data, "test")
    if n is None or n >= len(split):
        note = f"--problems {n}: {data} has {len(split)} test problems; using all of them" if n and n > len(split) else None
        return split, note
    return tasks.load_task(data, "test", n, seed), None


def _make_llm(args, st: dict, kind: str):
    import torch

    import policies
    import rollout
    model, tokenizer = policies.load(st["scale"], device=args.device, toy_task=kind)
    policy = policies.Policy(model, tokenizer, workflows.ROLES[st["workflow"]], st["sharing"],
                             isolation=st["isolation"], rank=st["lora_rank"], alpha=st["lora_alpha"])
    if st["checkpoint"]:
        policy.load_adapters(st["checkpoint"])
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    return rollout.make_llm(policy, temperature=args.temperature, top_p=1.0, generator=gen,
                            max_new_tokens=st["max_new_tokens"], max_prompt_tokens=st["max_prompt_tokens"],
                            max_embed_tokens=st["max_embed_tokens"])


def _print_evaluation(res: dict):
    print(f"{res['workflow']} / {res['data']} ({res['task']}) / {res['scale']} / {res['checkpoint'] or 'base'}: "
          f"{res['problems']} problems x {res['samples']} samples, T={res['temperature']}")
    print(text_table(["k", "pass@k (%)"], [[k, _pct(v)] for k, v in res["pass@k"].items()]))
    q = res["quality"]
    print()
    print(text_table(["role", "calls", "len (chars)", "len (tokens)", "code-block rate", "fallbacks/call"],
                     [[r, d["calls"], _num(d["len_chars"], ".1f"), _num(d["len_tokens"], ".1f"),
                       _num(d["code_block_rate"], ".2f"), _num(d["fallbacks_per_call"], ".2f")]
                      for r, d in q["roles"].items()]))
    for role in ("evaluator", "aggregator", "orchestrator"):
        if role in q:
            print(f"{role}: " + ", ".join(f"{k} {_num(v, '.3f') if isinstance(v, float) else v}"
                                          for k, v in q[role].items()))
    for note in q["notes"]:
        print("note:", note)


def _evaluate_cli(args):
    """Thin glue: settings (flags, else the checkpoint's run) -> problems -> llm -> evaluate."""
    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        st, notes = resolve_settings(args)
        problems, note = load_problems(st["data"], st["task"], st["problems"], args.seed)
        llm = _make_llm(args, st, st["task"])
    except (ValueError, RuntimeError, OSError, ImportError, KeyError) as e:
        raise SystemExit(f"error: {e}")
    for n in notes + ([note] if note else []):
        print(n, file=sys.stderr)
    res = evaluate(llm, st["workflow"], problems, st["task"], samples=args.samples, batch_size=args.batch_size,
                   progress=not args.json)
    res.update(scale=st["scale"], checkpoint=st["checkpoint"], data=st["data"], temperature=args.temperature,
               sharing=st["sharing"], isolation=st["isolation"], max_new_tokens=st["max_new_tokens"],
               max_prompt_tokens=st["max_prompt_tokens"])
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        _print_evaluation(res)


# ----------------------------------------------------------------------------- CLI: analyse

def _analyse_cli(args):
    folders, notes = run_folders(args.runs)
    if not folders:
        raise SystemExit(f"error: no run folder among --runs: {'; '.join(notes)}")
    summaries, figures = analysis(args.runs, args.cliff_drop, args.cliff_window, plots=not args.no_plots,
                                  report=args.report, pre_cliff_steps=args.pre_cliff_steps)
    if args.json:
        print(json.dumps({"cliff_drop": args.cliff_drop, "cliff_window": args.cliff_window, "cliff_rule": CLIFF_RULE,
                          "runs": summaries, "cells": cells(summaries), "figures": figures}, indent=1))
        return
    for legend, headers, rows in ((run_legend(args.cliff_drop, args.cliff_window), RUN_HEADERS, run_rows(summaries)),
                                  (CELL_LEGEND, CELL_HEADERS, cell_rows(summaries)),
                                  (TERM_MECH_LEGEND, TERM_MECH_HEADERS, terminal_mechanism_rows(summaries))):
        print(text_table(headers, rows))
        print(legend + "\n")
    written = sum(len(s["plots"]) for s in summaries)
    if written:
        print(f"plots: {written} PNGs in the run folders (acc.png, grad.png, length.png)")
    if figures:
        print(f"figures: {len(figures)} PNGs (map, cells, Shared vs Isolated) in {figures_folder(args.report)}")
    if args.report:
        print(f"report: {args.report} (with per-role mechanisms, before-the-cliff and capture tables)")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown in --help, except None: those flags' help says what unset means."""
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def _parser():
    p = argparse.ArgumentParser(
        description="Evaluate a workflow (--workflow/--task/--scale, or --checkpoint) or analyse run folders (--runs).",
        epilog=f"Terminal cliff: {CLIFF_RULE}. Both --runs and --report write PNG plots (acc.png, grad.png, "
               "length.png into each run folder; with --report also the map and per-cell figures next to the "
               "report); --no-plots writes none. Run-folder format: docs/RUNFOLDER.md.",
        formatter_class=_Help)
    a = p.add_argument_group("analyse run folders")
    a.add_argument("--runs", nargs="+", help="run folders written by train.py to analyse (writes PNG plots into them)")
    a.add_argument("--cliff-drop", type=float, default=CLIFF_DROP,
                   help="cliff threshold: percentage points below the peak")
    a.add_argument("--cliff-window", type=int, default=CLIFF_WINDOW,
                   help="how many last evaluations must all lie after the peak and below the threshold")
    a.add_argument("--pre-cliff-steps", type=int, default=None,
                   help="training steps just before a cliff to compare with earlier ones (default: those since the "
                   "evaluation before the cliff step)")
    a.add_argument("--report", default=None, help="write a Markdown report of the runs to this path, and its figures "
                   "(map, per-cell mechanisms, Shared vs Isolated) next to it: runs/report.md -> runs/report-figures/")
    a.add_argument("--no-plots", action="store_true", help="write no PNG plots (neither --runs' nor --report's)")
    e = p.add_argument_group("evaluate a model or checkpoint (unset flags come from the checkpoint's run, else the default)")
    e.add_argument("--checkpoint", default=None, help="a run folder (its ckpt-best, else ckpt-last) or RUN/ckpt-N; "
                   "unset evaluates the base model")
    e.add_argument("--workflow", choices=sorted(workflows.WORKFLOWS), help="workflow to evaluate")
    e.add_argument("--task", choices=workflows.TASKS, help="task kind")
    e.add_argument("--data", default=None, help="data set name or .jsonl file (tasks.py); unset: the run's "
                   "--eval-data or --data, else toy_TASK at --scale toy, dapo_math / deepcoder otherwise")
    e.add_argument("--scale", default=None, help="toy, 0.6b, 1.7b, 4b, or a local model folder (default: toy)")
    e.add_argument("--sharing", default=None, choices=["shared", "isolated"], help="adapter sharing (default: shared)")
    e.add_argument("--isolation", default=None, choices=["lora", "full"], help="what a role's weights are (default: lora)")
    e.add_argument("--samples", type=int, default=1, help="episodes per problem; > 1 adds unbiased pass@k")
    e.add_argument("--problems", type=int, default=None, help="test problems to draw (capped at the split's size); "
                   "unset: the run's evaluation set, else the whole test split")
    e.add_argument("--batch-size", type=int, default=16, help="problems per rollout batch")
    e.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (the paper's 0.7)")
    e.add_argument("--max-new-tokens", type=int, default=None, help="completion length limit per call (default: "
                   "tasks.length_limits: 48 at --scale toy, the paper's 5120 math / 2048 code)")
    e.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="prompt length limit per call (default: the checkpoint run's, else 400 at --scale toy, else none)")
    e.add_argument("--max-embed-tokens", type=int, default=None,
                   help="tokens kept of a solution embedded in a later prompt (default: the checkpoint run's, "
                   "else none at --scale toy, else tasks.MAX_EMBED_TOKENS)")
    e.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    e.add_argument("--seed", type=int, default=0, help="seed of the sampler and the test subset")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    if args.cliff_window < 1 or args.cliff_drop < 0 or (args.pre_cliff_steps or 1) < 1:
        p.error("--cliff-window and --pre-cliff-steps must be >= 1 and --cliff-drop >= 0")
    if args.runs:
        _analyse_cli(args)
    elif args.checkpoint or (args.workflow and args.task):
        if min(args.samples, args.problems or 1, args.batch_size) < 1:
            p.error("--samples, --problems and --batch-size must be >= 1")
        _evaluate_cli(args)
    else:
        p.error("give --runs RUN [RUN ...] to analyse, or --checkpoint RUN, or --workflow and --task to evaluate")


if __name__ == "__main__":
    main()
