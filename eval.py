"""Evaluate a workflow, and analyse training runs: peaks, cliffs and role-level gradient dynamics.

Two modes.

Evaluate a base model or a checkpoint through a workflow on a test split:

    python eval.py --workflow voting --task math --scale toy [--checkpoint RUN/ckpt-best]
                   [--samples 4] [--problems 256] [--json]

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

Analyse run folders written by train.py (format in .notes/RUNFOLDER.md):

    python eval.py --runs runs/voting-math-* [--report runs/report.md] [--json]

- One row per run: workflow, task, scale, sharing, base accuracy (the step-0 evaluation, the
  untrained workflow), peak accuracy and its step (the earliest step reaching the maximum over
  all evaluations, step 0 included), final accuracy (last evaluation), gains final - base and
  peak - base, and the terminal-cliff flag. A run without a `done` file is marked unfinished
  (its numbers are what it had logged so far).
- Terminal cliff: the mean accuracy of the last `--cliff-window` evaluations (default 3) is at
  least `--cliff-drop` percentage points (default 10) below the peak, AND the peak comes
  before those last evaluations (the drop is after the peak). A run with no more evaluations
  than the window can therefore never be flagged.
- Mechanisms, from metrics.jsonl (any key may be missing in a step; missing values are skipped):
  * per-role mean gradient norm, and the ratio of the mean over supervisory roles (evaluator,
    aggregator, orchestrator: they judge or plan) to the mean over generator-like roles
    (generator, worker, synthesizer: they write solutions);
  * per-role mean gradient-mass share, and the dominant role: the role that holds the largest
    share in the most steps, with that fraction of steps and its longest run of consecutive
    steps; and the role that holds it most often in the last tenth of the steps (capture);
  * slot coherence ||sum_k g_k|| / sum_k ||g_k|| and the mean pairwise cosine of parallel
    same-role slots (1 means the slots push the role in one direction: amplified gradient);
  * drift between the first and the last tenth of the records (at least one record each):
    per-role output length in tokens (metrics.jsonl) and per-role code-block rate
    (eval.jsonl).
- PNG plots in each run folder (matplotlib, optional: `pip install matplotlib`):
  acc.png (evaluation accuracy, training reward, peak and cliff marked), grad.png (per-role
  gradient norm and mass share), length.png (per-role output length, code-block rate).
- `--report PATH` writes a Markdown report with the run table, a per-cell summary over seeds,
  the mechanism table and the plots.
"""
import argparse
import json
import math
import os
import sys
from collections import defaultdict

SUPERVISORY_ROLES = ("evaluator", "aggregator", "orchestrator")
GENERATOR_ROLES = ("generator", "worker", "synthesizer")
PLOT_NAMES = ("acc.png", "grad.png", "length.png")
# one colour per role in every plot, so a reader can follow a role from plot to plot
ROLE_COLORS = {"generator": "tab:blue", "worker": "tab:cyan", "synthesizer": "tab:green",
               "evaluator": "tab:orange", "aggregator": "tab:purple", "orchestrator": "tab:brown"}
MATPLOTLIB_MISSING = "plots need matplotlib, which is not installed: pip install matplotlib"


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
    import workflows
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


def role_quality(episodes: list, task: str, scored: dict | None = None) -> dict:
    """Per-role quality of a batch of workflows.Episode records against ground truth.

    Every solution a role judged or chose from is scored with rewards.score (batched once);
    `scored` maps (problem id, text) -> reward already known, to skip re-running code tests.
    Returns {"roles": {role: {"calls", "len_chars", "len_tokens", "code_block_rate",
    "fallbacks_per_call"}}, "evaluator": {...}, "aggregator": {...}, "orchestrator": {...},
    "notes": [...]}; a section is present only when its role appears."""
    import rewards
    import workflows
    parse_verdict, parse_choice, parse_strategies, notes = _parsers()
    scored = dict(scored or {})

    # pass 1: what needs a score (solutions judged by an evaluator or offered to an aggregator)
    need = {}
    for ep in episodes:
        for call in ep.calls:
            if call.role == "generator" and (ep.problem_id, call.text) not in scored:
                need[(ep.problem_id, call.text)] = ep.problem
    if need:
        keys = list(need)
        rs = rewards.score([t for _, t in keys], [need[k] for k in keys], task)
        scored.update({k: float(r) for k, r in zip(keys, rs)})
    correct = lambda ep, text: scored.get((ep.problem_id, text), 0.0) > 0.5  # noqa: E731

    per_role = defaultdict(lambda: {"calls": 0, "chars": 0, "tokens": 0, "all_ids": True, "blocks": 0})
    fallbacks = defaultdict(float)
    ev = {"calls": 0, "verdicts": 0, "tp": 0, "fp": 0, "fn": 0, "tn": 0}
    agg = {"calls": 0, "with_correct": 0, "picked_correct_given_any": 0, "picked_correct": 0, "resolved": 0}
    orch = {"calls": 0, "parsed": 0, "strategies": []}
    for ep in episodes:
        for role, n in (ep.fallbacks or {}).items():
            fallbacks[role] += _count(n)
        last_gen, candidates = None, []
        for i, call in enumerate(ep.calls):
            r = per_role[call.role]
            r["calls"] += 1
            r["chars"] += len(call.text)
            r["tokens"] += len(call.completion_ids or [])
            r["all_ids"] &= bool(call.completion_ids)
            r["blocks"] += rewards.last_code_block(call.text) is not None
            if call.role == "generator":
                last_gen = call.text
                candidates.append(call.text)
            elif call.role == "evaluator":
                ev["calls"] += 1
                if parse_verdict is None or last_gen is None:
                    continue
                said_correct, fallback = _unpack(parse_verdict(call.text))
                if fallback or said_correct is None:  # no verdict: counts in verdict_rate only
                    continue
                ev["verdicts"] += 1
                truth = correct(ep, last_gen)
                ev[("tp" if truth else "fp") if said_correct else ("fn" if truth else "tn")] += 1
            elif call.role == "aggregator":
                agg["calls"] += 1
                chosen = None
                if parse_choice is not None and candidates:
                    k, _ = _unpack(parse_choice(call.text, len(candidates)))
                    if isinstance(k, int) and 1 <= k <= len(candidates):  # 1-based, as \boxed{k}
                        chosen = candidates[k - 1]
                elif ep.final_text in candidates:  # Voting grades the chosen solution's text
                    chosen = ep.final_text
                if chosen is None:
                    continue
                agg["resolved"] += 1
                picked = correct(ep, chosen)
                agg["picked_correct"] += picked
                if any(correct(ep, t) for t in candidates):
                    agg["with_correct"] += 1
                    agg["picked_correct_given_any"] += picked
            elif call.role == "orchestrator":
                orch["calls"] += 1
                if parse_strategies is not None:
                    strategies, fallback = _unpack(parse_strategies(call.text))
                    # nothing parsed: the workflow substitutes one direct strategy, a fallback
                    none = fallback and list(strategies or []) == [getattr(workflows, "DIRECT_STRATEGY", None)]
                    k = 0 if none else len(strategies or [])
                else:  # one worker per parsed strategy; a failed parse still runs one worker
                    k = sum(c.role == "worker" for c in ep.calls[i + 1:])
                    k = k if _count((ep.fallbacks or {}).get("orchestrator")) == 0 else 0
                orch["parsed"] += k > 0
                orch["strategies"].append(k)

    div = lambda a, b: a / b if b else None  # noqa: E731
    out = {"roles": {}, "notes": notes}
    for role, r in sorted(per_role.items()):
        out["roles"][role] = {
            "calls": r["calls"],
            "len_chars": div(r["chars"], r["calls"]),
            "len_tokens": div(r["tokens"], r["calls"]) if r["all_ids"] else None,
            "code_block_rate": div(r["blocks"], r["calls"]),
            "fallbacks_per_call": div(fallbacks.get(role, 0.0), r["calls"]),
        }
    if ev["calls"]:
        out["evaluator"] = {
            "calls": ev["calls"], "verdict_rate": div(ev["verdicts"], ev["calls"]),
            "precision": div(ev["tp"], ev["tp"] + ev["fp"]), "recall": div(ev["tp"], ev["tp"] + ev["fn"]),
            "accuracy": div(ev["tp"] + ev["tn"], ev["verdicts"]),
            "confusion": {k: ev[k] for k in ("tp", "fp", "fn", "tn")},
        }
    if agg["calls"]:
        out["aggregator"] = {
            "calls": agg["calls"], "resolved": agg["resolved"],
            "selection_acc": div(agg["picked_correct_given_any"], agg["with_correct"]),
            "oracle_rate": div(agg["with_correct"], agg["resolved"]),
            "picked_correct_rate": div(agg["picked_correct"], agg["resolved"]),
        }
    if orch["calls"]:
        out["orchestrator"] = {"calls": orch["calls"], "parse_rate": div(orch["parsed"], orch["calls"]),
                               "mean_strategies": _mean(orch["strategies"])}
    return out


# ----------------------------------------------------------------------------- evaluate

def evaluate(llm, workflow: str, problems: list, task: str, samples: int = 1, batch_size: int = 16,
             progress: bool = True, **wf_params) -> dict:
    """Run `workflow` with `llm` on every problem `samples` times, score, and measure.

    Returns {"workflow", "task", "problems", "samples", "pass@k": {k: mean over problems},
    "quality": role_quality(...)}; "pass@1" is the mean per-problem fraction correct."""
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

    counts = defaultdict(lambda: [0, 0])  # problem id -> [n, c]
    for e in episodes:
        counts[e.problem_id][0] += 1
        counts[e.problem_id][1] += e.reward > 0.5
    pass_k = {}
    for k in _ks(samples):
        vals = [pass_at_k(n, c, k) for n, c in counts.values() if n >= k]
        pass_k[k] = _mean(vals)
    known = {(e.problem_id, e.final_text): e.reward for e in episodes}
    return {"workflow": workflow, "task": task, "problems": len(counts), "samples": samples,
            "episodes": len(episodes), "pass@k": pass_k,
            "quality": role_quality(episodes, task, scored=known)}


# ----------------------------------------------------------------------------- reading runs

def read_jsonl(path: str) -> list:
    """Records of a JSONL file; [] if missing. A run killed mid-write leaves a torn last line:
    lines that do not parse are skipped."""
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def load_run(folder: str) -> dict:
    """config, metrics and evaluations of one run folder, each sorted by step, one per step."""
    config = {}
    cpath = os.path.join(folder, "config.json")
    if os.path.isfile(cpath):
        try:
            with open(cpath) as f:
                config = json.load(f)
        except json.JSONDecodeError:
            config = {}

    def by_step(records):
        # a resumed run logs again from its last checkpoint: the later record of a step wins
        last = {r["step"]: r for r in records if isinstance(r.get("step"), (int, float))}
        return [last[s] for s in sorted(last)]

    return {"folder": folder, "config": config,
            "metrics": by_step(read_jsonl(os.path.join(folder, "metrics.jsonl"))),
            "evals": by_step(read_jsonl(os.path.join(folder, "eval.jsonl"))),
            "finished": os.path.isfile(os.path.join(folder, "done"))}


def accuracy_summary(evals: list, cliff_drop: float = 10.0, cliff_window: int = 3) -> dict:
    """Base, peak, final accuracy, gains and the terminal-cliff flag (see the module docstring).

    `evals` are eval.jsonl records sorted by step; `cliff_drop` is in percentage points."""
    pts = [(r["step"], float(r["acc"])) for r in evals if isinstance(r.get("acc"), (int, float))]
    out = {"n_evals": len(pts), "base_acc": None, "peak_acc": None, "peak_step": None,
           "final_acc": None, "final_step": None, "gain_final": None, "gain_peak": None,
           "tail_mean": None, "cliff": False}
    if not pts:
        return out
    base = next((a for s, a in pts if s == 0), None)
    peak_i = max(range(len(pts)), key=lambda i: (pts[i][1], -i))  # earliest index at the max
    out.update(base_acc=base, peak_acc=pts[peak_i][1], peak_step=pts[peak_i][0],
               final_acc=pts[-1][1], final_step=pts[-1][0])
    if base is not None:
        out["gain_final"] = pts[-1][1] - base
        out["gain_peak"] = pts[peak_i][1] - base
    w = min(cliff_window, len(pts))
    tail = [a for _, a in pts[-w:]]
    out["tail_mean"] = sum(tail) / len(tail)
    # 1e-9: 0.5 - 0.4 is 0.0999..., which must count as a drop of 10 points
    drop_ok = out["peak_acc"] - out["tail_mean"] >= cliff_drop / 100.0 - 1e-9
    out["cliff"] = bool(drop_ok and peak_i < len(pts) - w)
    return out


def _role_series(metrics: list, key: str) -> dict:
    """{role: [(step, value)]} for metrics[*]["roles"][role][key], skipping missing values."""
    out = defaultdict(list)
    for rec in metrics:
        for role, d in (rec.get("roles") or {}).items():
            v = d.get(key) if isinstance(d, dict) else None
            if isinstance(v, (int, float)) and math.isfinite(v):
                out[role].append((rec["step"], float(v)))
    return dict(out)


def _tenths(values: list):
    """(mean of the first tenth, mean of the last tenth), at least one value each."""
    if not values:
        return None
    k = max(1, len(values) // 10)
    return (sum(values[:k]) / k, sum(values[-k:]) / k)


def _longest_streak(seq: list, item) -> int:
    best = cur = 0
    for x in seq:
        cur = cur + 1 if x == item else 0
        best = max(best, cur)
    return best


def mechanisms(metrics: list, evals: list) -> dict:
    """Role-level dynamics of one run (see the module docstring); every field tolerates gaps."""
    norms = {r: _mean([v for _, v in s]) for r, s in _role_series(metrics, "grad_norm").items()}
    shares = {r: _mean([v for _, v in s]) for r, s in _role_series(metrics, "grad_share").items()}
    sup = _mean([v for r, v in norms.items() if r in SUPERVISORY_ROLES])
    gen = _mean([v for r, v in norms.items() if r in GENERATOR_ROLES])

    dominant = []  # one role per step that says who held the largest share
    for rec in metrics:
        d = rec.get("dominant_role")
        if not d:
            sh = {r: v.get("grad_share") for r, v in (rec.get("roles") or {}).items() if isinstance(v, dict)}
            sh = {r: s for r, s in sh.items() if isinstance(s, (int, float))}
            d = max(sh, key=sh.get) if sh else None
        if d:
            dominant.append(d)
    dom = dom_frac = dom_streak = dom_last = None
    if dominant:
        dom = max(sorted(set(dominant)), key=dominant.count)
        dom_frac = dominant.count(dom) / len(dominant)
        dom_streak = _longest_streak(dominant, dom)
        last = dominant[-max(1, len(dominant) // 10):]  # who holds it at the end (capture)
        dom_last = max(sorted(set(last)), key=last.count)

    coherence, slot_cos = defaultdict(list), defaultdict(list)
    for rec in metrics:
        for role, v in (rec.get("coherence") or {}).items():
            if isinstance(v, (int, float)):
                coherence[role].append(float(v))
        for role, pairs in (rec.get("slot_cos") or {}).items():
            vals = [float(v) for v in (pairs or {}).values() if isinstance(v, (int, float))]
            if vals:
                slot_cos[role].append(sum(vals) / len(vals))

    len_drift = {r: _tenths([v for _, v in s]) for r, s in _role_series(metrics, "len").items()}
    cb = defaultdict(list)
    for rec in evals:
        for role, v in (rec.get("code_block_rate") or {}).items():
            if isinstance(v, (int, float)):
                cb[role].append(float(v))
    return {
        "grad_norm": norms, "grad_share": shares,
        "grad_ratio_sup_gen": sup / gen if sup is not None and gen else None,
        "dominant_role": dom, "dominant_frac": dom_frac, "dominant_streak": dom_streak,
        "dominant_last": dom_last,
        "dominant_counts": {r: dominant.count(r) for r in sorted(set(dominant))},
        "coherence": {r: _mean(v) for r, v in coherence.items()},
        "slot_cos": {r: _mean(v) for r, v in slot_cos.items()},
        "len_drift": {r: v for r, v in len_drift.items() if v},
        "code_block_drift": {r: _tenths(v) for r, v in cb.items() if v},
    }


def analyse_run(folder: str, cliff_drop: float = 10.0, cliff_window: int = 3) -> dict:
    """One run folder -> one summary dict (table row, mechanisms, where its plots go)."""
    run = load_run(folder)
    cfg = run["config"]
    task = cfg.get("task")
    if cfg.get("data") and cfg.get("data") != task:
        task = f"{task}:{cfg['data']}"
    out = {"run": folder, "name": os.path.basename(os.path.normpath(folder)),
           "finished": run["finished"], "workflow": cfg.get("workflow"), "task": task,
           "scale": cfg.get("scale"), "sharing": cfg.get("sharing"), "seed": cfg.get("seed"),
           "steps_logged": run["metrics"][-1]["step"] if run["metrics"] else 0,
           "steps_planned": cfg.get("steps")}
    out.update(accuracy_summary(run["evals"], cliff_drop, cliff_window))
    out["mechanisms"] = mechanisms(run["metrics"], run["evals"])
    out["plots"] = []
    return out


# ----------------------------------------------------------------------------- plots

def _figure_class():
    try:
        from matplotlib.figure import Figure  # a bare Figure needs no GUI backend or pyplot state
    except ImportError:
        raise ImportError(MATPLOTLIB_MISSING) from None
    return Figure


def plot_run(folder: str, cliff_drop: float = 10.0, cliff_window: int = 3) -> list:
    """Write acc.png, grad.png and length.png into the run folder; returns the paths written.
    A plot with nothing to show (no evaluations, no gradient metrics) is not written."""
    Figure = _figure_class()
    run = load_run(folder)
    acc = accuracy_summary(run["evals"], cliff_drop, cliff_window)
    name = os.path.basename(os.path.normpath(folder))
    written = []

    pts = [(r["step"], 100 * r["acc"]) for r in run["evals"] if isinstance(r.get("acc"), (int, float))]
    if pts:
        fig = Figure(figsize=(7, 4))
        ax = fig.add_subplot()
        rew = [(r["step"], 100 * r["reward"]) for r in run["metrics"] if isinstance(r.get("reward"), (int, float))]
        if rew:
            ax.plot(*zip(*rew), color="0.75", lw=0.8, label="train reward")
        ax.plot(*zip(*pts), marker="o", ms=3, label="eval accuracy")
        if acc["base_acc"] is not None:
            ax.axhline(100 * acc["base_acc"], color="0.4", ls=":", lw=1, label="base (step 0)")
        ax.plot([acc["peak_step"]], [100 * acc["peak_acc"]], "*", ms=14, color="tab:green",
                label=f"peak {100 * acc['peak_acc']:.1f} @ {acc['peak_step']}")
        if acc["cliff"]:
            w = min(cliff_window, len(pts))
            ax.axvspan(pts[-w][0], pts[-1][0], color="tab:red", alpha=0.15)
            ax.hlines(100 * acc["tail_mean"], pts[-w][0], pts[-1][0], color="tab:red", lw=2,
                      label=f"cliff: last {w} mean {100 * acc['tail_mean']:.1f}")
        ax.set(xlabel="step", ylabel="accuracy (%)",
               title=f"{name}" + ("" if run["finished"] else " (unfinished)"))
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        written.append(_save(fig, folder, "acc.png"))

    norms, shares = _role_series(run["metrics"], "grad_norm"), _role_series(run["metrics"], "grad_share")
    if norms or shares:
        fig = Figure(figsize=(7, 6))
        ax1, ax2 = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2, sharex=None)
        for role, s in sorted(norms.items()):
            ax1.plot(*zip(*s), lw=1, label=role, color=ROLE_COLORS.get(role))
        if norms and all(v > 0 for s in norms.values() for _, v in s):
            ax1.set_yscale("log")  # supervisory and generator norms differ by several times
        ax1.set(ylabel="gradient norm", title=f"{name}: per-role gradient")
        for role, s in sorted(shares.items()):
            ax2.plot(*zip(*s), lw=1, label=role, color=ROLE_COLORS.get(role))
        ax2.set(xlabel="step", ylabel="gradient-mass share", ylim=(-0.02, 1.02))
        for ax in (ax1, ax2):
            if ax.lines:
                ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        written.append(_save(fig, folder, "grad.png"))

    lens = _role_series(run["metrics"], "len")
    cb = defaultdict(list)
    for r in run["evals"]:
        for role, v in (r.get("code_block_rate") or {}).items():
            if isinstance(v, (int, float)):
                cb[role].append((r["step"], v))
    if lens or cb:
        fig = Figure(figsize=(7, 6 if cb else 3.5))
        ax1 = fig.add_subplot(2 if cb else 1, 1, 1)
        for role, s in sorted(lens.items()):
            ax1.plot(*zip(*s), lw=1, label=role, color=ROLE_COLORS.get(role))
        ax1.set(xlabel="step", ylabel="mean output length (tokens)", title=f"{name}: per-role output")
        if cb:
            ax2 = fig.add_subplot(2, 1, 2)
            for role, s in sorted(cb.items()):
                ax2.plot(*zip(*s), marker="o", ms=3, lw=1, label=role, color=ROLE_COLORS.get(role))
            ax2.set(xlabel="step", ylabel="code-block rate (eval)", ylim=(-0.02, 1.02))
            ax2.legend(fontsize=7, loc="best")
        if ax1.lines:
            ax1.legend(fontsize=7, loc="best")
        fig.tight_layout()
        written.append(_save(fig, folder, "length.png"))
    return written


def _save(fig, folder, name):
    path = os.path.join(folder, name)
    fig.savefig(path, dpi=100)
    return path


# ----------------------------------------------------------------------------- tables and report

def _pct(x, sign=False):
    if x is None:
        return "-"
    return f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}"


def _num(x, fmt=".3g"):
    return "-" if x is None else format(x, fmt)


def _per_role(d: dict, fmt=".3g") -> str:
    return ", ".join(f"{r} {_num(v, fmt)}" for r, v in sorted(d.items()) if v is not None) or "-"


def _drift(d: dict, fmt=".3g") -> str:
    return ", ".join(f"{r} {_num(a, fmt)}->{_num(b, fmt)}" for r, (a, b) in sorted(d.items())) or "-"


RUN_HEADERS = ["run", "workflow", "task", "scale", "sharing", "status", "base", "peak", "peak step",
               "final", "final-base", "peak-base", "cliff"]


def run_rows(summaries: list) -> list:
    rows = []
    for s in summaries:
        status = "done" if s["finished"] else f"unfinished ({s['steps_logged']}/{s['steps_planned'] or '?'})"
        rows.append([s["name"], s["workflow"] or "-", s["task"] or "-", s["scale"] or "-", s["sharing"] or "-",
                     status, _pct(s["base_acc"]), _pct(s["peak_acc"]), _num(s["peak_step"], "d"),
                     _pct(s["final_acc"]), _pct(s["gain_final"], True), _pct(s["gain_peak"], True),
                     "CLIFF" if s["cliff"] else "no"])
    return rows


MECH_HEADERS = ["run", "grad norm", "sup/gen", "grad share", "dominant (frac, streak); last tenth", "coherence",
                "slot cos", "length first->last", "code-block first->last"]


def mechanism_rows(summaries: list) -> list:
    rows = []
    for s in summaries:
        m = s["mechanisms"]
        dom = "-" if m["dominant_role"] is None else \
            f"{m['dominant_role']} ({m['dominant_frac']:.2f}, {m['dominant_streak']}); last {m['dominant_last']}"
        rows.append([s["name"], _per_role(m["grad_norm"]), _num(m["grad_ratio_sup_gen"], ".2f"),
                     _per_role(m["grad_share"], ".2f"), dom, _per_role(m["coherence"], ".2f"),
                     _per_role(m["slot_cos"], ".2f"), _drift(m["len_drift"], ".0f"),
                     _drift(m["code_block_drift"], ".2f")])
    return rows


def cell_rows(summaries: list) -> list:
    """One row per (workflow, task, scale, sharing): means over its runs (seeds), cliffs k/n."""
    cells = defaultdict(list)
    for s in summaries:
        cells[(s["workflow"], s["task"], s["scale"], s["sharing"])].append(s)
    rows = []
    for key, ss in sorted(cells.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        rows.append([*(k or "-" for k in key), str(len(ss)),
                     _pct(_mean([s["base_acc"] for s in ss])), _pct(_mean([s["peak_acc"] for s in ss])),
                     _pct(_mean([s["final_acc"] for s in ss])), _pct(_mean([s["gain_final"] for s in ss]), True),
                     f"{sum(s['cliff'] for s in ss)}/{len(ss)}"])
    return rows


CELL_HEADERS = ["workflow", "task", "scale", "sharing", "runs", "base", "peak", "final", "final-base", "cliffs"]


def text_table(headers: list, rows: list) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def md_table(headers: list, rows: list) -> str:
    esc = lambda x: str(x).replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(out + ["| " + " | ".join(esc(x) for x in r) + " |" for r in rows])


def write_report(summaries: list, path: str, cliff_drop: float = 10.0, cliff_window: int = 3) -> str:
    """Markdown report: run table, per-cell table, mechanism table, then each run's plots."""
    base = os.path.dirname(os.path.abspath(path))
    parts = ["# Runs", "",
             f"Accuracy in %. Base = step 0 (untrained workflow); peak = earliest step at the maximum. "
             f"Cliff: the mean of the last {cliff_window} evaluations is at least {cliff_drop:g} points "
             f"below the peak, and the peak comes before them. Unfinished runs have no `done` file.", "",
             md_table(RUN_HEADERS, run_rows(summaries)), "", "## Cells (mean over seeds)", "",
             md_table(CELL_HEADERS, cell_rows(summaries)), "", "## Mechanisms", "",
             "Means over training steps. sup/gen = mean gradient norm of evaluator/aggregator/"
             "orchestrator over that of generator/worker/synthesizer. Dominant = role with the "
             "largest gradient-mass share in the most steps (fraction of steps, longest streak in "
             "steps); last = the role holding it most in the last tenth of steps. Coherence and slot cos are over parallel same-role slots. Drifts compare the "
             "first and last tenth of the records.", "",
             md_table(MECH_HEADERS, mechanism_rows(summaries)), ""]
    for s in summaries:
        if not s["plots"]:
            continue
        parts += [f"### {s['name']}", ""]
        for p in s["plots"]:
            rel = os.path.relpath(os.path.abspath(p), base)
            parts.append(f"![{s['name']} {os.path.basename(p)}]({rel})")
        parts.append("")
    os.makedirs(base, exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path


def analyse(folders: list, cliff_drop: float = 10.0, cliff_window: int = 3, plots: bool = True,
            report: str | None = None, quiet: bool = False) -> list:
    """Summaries of every run folder; plots written into each folder (when matplotlib is
    there), and a Markdown report at `report`. Used by the CLI and by sweep.py."""
    skipped = [f for f in folders if not os.path.isdir(f)]
    if skipped and not quiet:  # e.g. a shell glob that also caught report.md
        print(f"not run folders, skipped: {' '.join(skipped)}", file=sys.stderr)
    summaries = [analyse_run(f, cliff_drop, cliff_window) for f in folders if os.path.isdir(f)]
    if plots:
        try:
            for s in summaries:
                s["plots"] = plot_run(s["run"], cliff_drop, cliff_window)
        except ImportError as e:
            if not quiet:
                print(str(e), file=sys.stderr)
    if report:
        write_report(summaries, report, cliff_drop, cliff_window)
    return summaries


# ----------------------------------------------------------------------------- CLI

def _checkpoint_config(checkpoint: str) -> dict:
    """How a checkpoint's adapters were built: RUN/config.json next to RUN/ckpt-N, with rank
    and alpha from the adapters' own adapter_config.json when there."""
    cfg = {}
    path = os.path.join(os.path.dirname(os.path.normpath(checkpoint)), "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            cfg = json.load(f)
    for name in sorted(os.listdir(checkpoint)):
        path = os.path.join(checkpoint, name, "adapter_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                a = json.load(f)
            cfg.update(lora_rank=a.get("r", cfg.get("lora_rank")), lora_alpha=a.get("lora_alpha", cfg.get("lora_alpha")))
            break
    return cfg


def _evaluate_cli(args):
    """Thin glue: model -> policy (+ checkpoint) -> sampler-backed llm -> evaluate -> table."""
    import torch

    import policies
    import rollout
    import tasks
    import workflows

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = args.task
    data = args.data or tasks.default_data(args.scale, kind)
    try:
        if tasks.task_kind(data) != kind:
            raise ValueError(f"--data {data} is not a {kind} data set")
        problems = tasks.load_task(data, "test", args.problems, args.seed)
        model, tokenizer = policies.load(args.scale, device=args.device, toy_task=kind)
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        raise SystemExit(f"error: {e}")
    ck = _checkpoint_config(args.checkpoint) if args.checkpoint else {}
    policy = policies.Policy(model, tokenizer, workflows.ROLES[args.workflow], ck.get("sharing", args.sharing),
                             isolation=ck.get("isolation", "lora"), rank=int(ck.get("lora_rank", 64)),
                             alpha=float(ck.get("lora_alpha", 32.0)))
    if args.checkpoint:
        policy.load_adapters(args.checkpoint)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    # length limits: the flag, else the checkpoint's training run, else the toy / paper limits
    default_new, default_prompt, _ = tasks.length_limits(args.scale, kind)
    max_new = args.max_new_tokens or ck.get("max_new_tokens") or default_new
    max_prompt = args.max_prompt_tokens or ck.get("max_prompt_tokens") or default_prompt
    llm = rollout.make_llm(policy, temperature=args.temperature, top_p=1.0, generator=gen,
                           max_new_tokens=max_new, max_prompt_tokens=max_prompt)
    res = evaluate(llm, args.workflow, problems, kind, samples=args.samples, batch_size=args.batch_size,
                   progress=not args.json)
    res.update(scale=args.scale, checkpoint=args.checkpoint, data=data, temperature=args.temperature)
    if args.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{args.workflow} / {data} ({kind}) / {args.scale} / {args.checkpoint or 'base'}: "
          f"{res['problems']} problems x {res['samples']} samples, T={args.temperature}")
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


def _analyse_cli(args):
    summaries = analyse(args.runs, args.cliff_drop, args.cliff_window, plots=not args.no_plots,
                        report=args.report)
    if args.json:
        print(json.dumps({"cliff_drop": args.cliff_drop, "cliff_window": args.cliff_window,
                          "runs": summaries}, indent=1))
        return
    print(text_table(RUN_HEADERS, run_rows(summaries)))
    print()
    print(text_table(MECH_HEADERS, mechanism_rows(summaries)))
    if args.report:
        print(f"\nreport: {args.report}")


def main(argv=None):
    import workflows  # torch-free: the registry gives the workflow choices
    p = argparse.ArgumentParser(
        description="Evaluate a workflow (--workflow/--task/--scale) or analyse run folders (--runs).",
        epilog="Terminal cliff: the mean accuracy of the last --cliff-window evaluations is at least "
               "--cliff-drop percentage points below the peak, and the peak comes before those "
               "evaluations (the drop is after the peak).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument_group("analyse run folders")
    a.add_argument("--runs", nargs="+", help="run folders written by train.py to analyse")
    a.add_argument("--cliff-drop", type=float, default=10.0,
                   help="cliff threshold: percentage points between the peak and the mean of the last evaluations")
    a.add_argument("--cliff-window", type=int, default=3, help="how many last evaluations the cliff test averages")
    a.add_argument("--report", default=None, help="write a Markdown report of the runs to this path")
    a.add_argument("--no-plots", action="store_true", help="do not write PNG plots into the run folders")
    e = p.add_argument_group("evaluate a model or checkpoint")
    e.add_argument("--workflow", choices=sorted(workflows.WORKFLOWS), help="workflow to evaluate")
    e.add_argument("--task", choices=workflows.TASKS, help="task kind")
    e.add_argument("--data", default=None, help="data set name or .jsonl file (tasks.py); unset: toy_TASK at "
                   "--scale toy, dapo_math / deepcoder otherwise")
    e.add_argument("--scale", default="toy", help="toy, 0.6b, 1.7b, 4b, or a local model folder")
    e.add_argument("--checkpoint", default=None, help="RUN/ckpt-N folder with trained adapters; unset evaluates the base model")
    e.add_argument("--sharing", default="shared", choices=["shared", "isolated"],
                   help="adapter sharing of the checkpoint (RUN/config.json, when there, wins)")
    e.add_argument("--samples", type=int, default=1, help="episodes per problem; > 1 adds unbiased pass@k")
    e.add_argument("--problems", type=int, default=256, help="test problems to evaluate")
    e.add_argument("--batch-size", type=int, default=16, help="problems per rollout batch")
    e.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (the paper's 0.7)")
    e.add_argument("--max-new-tokens", type=int, default=None,
                   help="completion length limit per call; unset: the checkpoint's run, else 48 at --scale toy, "
                   "else the paper's 5120 (math) / 2048 (code)")
    e.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="prompt length limit per call; unset: the checkpoint's run, else 400 at --scale toy, else none")
    e.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    e.add_argument("--seed", type=int, default=0, help="seed of the sampler and the test subset")
    # output, both modes
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args(argv)

    if args.cliff_window < 1 or args.cliff_drop < 0:
        p.error("--cliff-window must be >= 1 and --cliff-drop >= 0")
    if args.runs:
        _analyse_cli(args)
    elif args.workflow and args.task:
        if min(args.samples, args.problems, args.batch_size) < 1:
            p.error("--samples, --problems and --batch-size must be >= 1")
        _evaluate_cli(args)
    else:
        p.error("give --runs RUN [RUN ...] to analyse, or --workflow and --task to evaluate")


if __name__ == "__main__":
    main()
