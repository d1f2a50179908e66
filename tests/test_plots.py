"""Tests of plots.py on synthetic run folders (no model): each run's PNGs, the cross-run figures
next to a report, and what the figures show (titles, panels). Tests that draw are skipped where
matplotlib is missing.

    python -m pytest -q tests/test_plots.py
"""
import json
import math
import os

import pytest

import analysis
import eval as ev
import plots
import workflows
from test_analysis import _run_with_metrics, synthetic_run, synthetic_sweep, write_run


# ----------------------------------------------------------------------------- each run's plots

def test_plots_written_and_not_empty(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    run = _run_with_metrics(tmp_path, "fall", [0.2, 0.4, 0.6, 0.3, 0.2, 0.1])
    paths = plots.plot_run(run)
    assert sorted(os.path.basename(p) for p in paths) == sorted(plots.PLOT_NAMES)
    for p in paths:
        with open(p, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 2000
    # a run with evaluations but no gradient metrics gets only its accuracy plot
    bare = write_run(tmp_path, "bare", [0.2, 0.3], metrics=[])
    assert [os.path.basename(p) for p in plots.plot_run(bare)] == ["acc.png"]
    # a plot that now has nothing to show does not stay behind from an earlier analysis
    open(os.path.join(bare, "grad.png"), "wb").close()
    plots.plot_run(bare)
    assert not os.path.exists(os.path.join(bare, "grad.png"))


def test_figures_name_the_cell_give_the_reward_its_own_panel_and_drop_empty_panels(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    from matplotlib.figure import Figure
    for task, has_code in (("math", False), ("code", True)):
        folder = synthetic_run(tmp_path, "voting", task, "isolated", seed=3, lr=2e-3, steps=10)
        run, s = analysis.load_run(folder), analysis.analyse_run(folder)
        acc = plots._draw_accuracy(Figure, run, s)
        assert acc.get_suptitle() == f"voting, {task}, isolated, seed 3, lr 2e-3: {s['outcome']}"
        assert [ax.get_ylabel() for ax in acc.axes] == ["eval accuracy (%)", "train reward (%)"]
        outputs = [ax.get_ylabel() for ax in plots._draw_outputs(Figure, run, s).axes]
        assert ("code-block rate (eval)" in outputs) is has_code  # all zero on math: no panel
        assert "parse-fail rate (eval)" in outputs


def test_the_supervisors_skill_and_the_cut_share_get_panels_where_the_evaluations_log_them(tmp_path):
    """acc.png: a panel per supervisor (the aggregator's picks with a random pick, the majority and
    the oracle; the evaluator's verdicts); length.png: the share cut at the cap. Logs of older
    runs, without them, draw neither."""
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    from matplotlib.figure import Figure
    folder = write_run(tmp_path, "skill", [0.2, 0.5])
    recs = [{"step": 5 * i, "acc": a, "n": 100, "calls": {"generator": 300, "aggregator": 100},
             "cut": {"generator": 30 - 25 * i}, "graded_cut": 10 - 8 * i, "uncut_correct": 20 + 30 * i,
             "skill": {"aggregator": {"resolved": 100, "picked": 20 + 30 * i, "majority": 25 + 20 * i,
                                      "with_correct": 60, "right_candidates": 60 + 90 * i, "candidates": 300}}}
            for i, a in enumerate([0.2, 0.5])]
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    run, s = analysis.load_run(folder), analysis.analyse_run(folder)
    acc = plots._draw_accuracy(Figure, run, s)
    assert [ax.get_ylabel() for ax in acc.axes] == ["eval accuracy (%)", "train reward (%)", "aggregator (%)"]
    lines = {line.get_label(): list(line.get_ydata()) for line in acc.axes[2].get_lines()}
    assert lines == {"picked": [20.0, 50.0], "random": [20.0, 50.0], "majority": [25.0, 45.0], "oracle": [60.0, 60.0]}
    cut = {ax.get_ylabel(): ax for ax in plots._draw_outputs(Figure, run, s).axes}["cut at the cap (eval)"]
    assert {line.get_label(): list(line.get_ydata()) for line in cut.get_lines()} == {
        "aggregator": [0.0, 0.0], "generator": [0.1, 5 / 300]}
    older = write_run(tmp_path, "older", [0.2, 0.5])
    run, s = analysis.load_run(older), analysis.analyse_run(older)
    assert [ax.get_ylabel() for ax in plots._draw_accuracy(Figure, run, s).axes] == ["eval accuracy (%)",
                                                                                     "train reward (%)"]


def test_rates_read_on_their_whole_range_and_coherence_against_orthogonal_slots(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    from matplotlib.figure import Figure
    folder = synthetic_run(tmp_path, "voting", "math", "isolated", steps=10)
    run, s = analysis.load_run(folder), analysis.analyse_run(folder)
    outputs = {ax.get_ylabel(): ax for ax in plots._draw_outputs(Figure, run, s).axes}
    assert outputs["parse-fail rate (eval)"].get_ylim() == (-0.02, 1.02)   # not 0-0.006
    grads = {ax.get_ylabel(): ax for ax in plots._draw_gradients(Figure, run, s).axes}
    coherence = grads["slot coherence"]
    labels = [t.get_text() for t in coherence.get_legend().get_texts()]
    assert "generator: 3 orthogonal slots, 1/sqrt(3)" in labels and "generator" in labels
    assert any(abs(line.get_ydata()[0] - 3 ** -0.5) < 1e-12 for line in coherence.get_lines())
    # no run with a cliff: no legend entry for one
    assert not any("cliff" in t.get_text() for ax in grads.values() if ax.get_legend()
                   for t in ax.get_legend().get_texts())


def test_an_integer_knob_has_integer_ticks(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    points = [{"lr": 2e-3, "value": n, "n": 2, "cliffs": 0, "peak": None, "final": None, "norm": {}, "share": {},
               "coherence": {}} for n in (1, 2, 4, 8)]
    path = plots.plot_dose(points, "n_voters", str(tmp_path / "dose.png"))
    assert _is_png(path)
    fig = plots.dose_figure(points, "n_voters")
    assert [t.get_text() for t in fig.axes[-1].get_xticklabels()] == ["1", "2", "4", "8"]


def test_damping_fields_are_summarised_and_get_a_panel(tmp_path):
    run = synthetic_run(tmp_path, sharing="shared", damp=True, steps=10)
    m = analysis.analyse_run(run)["mechanisms"]
    assert m["damp_cos"]["generator"] == pytest.approx(0.3 + 0.01 * 5.5)
    assert m["damp_scale"]["generator"] == pytest.approx(1 - 0.5 * (0.3 + 0.01 * 5.5))
    panels = lambda r: [y for y, ser in plots._mechanism_series(analysis.load_run(r)["metrics"]) if ser]  # noqa: E731
    assert plots.DAMP_LABEL in panels(run)
    assert plots.DAMP_LABEL not in panels(synthetic_run(tmp_path, sharing="shared", steps=10, name="plain"))


# ----------------------------------------------------------------------------- figures across runs

def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 5000


def test_report_and_figures_from_a_synthetic_sweep(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    root = tmp_path / "runs"
    folders = synthetic_sweep(root, tasks=("math",), wfs=("voting",), lrs=(1e-3, 2e-3), seeds=(0, 1))
    folders.append(synthetic_run(root, "eval_opt", "code", "isolated", steps=20))
    report = str(root / "report.md")
    summaries, figures = ev.analyse_runs(folders, report=report, quiet=True)
    names = sorted(os.path.basename(p) for p in figures)
    assert names == sorted(["map.png", "acc-voting-math-toy-lr1e-3.png", "acc-voting-math-toy-lr2e-3.png",
                            "acc-eval_opt-code-toy-lr1e-3.png", "mech-eval_opt-code-toy-isolated-lr1e-3.png"]
                           + [f"mech-voting-math-toy-{sh}-lr{lr}.png" for sh in ("shared", "isolated")
                              for lr in ("1e-3", "2e-3")])
    assert all(os.path.dirname(p) == str(root / "report-figures") and _is_png(p) for p in figures)
    assert all(len(s["plots"]) == 3 and all(_is_png(p) for p in s["plots"]) for s in summaries)
    text = open(report).read()
    for section in ("## Map", "## Cells", "## Shared against Isolated", "## Before the cliff",
                    "## Capture under Shared", "## Mechanisms", "## Mechanisms per cell", "## Runs"):
        assert section in text
    assert "| voting | math | toy | isolated | 2e-3 | 2 |" in text and "| 1 cliff, 0 collapse, 0 flat of 2 |" in text
    assert "Coherence rises in 1 of 1 cliff runs" in text
    assert text.index("## Map") < text.index("## Cells") < text.index("## Before the cliff")


@pytest.mark.parametrize("n_runs", [1, 12])
def test_every_text_of_the_map_lies_inside_the_figure(tmp_path, n_runs):
    pytest.importorskip("matplotlib")
    wfs = [(wf, sh) for wf in ("voting", "eval_opt", "orch_workers") for sh in ("shared", "isolated")]
    summaries = [analysis.analyse_run(synthetic_run(tmp_path, wf, task, sh)) for wf, sh in wfs[:max(1, n_runs // 2)]
                 for task in (("math", "code") if n_runs > 1 else ("math",))]
    fig = plots.map_figure(analysis.cells(analysis.label_variants(summaries)))
    fig.draw_without_rendering()   # runs the constrained layout, as savefig does
    box = fig.bbox
    for text in fig.findobj(lambda a: hasattr(a, "get_text") and a.get_text() and a.get_visible()):
        e = text.get_window_extent()
        if not all(map(math.isfinite, (e.x0, e.x1, e.y0, e.y1))):   # a tick outside the axis: not drawn
            continue
        assert box.x0 - 1 <= e.x0 and e.x1 <= box.x1 + 1 and box.y0 - 1 <= e.y0 and e.y1 <= box.y1 + 1, text.get_text()


def test_a_role_a_fork_registers_gets_a_colour_far_from_every_registered_one(monkeypatch):
    from matplotlib.colors import to_rgb
    monkeypatch.setitem(workflows.ROLE_KINDS, "judge", "supervisory")
    monkeypatch.setitem(workflows.ROLE_KINDS, "critic", "supervisory")
    new = [plots.role_color(r) for r in ("judge", "critic")]
    assert new[0] != new[1]
    for c in new:
        for known in plots.ROLE_COLORS.values():
            assert sum((a - b) ** 2 for a, b in zip(to_rgb(c), to_rgb(known))) ** 0.5 > 0.25, (c, known)
