"""Tests of analysis.py on synthetic run folders (no model): one run's summary and the cliff rule,
mechanisms, cells, tables, the report and broken run files. The synthetic run folders are built
here; test_eval.py and test_plots.py take them from this file.

    python -m pytest -q tests/test_analysis.py
"""
import json
import math
import os
import re

import pytest

import analysis
import eval as ev
import plots
import workflows


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
            rec["slot_cos"] = {"generator": {"generator0|generator1": 0.0, "generator0|generator2": 0.0,
                                             "generator1|generator2": 0.0}}
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


def _metric(step, roles, dominant=None, **extra):
    rec = {"step": step, "reward": 0.5, "roles": roles}
    if dominant:
        rec["dominant_role"] = dominant
    rec.update(extra)
    return rec


def _run_with_metrics(root, name, accs):
    metrics = [_metric(s, {"generator": {"grad_norm": 0.1 + 0.01 * s, "grad_share": 0.4, "len": 20.0 + s},
                           "aggregator": {"grad_norm": 0.5, "grad_share": 0.6, "len": 30.0}},
                       dominant="aggregator") for s in range(1, 5 * (len(accs) - 1) + 1)]
    folder = write_run(root, name, accs, metrics=metrics)
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        for i, a in enumerate(accs):
            f.write(json.dumps({"step": 5 * i, "acc": a, "code_block_rate": {"aggregator": 0.1 * i}}) + "\n")
    return folder


# ----------------------------------------------------------------------------- one run

def test_rising_curve_is_not_a_cliff(tmp_path):
    run = write_run(tmp_path, "rise", [0.20, 0.30, 0.45, 0.50, 0.50, 0.49])
    s = analysis.analyse_run(run)
    assert s["cliff"] is False
    assert s["base_acc"] == pytest.approx(0.20)
    assert (s["peak_acc"], s["peak_step"]) == (pytest.approx(0.50), 15)  # earliest step at the max
    assert s["final_acc"] == pytest.approx(0.49) and s["final_step"] == 25
    assert s["gain_final"] == pytest.approx(0.29) and s["gain_peak"] == pytest.approx(0.30)
    assert s["finished"] is True


def test_peak_then_fall_is_a_cliff(tmp_path):
    run = write_run(tmp_path, "fall", [0.20, 0.40, 0.60, 0.30, 0.20, 0.10])
    s = analysis.analyse_run(run, cliff_drop=10, cliff_window=3)
    assert s["cliff"] is True
    assert (s["peak_acc"], s["peak_step"]) == (pytest.approx(0.60), 10)
    assert s["tail_mean"] == pytest.approx(0.20)
    assert s["gain_final"] == pytest.approx(-0.10) and s["gain_peak"] == pytest.approx(0.40)
    # the same curve is not a cliff under a threshold larger than its 40-point drop
    assert analysis.analyse_run(run, cliff_drop=45, cliff_window=3)["cliff"] is False


def test_cliff_threshold_edges():
    evs = lambda accs: [{"step": 5 * i, "acc": a} for i, a in enumerate(accs)]  # noqa: E731
    # a drop of exactly the threshold counts (0.5 - 0.4 is 0.0999... in floating point)
    assert analysis.accuracy_summary(evs([0.3, 0.5, 0.4, 0.4, 0.4]), 10, 3)["cliff"] is True
    assert analysis.accuracy_summary(evs([0.3, 0.5, 0.41, 0.41, 0.41]), 10, 3)["cliff"] is False
    # a peak inside the last window is not a terminal cliff: the drop must come after the peak
    assert analysis.accuracy_summary(evs([0.2, 0.3, 0.5, 0.9, 0.1]), 10, 3)["cliff"] is False
    # fewer evaluations than the window: never a cliff; no evaluations at all: empty summary
    assert analysis.accuracy_summary(evs([0.9, 0.1]), 10, 3)["cliff"] is False
    empty = analysis.accuracy_summary([], 10, 3)
    assert empty["peak_acc"] is None and empty["cliff"] is False
    # no step-0 evaluation: no base, so no gains, but peak and final still known
    s = analysis.accuracy_summary([{"step": 5, "acc": 0.3}, {"step": 10, "acc": 0.4}], 10, 3)
    assert s["base_acc"] is None and s["gain_final"] is None and s["final_acc"] == pytest.approx(0.4)


def test_interrupted_run_is_unfinished(tmp_path):
    run = write_run(tmp_path, "cut", [0.2, 0.3, 0.35], done=False, torn=True, config={"steps": 500})
    s = analysis.analyse_run(run)
    assert s["finished"] is False
    assert s["n_evals"] == 3 and s["final_step"] == 10  # the torn line is skipped
    row = analysis.run_rows([s])[0]
    assert row[analysis.RUN_HEADERS.index("status")] == "unfinished (10/500)"
    # resumed from a checkpoint: steps logged twice count once, the later record wins
    with open(os.path.join(run, "eval.jsonl"), "a") as f:
        f.write("\n" + json.dumps({"step": 5, "acc": 0.5}) + "\n" + json.dumps({"step": 10, "acc": 0.1}) + "\n")
    s = analysis.analyse_run(run)
    assert s["n_evals"] == 3 and s["peak_acc"] == pytest.approx(0.5) and s["final_acc"] == pytest.approx(0.1)
    # a folder with nothing in it yet is tolerated too
    os.makedirs(tmp_path / "empty")
    e = analysis.analyse_run(str(tmp_path / "empty"))
    assert e["finished"] is False and e["peak_acc"] is None and e["workflow"] is None
    assert analysis.run_rows([e])[0][analysis.RUN_HEADERS.index("base")] == "-"


def test_peak_can_be_step_0(tmp_path):
    """The untrained workflow can be the best evaluation: the peak counts step 0."""
    s = analysis.analyse_run(write_run(tmp_path, "down", [0.375, 0.2, 0.188, 0.3]))
    assert s["peak_step"] == 0 and s["peak_acc"] == pytest.approx(0.375) and s["gain_peak"] == pytest.approx(0.0)
    assert s["cliff"] is False  # 0.3 is within 10 points of the peak


# ----------------------------------------------------------------------------- the cliff rule

def _curve(accs, every=5):
    return [{"step": every * i, "acc": a / 100} for i, a in enumerate(accs)]


CURVES = {  # accuracies (%) at steps 0, 5, 10, ...: (outcome, the fall's step)
    "steady rise": ([10, 20, 30, 40, 50, 60], "learned", None),
    "noisy plateau": ([20, 45, 52, 48, 55, 50, 53, 47], "learned", None),
    "noisy plateau, one low last reading": ([20, 50, 55, 48, 53, 44], "learned", None),
    "mid-run dip with recovery": ([20, 50, 60, 20, 15, 55, 58], "learned", None),
    "gentle decline": ([20, 60, 58, 56, 54, 52], "learned", None),
    "slow decline past the threshold": ([20, 60, 57, 54, 51, 48, 45, 42], "terminal cliff", 25),
    "collapse right after a late peak": ([20, 30, 40, 50, 64, 20, 10], "terminal cliff", 25),
    "dip, recovery, then collapse": ([20, 60, 30, 58, 20, 10], "terminal cliff", 20),
    "a rise of exactly the margin, then a fall": ([40, 50, 39, 38], "terminal cliff", 10),
    "peak at step 0, then collapse": ([60, 40, 30], "early collapse", 5),
    "a rise short of the margin, then collapse": ([50, 55, 40, 38], "early collapse", 10),
    "flat": ([50, 52, 49, 51], "did not learn", None),
    "a late rise short of the margin": ([50, 45, 52, 59], "did not learn", None),
}


@pytest.mark.parametrize("name", CURVES)
def test_outcome_rule_on_hand_made_curves(name):
    accs, outcome, step = CURVES[name]
    s = analysis.accuracy_summary(_curve(accs))  # the defaults: D = 10, M = 10, last 2 evaluations
    assert (s["outcome"], s["fall_step"]) == (outcome, step), name
    # the flags agree with the outcome: `cliff` is the terminal cliff alone
    assert s["cliff"] == (outcome == "terminal cliff") and s["collapse"] == (outcome == "early collapse")
    assert s["cliff_step"] == (step if s["cliff"] else None)


def test_the_deepest_dip_is_measured_from_the_best_evaluation_before_it():
    """DIP_RULE: a run that falls D points below its running best and comes back dipped; a run
    that ends down there fell instead (an outcome); a fall under D is measured but not counted."""
    s = analysis.accuracy_summary(_curve(CURVES["mid-run dip with recovery"][0]))   # 60 at step 10, 15 at 20
    assert (round(100 * s["dip"], 6), s["dip_from"], s["dip_step"], s["dipped"]) == (45, 10, 20, True)
    s = analysis.accuracy_summary(_curve(CURVES["dip, recovery, then collapse"][0]))
    assert (round(100 * s["dip"], 6), s["dip_from"], s["dip_step"], s["dipped"]) == (50, 5, 25, False)  # fell
    s = analysis.accuracy_summary(_curve([20, 50, 42, 45, 60]))
    assert (round(100 * s["dip"], 6), s["dipped"]) == (8, False)                     # under D = 10
    assert analysis.accuracy_summary(_curve([20, 50, 42, 45, 60]), 8)["dipped"]      # at D = 8 it counts
    assert analysis.accuracy_summary(_curve([50, 60, 70]))["dip"] == 0.0


def test_outcome_counts_keep_the_kinds_apart():
    runs = [analysis.accuracy_summary(_curve(CURVES[n][0])) for n in CURVES]
    counts = analysis.outcome_counts(runs)
    assert counts == {"terminal cliff": 4, "early collapse": 2, "did not learn": 2, "learned": 5}
    assert analysis.outcome_text(counts) == "4 cliff, 2 collapse, 2 flat of 13"


def test_learn_margin_decides_between_a_terminal_cliff_and_an_early_collapse():
    curve = _curve([40, 50, 39, 38])
    assert analysis.accuracy_summary(curve, learn_margin=10)["outcome"] == "terminal cliff"
    assert analysis.accuracy_summary(curve, learn_margin=11)["outcome"] == "early collapse"


def test_cliff_window_is_how_many_last_evaluations_must_agree():
    one_low = _curve([20, 50, 55, 48, 53, 44])
    assert analysis.accuracy_summary(one_low, 10, 1)["cliff_step"] == 25  # one reading is enough at window 1
    # the run: 64% then 20% and 10% in the last two evaluations; the old window-mean
    # rule (peak before the last 3) missed it, a window of 3 still does, as it must
    late = _curve([20, 30, 40, 50, 64, 20, 10])
    assert analysis.accuracy_summary(late, 10, 2)["cliff"] and not analysis.accuracy_summary(late, 10, 3)["cliff"]
    # both of the last two must be D points below 64: 20 is 44 points below, not 45
    assert analysis.accuracy_summary(late, 44, 2)["cliff"] is True and analysis.accuracy_summary(late, 45, 2)["cliff"] is False


# ----------------------------------------------------------------------------- mechanisms

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
    m = analysis.mechanisms(metrics, evals)
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
    row = analysis.mechanism_rows([{"name": "r", "mechanisms": m}])[0]
    assert m["dominant_last"] == "aggregator"
    assert "aggregator (0.75, 15); last aggregator" in row and "6.00" in row
    # no metrics at all: empty, not an error
    e = analysis.mechanisms([], [])
    assert e["dominant_role"] is None and e["grad_ratio_sup_gen"] is None and e["grad_norm"] == {}


def _zero_step(step, **kw):
    return _metric(step, {"generator": {"grad_norm": 0.0, "grad_share": 0.0},
                          "aggregator": {"grad_norm": 0.0, "grad_share": 0.0}}, **kw)


def test_a_step_without_gradient_has_no_dominant_role():
    assert analysis.step_dominant(_zero_step(1)) is None
    assert analysis.step_dominant(_zero_step(1, dominant="aggregator")) is None  # not even when a name was logged
    assert analysis.step_dominant({"step": 1, "roles": {"generator": {"len": 3.0}}}) is None  # no shares logged
    assert analysis.mechanisms([{"step": 1, "roles": {"generator": {"len": 3.0}}}], [])["no_grad_steps"] == 0
    m = analysis.mechanisms([_zero_step(s) for s in range(1, 6)], [])
    assert m["dominant_role"] is None and m["dominant_counts"] == {} and m["no_grad_steps"] == 5
    mixed = [_zero_step(1), _zero_step(2),
             _metric(3, {"generator": {"grad_share": 0.3}, "aggregator": {"grad_share": 0.7}})]
    m = analysis.mechanisms(mixed, [])
    assert (m["dominant_role"], m["dominant_frac"], m["no_grad_steps"]) == ("aggregator", 1.0, 2)


def test_role_groups_and_colours_come_from_the_workflow_registry(registries, tmp_path):
    # the orchestrator plans: it is in neither group of the supervisor / solution ratio
    assert analysis.sup_gen_ratio({"orchestrator": 10.0, "worker": 1.0, "synthesizer": 3.0}) is None
    assert analysis.sup_gen_ratio({"evaluator": 6.0, "generator": 1.0, "orchestrator": 100.0}) == pytest.approx(6.0)
    # a fifth workflow registered in workflows.py only: its new role is grouped by the kind it declares
    workflows.register("best_of_2", workflows.single, {"generator": ("generator0", "generator1"), "judge": ("judge",)},
                       kinds={"judge": "supervisory"})
    assert analysis.role_kind("judge") == "supervisory"
    assert analysis.sup_gen_ratio({"judge": 4.0, "generator": 2.0}) == pytest.approx(2.0)
    assert plots.role_color("aggregator") == plots.ROLE_COLORS["aggregator"]
    assert plots.role_color("judge") in plots.EXTRA_COLORS and plots.role_color("judge") == plots.role_color("judge")
    # its runs analyse like any other's (synthetic norms: judge ~0.6, generator ~0.1)
    s = analysis.analyse_run(synthetic_run(tmp_path, "best_of_2", steps=10))
    assert s["mechanisms"]["grad_ratio_sup_gen"] == pytest.approx(6.0, rel=0.3)
    assert [c["workflow"] for c in analysis.cells([s, analysis.analyse_run(synthetic_run(tmp_path, "voting", steps=10))])] \
        == ["voting", "best_of_2"]  # registry order


def test_sup_gen_ratio_uses_the_per_optimizer_step_norm():
    # Isolated Voting: the generator's step norm sums 3 optimizer steps, its per-step norm does not
    rec = lambda s: _metric(s, {  # noqa: E731
        "generator": {"grad_norm": 0.3, "grad_norm_opt": 0.1, "grad_norm_opt_max": 0.1 + 0.01 * s, "grad_share": 0.3},
        "aggregator": {"grad_norm": 0.6, "grad_norm_opt": 0.6, "grad_norm_opt_max": 0.6, "grad_share": 0.7}})
    m = analysis.mechanisms([rec(s) for s in range(1, 4)], [])
    assert m["grad_norm_key"] == "grad_norm_opt" and m["grad_ratio_sup_gen"] == pytest.approx(6.0)
    assert m["grad_norm_step"]["generator"] == pytest.approx(0.3)
    assert m["grad_norm_opt_max"]["generator"] == pytest.approx(0.13)
    assert analysis.terminal_mechanism_rows([{"name": "r", "mechanisms": m}])[0][1] == "opt"
    old = analysis.mechanisms([_metric(s, {"generator": {"grad_norm": 0.3}, "aggregator": {"grad_norm": 0.6}})
                         for s in range(1, 4)], [])
    assert old["grad_norm_key"] == "grad_norm" and old["grad_ratio_sup_gen"] == pytest.approx(2.0)
    assert analysis.terminal_mechanism_rows([{"name": "r", "mechanisms": old}])[0][1] == "step"
    assert analysis.mechanism_rows([{"name": "r", "mechanisms": old}])[0][1].startswith("(step) ")


def test_before_the_cliff_compares_the_steps_just_before_with_earlier(tmp_path):
    run = synthetic_run(tmp_path, collapse_at=30, steps=40, eval_every=5)
    s = analysis.analyse_run(run)
    assert (s["cliff"], s["peak_step"], s["cliff_step"]) == (True, 25, 30)
    p = s["pre_cliff"]
    assert p["steps"] == [26, 30] and p["grad_norm_key"] == "grad_norm_opt"  # since the evaluation before
    earlier, near = p["coherence"]["generator"]
    assert near == pytest.approx(0.9) and earlier < 0.62
    for role in ("generator", "aggregator"):
        earlier, near = p["grad_norm"][role]
        assert near > 2 * earlier
    assert analysis.analyse_run(run, pre_cliff_steps=2)["pre_cliff"]["steps"] == [29, 30]
    assert analysis.analyse_run(synthetic_run(tmp_path, steps=10, name="fine"))["pre_cliff"] is None
    row = analysis.pre_cliff_rows([s])[0]
    assert row[:4] == [s["name"], "30", "26-30", "opt"] and "generator 0.5" in row[4] and "->0.90" in row[4]


def test_capture_of_the_dominant_role_under_shared(tmp_path):
    s = analysis.analyse_run(synthetic_run(tmp_path, sharing="shared", steps=40))
    c = s["capture"]
    assert c["role"] == "aggregator"
    assert c["len"] == (pytest.approx(12.5), pytest.approx(48.5))  # 10 + step, steps 1-4 and 37-40
    assert c["parse_fail"] == (pytest.approx(0.0), pytest.approx(0.16))  # 9 evaluations: first and last
    assert c["code_block_rate"] == (0.0, 0.0)
    assert analysis.capture_rows([s])[0] == [s["name"], "aggregator (1.00)", "aggregator", "12.5->48.5", "0.00->0.16",
                                       "0.00->0.00"]
    assert analysis.analyse_run(synthetic_run(tmp_path, sharing="isolated", steps=10))["capture"] is None


# ----------------------------------------------------------------------------- cells and the report

def test_cells_are_keyed_by_lr_with_mean_spread_and_cliff_frequency(tmp_path):
    curves = {(1e-3, 0): [0.2, 0.4, 0.5], (1e-3, 1): [0.3, 0.5, 0.6],
              (2e-3, 0): [0.2, 0.6, 0.1, 0.1], (2e-3, 1): [0.2, 0.5, 0.5, 0.5]}
    summaries = [analysis.analyse_run(write_run(tmp_path, f"v-{lr}-{seed}", accs, config={"lr": lr, "seed": seed}))
                 for (lr, seed), accs in curves.items()]
    cs = analysis.cells(summaries)
    assert [(c["lr"], c["n"], c["cliffs"], c["seeds"]) for c in cs] == [(1e-3, 2, 0, [0, 1]), (2e-3, 2, 1, [0, 1])]
    base = cs[0]["base_acc"]
    assert (base["mean"], base["min"], base["max"]) == (pytest.approx(0.25), 0.2, 0.3)
    assert base["sd"] == pytest.approx(math.sqrt(0.005))
    assert cs[1]["gain_final"]["mean"] == pytest.approx(0.1) and cs[1]["gain_peak"]["max"] == pytest.approx(0.4)
    rows = analysis.cell_rows(summaries)
    assert [r[analysis.CELL_HEADERS.index("lr")] for r in rows] == ["1e-3", "2e-3"]
    assert [r[analysis.CELL_HEADERS.index("outcomes")] for r in rows] == ["0/0/0 of 2", "1/0/0 of 2"]
    assert analysis.cell_rows(summaries, report=True)[1][analysis.CELL_HEADERS.index("outcomes")] == \
        "1 cliff, 0 collapse, 0 flat of 2"
    # two seeds: their two values, no standard deviation
    assert rows[1][analysis.CELL_HEADERS.index("final-base")] == "+10.0 (-10.0..+30.0)"
    md = analysis.cell_rows(summaries, report=True)[1][analysis.CELL_HEADERS.index("final-base")]
    assert md == "+10.0 (-10.0..+30.0)"


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
    assert "terminal cliff" in text and "unfinished" in text
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


# ----------------------------------------------------------------------------- broken run files

def test_broken_run_files_get_one_warning_per_line(tmp_path, capsys):
    run = write_run(tmp_path, "broken", [0.2, 0.3, 0.4],
                    metrics=[{"step": 1, "reward": 0.5}, {"reward": 0.4}, {"step": 3, "reward": 0.3}])
    with open(os.path.join(run, "eval.jsonl"), "a") as f:
        f.write('{"step": 15, "n": 100}\n[1, 2]\n{"step": 20, "ac')  # no acc, not an object, torn
    s = analysis.analyse_run(run)
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
    assert analysis.read_jsonl(e, ("step", "acc"), quiet=True)[-1]["step"] == 10


def test_runs_that_differ_in_more_than_the_seed_are_cells_apart(tmp_path, capsys):
    # a baseline and an intervention with one seed, and a second seed of the baseline: two
    # cells, the intervention's labelled by what differs; the map and tables keep them apart
    base = {"kl_coef_role": {}, "coherence_damp": {}, "lr": 2e-3, "out": "a", "device": "cpu"}
    write_run(tmp_path, "base-s0", [0.5, 0.6, 0.7], config=base)
    write_run(tmp_path, "base-s1", [0.5, 0.62, 0.69], config={**base, "seed": 1, "out": "b", "kv_budget_gb": 1.0,
                                                              "grad_checkpointing": "on"})
    write_run(tmp_path, "kl-s0", [0.5, 0.4, 0.3], config={**base, "kl_coef_role": {"aggregator": 0.1},
                                                           "coherence_damp": {"generator": 0.5}})
    summaries, _ = ev.analyse_runs([str(tmp_path / n) for n in ("base-s0", "base-s1", "kl-s0")], plots=False, quiet=True)
    cs = analysis.cells(summaries)
    assert sorted((c["n"], c["seeds"], c["variant"]) for c in cs) == [
        (1, [0], "coherence-damp generator=0.5, kl-coef-role aggregator=0.1"),
        (2, [0, 1], "coherence-damp none, kl-coef-role none")]
    rows = analysis.cell_rows(summaries)
    assert sorted((r[5], r[-1]) for r in rows) == [("1", "coherence-damp generator=0.5, kl-coef-role aggregator=0.1"),
                                                   ("2", "coherence-damp none, kl-coef-role none")]
    # runs differing in nothing but the seed and the flags that change nothing make one cell
    alone = analysis.label_variants([s for s in summaries if s["name"].startswith("base")])
    assert [c["variant"] for c in analysis.cells(alone)] == [""]


def _with_config(folder, **cfg):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        c = json.load(f)
    c.update(cfg)
    with open(path, "w") as f:
        json.dump(c, f)
    return folder


def test_a_dose_response_is_a_point_per_lr_and_value_over_its_seeds(tmp_path, capsys):
    runs = [_with_config(synthetic_run(tmp_path, "voting", "math", "isolated", seed=s, lr=lr,
                                       name=f"v{n}-{lr:g}-s{s}", collapse_at=20 if (lr, n) == (2e-3, 8) else None),
                         n_voters=n)
            for n in (1, 3, 8) for lr in (1e-3, 2e-3) for s in (0, 1)]
    summaries, _ = ev.analyse_runs(runs, plots=False, quiet=True)
    points = analysis.dose(summaries, "n_voters")
    assert [(p["lr"], p["value"], p["n"]) for p in points] == [(lr, n, 2) for lr in (1e-3, 2e-3) for n in (1, 3, 8)]
    last = points[-1]
    assert last["cliffs"] == 2 and points[0]["cliffs"] == 0 and last["peak"]["n"] == 2
    # the synthetic collapse raises the voters' coherence (0.58 -> 0.9) in the steps before it
    assert set(last["norm"]) == {"generator", "aggregator"}
    assert last["coherence"]["generator"]["mean"] > points[0]["coherence"]["generator"]["mean"] + 0.02
    rows = analysis.dose_rows(points)
    assert rows[-1][:3] == ["2e-3", "8", "2"] and rows[-1][6] == "2 cliff, 0 collapse, 0 flat of 2"
    # an unset value is the paper's default: 3 voters
    default = analysis.dose_value({"config": {"n_voters": None}}, "n_voters")
    assert default == 3 and analysis.dose_value({"config": {"damp_placebo": True, "coherence_damp": {"g": 1}}},
                                                "damping") == "placebo"
    ev.main(["--runs", *runs, "--no-plots", "--dose", "n-voters", "--dose-figure", str(tmp_path / "dose.png")])
    out = capsys.readouterr().out
    assert "norm/opt step" in out and "knob n-voters" in out and "lr 2e-3: norm/opt step ~ n-voters^b, b = " in out
    b = analysis.dose_slope(points, 2e-3, "generator")   # exact on a power law: norm = N^-0.5
    power = [{**p, "norm": {"generator": {"mean": p["value"] ** -0.5}}} for p in points]
    assert b is not None and abs(analysis.dose_slope(power, 2e-3, "generator") + 0.5) < 1e-12
    if plots_available():
        assert os.path.isfile(tmp_path / "dose.png")
    # a run that differs in more than the knob, the lr and the seed is not a point of the curve
    shared = synthetic_run(tmp_path, "voting", "math", "shared", seed=0, lr=1e-3, name="shared-run")
    with pytest.raises(SystemExit) as e:
        ev.main(["--runs", *runs, shared, "--no-plots", "--dose", "n-voters"])
    assert "also differ in sharing" in str(e.value.code)
    # a knob that is no setting of the runs (a typo) is refused in one line
    with pytest.raises(SystemExit) as e:
        ev.main(["--runs", *runs, "--no-plots", "--dose", "n-voter"])
    assert "--dose n-voter: not a setting of these runs" in str(e.value.code) and "n-voters" in str(e.value.code)
    # a second run of a seed already there is counted once
    twin = _with_config(synthetic_run(tmp_path, "voting", "math", "isolated", seed=0, lr=1e-3, name="v1-twin-s0"),
                        n_voters=1)
    capsys.readouterr()
    twice = analysis.dose(ev.analyse_runs([*runs, twin], plots=False, quiet=True)[0], "n_voters")
    assert [p["n"] for p in twice] == [p["n"] for p in points] and twice[0]["seeds"] == [0, 1]
    assert "v1-twin-s0 repeats seed 0: counted once" in capsys.readouterr().err


def plots_available():
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def test_failure_signature_names_the_role_that_changed_first():
    """A run that learns, then falls: its evaluator's length leaves its 3 tokens at step 14 and
    stays, its fallback rate follows at step 16; the generator's share drifts by less than the
    threshold. A run that did not fall has no signature."""
    metrics = []
    for t in range(1, 31):
        ev_len = 3.0 if t < 14 else 40.0
        fb = 0.0 if t < 16 else 0.9
        metrics.append({"step": t, "roles": {"generator": {"len": 18.0, "grad_share": 0.7 + 0.001 * t},
                                             "evaluator": {"len": ev_len, "fallback_rate": fb,
                                                           "grad_share": 0.3 - 0.001 * t}}})
    evals = _curve([40, 60, 55, 20, 15, 10], every=6)   # peak at step 6, a terminal cliff
    s = analysis.accuracy_summary(evals)
    assert s["outcome"] == "terminal cliff"
    sig = analysis.failure_signature(metrics, s)
    assert [(t, r, k) for t, r, k, _, _ in sig] == [(14, "evaluator", "len"), (16, "evaluator", "fallback_rate")]
    assert sig[0][3:] == (3.0, 40.0)
    # a blip shorter than SUSTAIN steps is not a departure
    blip = [{"step": t, "roles": {"evaluator": {"len": 40.0 if t in (10, 11) else 3.0}}} for t in range(1, 31)]
    assert analysis.failure_signature(blip, s) == []
    assert analysis.failure_signature(metrics, analysis.accuracy_summary(_curve([40, 60, 62, 61]))) == []
    # a run that dipped and recovered is read the same way, against where it stood up to the best before the dip
    dipped = analysis.accuracy_summary(_curve([40, 60, 55, 20, 58, 59], every=6))
    assert dipped["dipped"] and [(t, r, k) for t, r, k, _, _ in analysis.failure_signature(metrics, dipped)] == \
        [(14, "evaluator", "len"), (16, "evaluator", "fallback_rate")]
    early = analysis.accuracy_summary(_curve([40, 60, 20, 58, 59, 60], every=6))    # its trough at step 12
    assert early["dipped"] and analysis.failure_signature(metrics, early) == []      # both moved after it


def test_eval_rates_read_the_counts_an_evaluation_logs_and_none_where_it_logs_none():
    rec = {"step": 10, "acc": 0.4, "n": 50, "calls": {"generator": 100, "evaluator": 60},
           "cut": {"generator": 5}, "graded_cut": 10, "uncut_correct": 20,
           "skill": {"evaluator": {"calls": 60, "tp": 20, "fp": 10, "fn": 5, "tn": 15}}}
    r = analysis.eval_rates(rec)
    assert r["cut"] == {"generator": 0.05, "evaluator": 0.0} and r["uncut_acc"] == 0.5     # 20 of 40 uncut
    assert r["verdict accuracy"] == 35 / 50 and r["false accept"] == 10 / 25 and r["false reject"] == 5 / 25
    assert r["verdicts"] == 50 / 60                          # 10 of its 60 calls gave no verdict
    assert r["accepts"] == 30 / 60 and r["decision J"] is None   # the attempts' grades not logged
    graded = analysis.eval_rates({**rec, "skill": {"evaluator": {**rec["skill"]["evaluator"], "judged": 60, "right": 28}}})
    assert graded["decision J"] == pytest.approx(20 / 28 - 10 / 32)   # accepted 20 of 28 right, 10 of 32 wrong
    assert r["picked"] is None and r["random"] is None       # no aggregator in this workflow
    old = analysis.eval_rates({"step": 0, "acc": 0.3, "n": 50, "calls": {"generator": 50}})
    assert all(v is None for v in old.values())             # an older run's record: nothing logged
    assert analysis.skill_series([rec]) == {"evaluator": {"verdicts": [(10, 50 / 60)], "accepts": [(10, 0.5)],
                                                          "verdict accuracy": [(10, 0.7)],
                                                          "false accept": [(10, 0.4)], "false reject": [(10, 0.2)]}}
    mute = analysis.eval_rates({**rec, "skill": {"evaluator": {"calls": 60, "tp": 0, "fp": 0, "fn": 0, "tn": 0}}})
    assert mute["verdicts"] == 0 and mute["verdict accuracy"] is None and mute["false accept"] is None
    assert mute["accepts"] == 0
