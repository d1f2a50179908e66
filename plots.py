"""The figures of run folders: each run's PNGs, the accuracy map, per-cell mechanisms, and
Shared against Isolated.

    python eval.py --runs runs/matrix/*                                  # each run's three PNGs
    python eval.py --runs runs/matrix/* --report runs/matrix/report.md   # and the cross-run figures

Runs are read and summarised by analysis.py (its docstring defines every quantity drawn here),
whose `analyse` calls this module as its plotting step; --no-plots draws nothing. Figures are
bare matplotlib Figures (no pyplot state, no GUI backend), and matplotlib is imported only when
one is drawn: without it, drawing raises ImportError with the one line "plots need matplotlib,
which is not installed: pip install matplotlib". A figure or panel with nothing to show is not
drawn.

Into each run folder (plot_run):
- acc.png: evaluation accuracy with the base (dotted), the peak (star), the run's outcome in
  the title (analysis.OUTCOME_RULE), and for a fall the line D points below the peak, the fall's
  step (dashed) and the stretch after it: red for a terminal cliff, grey for an early
  collapse; the training reward in its own panel; where the evaluations log them, the
  aggregator's picks against a random pick, the majority vote and the oracle, and the
  evaluator's verdict accuracy with its false accepts and rejects and its calls' shares that
  gave a verdict and that said Correct (analysis.eval_rates).
- grad.png: per-role gradient norm (per optimizer step when logged; log scale), gradient-mass
  share, slot coherence, and the coherence damping's scale (solid) and cosine (dashed); the
  cliff step marked.
- length.png: per-role length in tokens; the code-block, parse-fail and cut-at-the-cap rates
  of each evaluation when any is non-zero.
A PNG left by an earlier analysis that now has nothing to show is removed.

Next to a report at REPORT_DIR/STEM.md, into REPORT_DIR/STEM-figures/ (plot_runs):
- map.png: one panel per task, a row per workflow x sharing (x lr, x scale, when there are
  several), coloured by the mean final - base accuracy (diverging, centred at 0), with
  peak - base and the outcomes (terminal cliffs / early collapses / did not learn, of n) as
  text; ±sd with three seeds or more.
- mech-WORKFLOW-TASK-SCALE-SHARING-lrLR.png: a cell's grad.png panels and per-role length over
  training steps, seeds as mean and min..max band, each seed's cliff step marked.
- acc-WORKFLOW-TASK-SCALE-lrLR.png: evaluation accuracy and training reward of one workflow,
  task and lr, a line (mean, band) per sharing mode, a triangle at each seed's cliff step.

Colours: one per role in every figure (a role a fork adds gets one by a hash of its name),
Shared blue, Isolated orange, red kept for cliffs.
"""
import math
import os
import zlib
from collections import defaultdict

import workflows  # torch-free: the registry, for the colours of roles a fork adds

from analysis import (CELL_KEYS, CLIFF_DROP, CLIFF_WINDOW, analyse_run, cell_key, cell_order, cells, cut_series,
                      grad_key, is_num, keyed_series, load_run, lr_label, role_series, scale_label, sharing_order,
                      skill_series)

PLOT_NAMES = ("acc.png", "grad.png", "length.png")
# one colour per role in every plot, so a reader can follow a role from plot to plot
ROLE_COLORS = {"generator": "tab:blue", "worker": "tab:cyan", "synthesizer": "tab:green",
               "evaluator": "tab:orange", "aggregator": "tab:purple", "orchestrator": "tab:brown"}
# roles a fork registers get these in the order workflows.py registered them: hues far from
# every colour above (red is kept for cliffs)
EXTRA_COLORS = ("tab:pink", "tab:olive", "tab:gray", "gold", "black")
SHARING_COLORS = {"shared": "tab:blue", "isolated": "tab:orange"}
MATPLOTLIB_MISSING = "plots need matplotlib, which is not installed: pip install matplotlib"


def role_color(role: str) -> str:
    """The role's fixed colour; a role a fork registers gets the next of EXTRA_COLORS (one that
    is not registered at all, one derived from its name)."""
    if role in ROLE_COLORS:
        return ROLE_COLORS[role]
    extra = [r for r in workflows.ROLE_KINDS if r not in ROLE_COLORS]
    k = extra.index(role) if role in extra else zlib.crc32(role.encode())
    return EXTRA_COLORS[k % len(EXTRA_COLORS)]


def cell_title(c: dict, seed=True) -> str:
    """workflow, task, sharing[, seed S][, lr L] of a run summary or a cell."""
    parts = [str(c.get("workflow") or "?"), str(c.get("task") or "?"), str(c.get("sharing") or "?")]
    if seed and c.get("seed") is not None:
        parts.append(f"seed {c['seed']}")
    if c.get("lr") is not None:
        parts.append(f"lr {lr_label(c['lr'])}")
    if c.get("variant"):
        parts.append(c["variant"])
    return ", ".join(parts)


def _slug(*parts) -> str:
    return "-".join(str(p).replace(os.sep, "_").replace(":", "_").replace(" ", "") for p in parts
                    if p is not None and p != "")


# ----------------------------------------------------------------------------- plots of one run

def _figure_class():
    try:
        from matplotlib.figure import Figure  # a bare Figure needs no GUI backend or pyplot state
    except ImportError:
        raise ImportError(MATPLOTLIB_MISSING) from None
    return Figure


def _mark_cliffs(ax, steps, label=True, color="tab:red", name="cliff step"):
    for i, step in enumerate(steps):
        ax.axvline(step, color=color, ls="--", lw=1.2, label=name if label and i == 0 else None)


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
    skill = skill_series(run["evals"])
    title = cell_title(s) + (f": {s['outcome']}" if s.get("outcome") else "") + ("" if s["finished"] else " (unfinished)")
    ratios = [2.2] + [1] * bool(rew) + [1.4] * len(skill)
    fig, axes = _panels(Figure, len(ratios), title, ratios=ratios if len(ratios) > 1 else None)
    ax = axes[0]
    ax.plot(*zip(*pts), marker="o", ms=3, color="black", label="eval accuracy")
    if s["base_acc"] is not None:
        ax.axhline(100 * s["base_acc"], color="0.4", ls=":", lw=1, label=f"base {100 * s['base_acc']:.1f}")
    ax.plot([s["peak_step"]], [100 * s["peak_acc"]], "*", ms=14, color="tab:green",
            label=f"peak {100 * s['peak_acc']:.1f} @ {s['peak_step']}")
    if s.get("fell"):   # a terminal cliff in red; an early collapse (no learned peak) in grey
        color, name = ("tab:red", "cliff step") if s["cliff"] else ("0.45", "collapse step")
        ax.axhline(100 * s["cliff_line"], color=color, ls=":", lw=1, label="peak - cliff drop")
        ax.axvspan(s["fall_step"], s["final_step"], color=color, alpha=0.12)
        _mark_cliffs(ax, [s["fall_step"]], color=color, name=name)
    ax.set(ylabel="eval accuracy (%)")
    ax.grid(alpha=0.3)
    if rew:
        axes[1].plot(*zip(*rew), color="0.45", lw=1)
        axes[1].set(ylabel="train reward (%)")
        axes[1].grid(alpha=0.3)
    for ax, (who, series) in zip(axes[1 + bool(rew):], skill.items()):
        _skill_panel(ax, who, series)
    _finish(fig, axes)
    return fig


# the supervisors' skill against its references: the pick in the role's colour, the references grey
SKILL_STYLES = {"picked": ("-", None), "random": (":", "0.35"), "majority": ("--", "0.35"), "oracle": ("-.", "0.6"),
                "verdict accuracy": ("-", None), "false accept": ("--", "0.35"), "false reject": (":", "0.35"),
                "verdicts": ("-.", "0.6"), "accepts": ("-.", "0.3")}


def _skill_panel(ax, who: str, series: dict):
    """The aggregator's picks against a random pick, the majority and the oracle, or the
    evaluator's verdict accuracy with its false accepts and rejects and the shares of its calls
    that gave a verdict and that said Correct (analysis.eval_rates)."""
    for key, pts in series.items():
        ls, color = SKILL_STYLES[key]
        ax.plot([x for x, _ in pts], [100 * y for _, y in pts], ls=ls, marker="o", ms=2.5, lw=1.2,
                color=color or role_color(who), label=key)
    ax.set(ylabel=f"{who} (%)", ylim=(-2, 102))
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.grid(alpha=0.3)


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


def _coherence_note(ax, ylabel: str, metrics: list):
    """The coherence panel names its roles and draws, per role, what N orthogonal slot
    gradients give (1/sqrt(N), dotted); 1 is N slots pushing one way."""
    if ylabel != "slot coherence":
        return
    for role in sorted({r for m in metrics for r in (m.get("slot_cos") or {})}):
        pairs = next(m["slot_cos"][role] for m in reversed(metrics) if (m.get("slot_cos") or {}).get(role))
        n = len({slot for pair in pairs for slot in pair.split("|")})
        ax.axhline(n ** -0.5, color=role_color(role), ls=":", lw=1, label=f"{role}: {n} orthogonal slots, 1/sqrt({n})")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, loc="best")


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
        _coherence_note(ax, ylabel, run["metrics"])
        ax.grid(alpha=0.3)
        if ax is axes[0]:
            _log_axis(ax, [v for ser in series.values() for _, v in ser])
        _mark_cliffs(ax, [s["cliff_step"]] if s["cliff"] else [], label=ax is axes[0])
    _finish(fig, axes)
    return fig


def _draw_outputs(Figure, run: dict, s: dict):
    panels = [("length (tokens)", role_series(run["metrics"], "len")),
              ("code-block rate (eval)", _nonzero(keyed_series(run["evals"], "code_block_rate"))),
              ("parse-fail rate (eval)", _nonzero(keyed_series(run["evals"], "parse_fail"))),
              ("cut at the cap (eval)", _nonzero(cut_series(run["evals"])))]
    panels = [p for p in panels if p[1]]
    if not panels:
        return None
    fig, axes = _panels(Figure, len(panels), cell_title(s) + ": per-role output")
    for ax, (ylabel, series) in zip(axes, panels):
        _role_lines(ax, series, ylabel, marker="o" if "eval" in ylabel else None, ms=3)
        if "rate" in ylabel:   # a rate reads against its whole range, not an autoscaled sliver
            ax.set_ylim(-0.02, 1.02)
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
    wf, scale, sharing, lr, variant = row
    return " · ".join([str(wf), str(sharing)] + ([f"lr {lr_label(lr)}"] if several_lr else [])
                      + ([scale_label(scale)] if several_scales else []) + ([variant] if variant else []))


def _map_text(c: dict) -> tuple:
    """(final - base, peak - base, outcomes) of a cell as text; ±sd with three seeds or more.
    Outcomes: terminal cliffs / early collapses / runs that did not learn, of n."""
    def gain(st):
        return "-" if st is None else f"{100 * st['mean']:+.1f}" + (f" ±{100 * st['sd']:.1f}" if st["n"] > 2 else "")
    o = c.get("outcomes") or {"terminal cliff": c["cliffs"], "early collapse": 0, "did not learn": 0}
    return (gain(c["gain_final"]), gain(c["gain_peak"]),
            f"{'▼ ' if c['cliffs'] else ''}{o['terminal cliff']}/{o['early collapse']}/{o['did not learn']} of {c['n']}")


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
    ax.set_xticks([0, 1, 2], ["final - base", "peak - base", "cliff/collapse/flat"])
    ax.xaxis.tick_top()
    ax.set_title(f"task: {task}", fontsize=12)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(length=0)
    return im


def plot_map(cell_list: list, path: str) -> str | None:
    """One panel per task, the same rows in each (workflow x sharing, x lr when several),
    coloured by the mean final - base accuracy (diverging, centred at 0)."""
    fig = map_figure(cell_list)
    if fig is None:
        return None
    fig.savefig(path, dpi=110)
    return path


def map_figure(cell_list: list):
    """The map's Figure, or None when no cell has a gain."""
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm
    Figure = _figure_class()
    gains = [abs(100 * c["gain_final"]["mean"]) for c in cell_list if c["gain_final"]]
    if not gains:
        return None
    at = {(c["task"], c["workflow"], c["scale"], c["sharing"], c["lr"], c["variant"] or ""): c for c in cell_list}
    rows = sorted({k[1:] for k in at}, key=lambda r: cell_order((r[0], None, *r[1:])))
    task_names = sorted({k[0] for k in at}, key=str)
    v = max(max(gains), 1.0)
    norm, cmap = TwoSlopeNorm(0.0, -v, v), colormaps["RdBu"]
    # at least 2.8 in tall, so that the colour bar's label fits beside a map of few rows
    fig = Figure(figsize=(1.8 + 4.2 * len(task_names) + 1.0, max(2.8, 1.4 + 0.45 * len(rows))), layout="constrained")
    axes = fig.subplots(1, len(task_names), squeeze=False, sharey=True)[0]
    for ax, task in zip(axes, task_names):
        im = _map_panel(ax, [at.get((task, *r)) for r in rows], task, norm, cmap)
    axes[0].set_yticks(range(len(rows)), [_map_label(r, len({r[3] for r in rows}) > 1, len({r[1] for r in rows}) > 1)
                                           for r in rows])
    fig.colorbar(im, ax=list(axes), label="final - base (points)", shrink=0.9)
    several = max(c["n"] for c in cell_list) > 1
    # two lines: one panel (a single task) is too narrow for the whole title on one
    fig.suptitle("Accuracy map: gains in points" + (" (mean ±sd over seeds)" if several else "")
                 + "\ncliff/collapse/flat of n: terminal cliffs (▼), early collapses, did not learn", fontsize=12)
    return fig


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
    per sharing mode (or per arm of a study: a group named otherwise takes the next color);
    each seed's cliff step marked with a triangle."""
    Figure = _figure_class()
    fig, axes = _panels(Figure, 2, title, ratios=[2.2, 1])
    for i, (sharing, group) in enumerate(sorted(groups.items(), key=lambda kv: sharing_order(kv[0]))):
        color = SHARING_COLORS.get(sharing, f"C{i + 2}")
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
    if any(s["cliff"] for group in groups.values() for s, _ in group):
        axes[0].plot([], [], "v", color="white", mec="tab:red", label="cliff step (a seed)")
    _finish(fig, axes)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def plot_dose(points: list, knob: str, path: str, title: str | None = None) -> str | None:
    """The dose-response figure (dose_figure) saved at `path`; None without points."""
    if not points:
        return None
    dose_figure(points, knob, title).savefig(path, dpi=110, bbox_inches="tight")
    return path


def dose_figure(points: list, knob: str, title: str | None = None):
    """A dose-response figure: against the knob's value (x), one line per lr, mean over seeds
    with the min..max band: peak and final accuracy, the cliff rate, each role's gradient
    norm per optimizer step and share, and the coherence of roles with several slots."""
    Figure = _figure_class()
    xs_all = list(dict.fromkeys(p["value"] for p in points))
    numeric = all(is_num(x) for x in xs_all)
    pos = (lambda v: v) if numeric else (lambda v: xs_all.index(v))
    lrs = sorted({p["lr"] for p in points}, key=lambda x: x if is_num(x) else math.inf)
    fig, axes = _panels(Figure, 5, title or f"dose-response: {knob}", height=1.8)
    styles = ["-", "--", ":", "-."]
    for k, lr in enumerate(lrs):
        pts = [p for p in points if p["lr"] == lr]
        x = [pos(p["value"]) for p in pts]
        tag, ls = f"lr {lr_label(lr)}", styles[k % len(styles)]
        for key, color in (("peak", "tab:green"), ("final", "tab:blue")):
            _stat_line(axes[0], x, [p[key] for p in pts], color, f"{key}, {tag}", ls, scale=100)
        axes[1].plot(x, [p["cliffs"] / p["n"] for p in pts], ls=ls, marker="o", color="tab:red", label=tag)
        for ax, key in ((axes[2], "norm"), (axes[3], "share"), (axes[4], "coherence")):
            for role in sorted({r for p in pts for r in p[key]}):
                _stat_line(ax, x, [p[key].get(role) for p in pts], role_color(role), f"{role}, {tag}", ls)
    for ax, label in zip(axes, ("accuracy (%)", "cliff rate", "grad norm / opt step", "grad share", "coherence")):
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    axes[1].set_ylim(-0.05, 1.05)
    _log_axis(axes[2], [p["norm"][r]["mean"] for p in points for r in p["norm"] if p["norm"][r]])
    axes[-1].set_xlabel(knob.replace("_", "-"))
    if not numeric:
        axes[-1].set_xticks(range(len(xs_all)), [str(v) for v in xs_all])
    elif all(float(v).is_integer() for v in xs_all):   # voters, rounds, tokens: no ticks between
        axes[-1].set_xticks(sorted(xs_all), [f"{v:g}" for v in sorted(xs_all)])
    return fig


def plot_arms(title: str, arms: list, values: dict, path: str) -> str:
    """A study's arms side by side: for each measure of `values` {y label: {arm: [per seed]}}
    a panel with every seed as a dot and the mean ± standard error as a bar."""
    Figure = _figure_class()
    fig = Figure(figsize=(max(6.0, 1.0 + 0.9 * len(arms)), 1.4 + 2.4 * len(values)))
    axes = fig.subplots(len(values), 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title, fontsize=11)
    for ax, (measure, by_arm) in zip(axes, values.items()):
        for i, arm in enumerate(arms):
            ys = by_arm.get(arm) or []
            ax.plot([i + 0.12 * (j - (len(ys) - 1) / 2) for j in range(len(ys))], ys, "o", color="0.55", ms=4)
            if ys:
                m = sum(ys) / len(ys)
                se = (sum((y - m) ** 2 for y in ys) / (len(ys) - 1) / len(ys)) ** 0.5 if len(ys) > 1 else 0.0
                ax.errorbar([i], [m], yerr=[se], fmt="_", color="tab:blue", ms=18, mew=2, capsize=4)
        ax.set_ylabel(measure, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[-1].set_xticks(range(len(arms)), arms, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def plot_curves(title: str, panels: dict, path: str) -> str:
    """Accuracy curves side by side: `panels` {panel title: [(label, [(step, %)])]}, one line a
    run, coloured by the sharing mode its label starts with (Shared blue, Isolated orange)."""
    Figure = _figure_class()
    cols = min(len(panels), 4)
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(3.6 * cols, 1.0 + 2.6 * rows))
    axes = fig.subplots(rows, cols, sharey=True, squeeze=False).ravel()
    fig.suptitle(title, fontsize=11)
    for ax, (name, lines) in zip(axes, panels.items()):
        seen = set()
        for label, pts in lines:
            kind = label.split()[0]
            color = SHARING_COLORS.get(kind, "0.35")
            ax.plot(*zip(*pts), lw=1.0, color=color, alpha=0.8, label=None if kind in seen else kind)
            seen.add(kind)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax in axes[::cols]:
        ax.set_ylabel("eval accuracy (%)")
    for ax in axes[-cols:]:
        ax.set_xlabel("training step")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _stat_line(ax, x, stats, color, label, ls, scale=1.0):
    """Means with a min..max band, skipping points without a value."""
    pts = [(xi, st) for xi, st in zip(x, stats) if st]
    if not pts:
        return
    xs = [p for p, _ in pts]
    ax.plot(xs, [scale * st["mean"] for _, st in pts], ls=ls, marker="o", ms=3, color=color, label=label)
    ax.fill_between(xs, [scale * st["min"] for _, st in pts], [scale * st["max"] for _, st in pts], color=color,
                    alpha=0.12, lw=0)


def _lr_slug(lr):
    return lr and f"lr{lr_label(lr)}"


def _cell_figures(summaries: list, runs: dict, folder: str) -> list:
    """mech-WORKFLOW-TASK-SCALE-SHARING-lrLR.png for every cell."""
    written = []
    for c in cells(summaries):
        key = tuple(c[k] for k in CELL_KEYS)
        group = [(s, runs[s["run"]]) for s in summaries if cell_key(s) == key]
        name = "mech-" + _slug(c["workflow"], c["task"], scale_label(c["scale"]), c["sharing"], _lr_slug(c["lr"]),
                               c["variant"])
        written.append(plot_cell(c, group, os.path.join(folder, name + ".png")))
    return written


def _overlay_figures(summaries: list, runs: dict, folder: str) -> list:
    """acc-WORKFLOW-TASK-SCALE-lrLR.png: each sharing mode of a workflow, task and lr."""
    groups = defaultdict(lambda: defaultdict(list))
    for s in summaries:
        groups[(s["workflow"], s["task"], s["scale"], s["lr"], s.get("variant") or "")][s["sharing"]].append((s, runs[s["run"]]))
    written = []
    for (wf, task, scale, lr, variant), by_sharing in sorted(
            groups.items(), key=lambda kv: cell_order((*kv[0][:3], None, *kv[0][3:]))):
        title = ", ".join(str(x) for x in (wf, task) if x) + (f", lr {lr_label(lr)}" if lr is not None else "")
        title += (f", {variant}" if variant else "") + ": "
        title += " vs ".join(str(g).capitalize() for g in sorted(by_sharing, key=sharing_order))
        name = "acc-" + _slug(wf, task, scale_label(scale), _lr_slug(lr), variant)
        written.append(plot_overlay(title, by_sharing, os.path.join(folder, name + ".png")))
    return written


def plot_runs(summaries: list, runs: dict, folder: str) -> list:
    """The cross-run figures into `folder`: map.png, one mech-*.png per cell, one acc-*.png
    per workflow, task and lr. Returns the paths written."""
    os.makedirs(folder, exist_ok=True)
    written = [plot_map(cells(summaries), os.path.join(folder, "map.png"))]
    written += _cell_figures(summaries, runs, folder) + _overlay_figures(summaries, runs, folder)
    return [p for p in written if p]

