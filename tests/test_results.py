"""Results as data (studies.py): keeping finished runs' logs under results/, one commit and one
toy model per study, the arms' numbers and contrasts, and docs/RESULTS.md regenerated from
results/ alone (a drift between the page and the logs fails here)."""
import json
import math
import os

import pytest

import analysis
import intervals
import studies
from test_analysis import _with_config, synthetic_run

ORIGIN = {"commit": "a" * 40, "dirty": False, "model_sha256": "b" * 64, "torch": "2.13.0", "transformers": "5.24.0"}


@pytest.mark.parametrize("study", list(studies.STUDIES))
def test_the_results_page_is_what_the_kept_logs_give(study):
    block = studies.read_block(study)
    assert block is not None, f"docs/RESULTS.md has no block for {study}: python studies.py report {study} --write"
    assert block == studies.report_text(study), f"docs/RESULTS.md drifted from results/{study}/: " \
                                                f"python studies.py report {study} --write"


def finished(tmp_path, name, seed, accs, **cfg):
    folder = synthetic_run(tmp_path, "voting", "math", "isolated", seed=seed, lr=2e-3, accs=accs, steps=20,
                           eval_every=10, name=name)
    _with_config(folder, provenance=cfg.pop("provenance", ORIGIN), problems_per_step=16, group_size=8, **cfg)
    open(os.path.join(folder, "done"), "w").close()
    return folder


def kept_dirs(tmp_path, study="amplification"):
    """SWEEP/RUN of every run kept under tmp_path/results/STUDY."""
    root = tmp_path / "results" / study
    return sorted(os.path.relpath(r, root) for r in studies.kept_runs(study))


def test_keep_copies_the_logs_compresses_big_ones_and_keeps_one_origin(tmp_path, monkeypatch):
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    monkeypatch.setattr(studies, "GZIP_OVER", 2000)   # the synthetic metrics pass it, the eval log does not
    runs = tmp_path / "runs"
    a = finished(runs, "n8-s0", 0, [0.5, 0.6, 0.3], n_voters=8, mini_batch=128)
    kept = studies.keep("amplification", a)
    assert sorted(os.listdir(kept)) == ["config.json", "done", "eval.jsonl", "metrics.jsonl.gz"]
    assert analysis.load_run(kept)["metrics"] == analysis.load_run(a)["metrics"]   # read back through gzip
    other = finished(runs, "n8-s1", 1, [0.5, 0.6, 0.6], n_voters=8, provenance={**ORIGIN, "commit": "c" * 40})
    with pytest.raises(ValueError, match="differ from the study's runs"):
        studies.keep("amplification", other)
    os.remove(os.path.join(a, "done"))
    with pytest.raises(ValueError, match="not finished"):
        studies.keep("amplification", a)


def test_two_arms_whose_cells_share_a_name_are_kept_apart(tmp_path, monkeypatch):
    """sweep.py names a cell by its axes, so N=8 and N=8 with the aggregator frozen (a
    pass-through --lr-role) are both voting-...-n-voters8-s0: kept by arm and seed, neither
    replaces the other."""
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    plain = finished(tmp_path / "a", "cell-s0", 0, [0.5, 0.6, 0.3], n_voters=8, mini_batch=128)
    frozen = finished(tmp_path / "b", "cell-s0", 0, [0.5, 0.6, 0.6], n_voters=8, mini_batch=128,
                      lr_role={"aggregator": 0.0})
    kept = [os.path.basename(studies.keep("amplification", r)) for r in (plain, frozen)]
    assert kept == ["cell-s0", "cell-s0"] and kept_dirs(tmp_path) == ["a/cell-s0", "b/cell-s0"]
    assert sorted(studies.arms("amplification")) == ["N=8", "N=8, aggregator frozen"]


def test_the_figure_shows_each_seed_and_the_studys_mechanism(tmp_path, monkeypatch):
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    monkeypatch.setattr(studies, "FIGURES", str(tmp_path / "figures"))
    for seed, (final, move) in enumerate([(0.3, 0.5), (0.4, 0.7)]):
        folder = finished(tmp_path / "runs", f"n8-{seed}", seed, [0.5, 0.6, final], n_voters=8, mini_batch=128)
        path = os.path.join(folder, "metrics.jsonl")
        rows = analysis.read_jsonl(path)
        for r in rows:
            r["roles"]["generator"]["displacement"] = move
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        studies.keep("amplification", folder)
    names, values = studies.figure_values("amplification")
    assert names == ["N=8"]
    assert values["final accuracy (%)"] == {"N=8": [pytest.approx(30.0), pytest.approx(40.0)]}
    assert values["peak accuracy (%)"] == {"N=8": [pytest.approx(60.0), pytest.approx(60.0)]}
    assert values["generator adapter's ‖Δθ‖ / step"] == {"N=8": [pytest.approx(0.5), pytest.approx(0.7)]}
    assert studies.write_figure("amplification") == str(tmp_path / "figures" / "study-amplification.png")
    assert os.path.getsize(tmp_path / "figures" / "study-amplification.png") > 0
    assert studies.write_figure("capture") is None                  # no runs: no figure


def test_keep_given_a_sweeps_folder_keeps_its_finished_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    sweep = tmp_path / "sweep"
    finished(sweep, "voting-n-voters8-s0", 0, [0.5, 0.6, 0.3], n_voters=8, mini_batch=128)
    finished(sweep, "voting-n-voters8-s1", 1, [0.5, 0.6, 0.4], n_voters=8, mini_batch=128)
    os.remove(sweep / "voting-n-voters8-s1" / "done")                # still running
    (sweep / "logs").mkdir()
    (sweep / "logs" / "voting-n-voters8-s0.log").write_text("a cell's log\n")
    studies.main(["keep", "amplification", str(sweep)])
    out, err = capsys.readouterr()
    assert kept_dirs(tmp_path) == ["sweep/voting-n-voters8-s0"]
    assert out.count("kept ") == 1 and "not finished" in err and "voting-n-voters8-s1" in err


def test_capture_keeps_one_toy_model_per_check_length(tmp_path, monkeypatch):
    """--toy-check L warm-starts a toy model per L: capture's runs differ in the model by
    design, and within one L a second model is refused."""
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))

    def run(name, seed, check, sha):
        folder = synthetic_run(tmp_path / "runs", "voting", "math", "shared", seed=seed, lr=2e-3, steps=20,
                               eval_every=10, accs=[0.5, 0.6, 0.4], name=name)
        _with_config(folder, provenance={**ORIGIN, "model_sha256": sha * 64}, toy_check=check)
        open(os.path.join(folder, "done"), "w").close()
        return folder

    studies.keep("capture", run("l0-s0", 0, 0, "b"))
    studies.keep("capture", run("l24-s0", 0, 24, "c"))
    studies.keep("capture", run("l24-s1", 1, 24, "c"))
    with pytest.raises(ValueError, match="differ from the study's runs"):
        studies.keep("capture", run("l24-s2", 2, 24, "d"))
    assert kept_dirs(tmp_path, "capture") == ["runs/l0-s0", "runs/l24-s0", "runs/l24-s1"]
    assert ("from commit aaaaaaa and toy model bbbbbbbbbbbb (toy_check 0), not shipped; commit aaaaaaa and toy "
            "model cccccccccccc (toy_check 24), not shipped") in studies.report_text("capture")


def test_capture_contrasts_the_gain_and_the_drop_where_toy_models_start_apart(tmp_path, monkeypatch):
    """Each L starts from its own toy model: besides final minus final, capture contrasts each
    run's gain over its own step 0 and its drop from its peak, and its table shows the gain."""
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    accs = {(0, 0): [0.40, 0.50, 0.50], (0, 1): [0.44, 0.50, 0.48],     # gains 10, 4; drops 0, 2
            (24, 0): [0.30, 0.36, 0.30], (24, 1): [0.34, 0.40, 0.36]}   # gains 0, 2; drops 6, 4
    for (check, seed), a in accs.items():
        folder = synthetic_run(tmp_path / "runs", "eval_opt", "math", "shared", seed=seed, lr=2e-3, steps=20,
                               eval_every=10, accs=a, name=f"l{check}-s{seed}")
        _with_config(folder, provenance={**ORIGIN, "model_sha256": ("c" if check else "b") * 64}, toy_check=check)
        open(os.path.join(folder, "done"), "w").close()
        studies.keep("capture", folder)
    lines = studies.report_text("capture").splitlines()

    def contrast(measure):
        return next(x for x in lines if x.startswith(f"- {measure}, eval_opt, L=24 minus eval_opt, L=0, unpaired"))
    # two seeds an arm: the difference, and no interval (an arm of 2 gives none)
    assert contrast("final accuracy").endswith(": -16.0 (n = 2 and 2: too few for an interval); "
                                               "too few units for an interval: not told apart")   # 33 against 49
    assert ": -6.0 (n = 2 and 2" in contrast("the gain (final minus step 0)")   # 1 against 7
    assert ": +4.0 (n = 2 and 2" in contrast("the drop from the peak")          # 5 against 1
    assert not any("L=8 minus" in x for x in lines)                          # an arm without runs: no contrast
    assert not any("paired by seed" in x for x in lines)   # each L is its own toy model: its seeds are not pairs
    assert "| final - base | peak - final |" in lines[2]
    assert "| eval_opt, L=24 | 0,1 | 32.0 (n=2) | 38.0 (n=2) | 33.0 (n=2) | 1.0 (n=2) | 5.0 (n=2) | 0/0/2 of 2 |" \
        in "\n".join(lines)
    names, values = studies.figure_values("capture")                      # the figure shows the same measures
    assert list(values)[:3] == ["final accuracy (%)", "final - step 0 (points)", "peak - final (points)"]
    assert values["final - step 0 (points)"]["eval_opt, L=24"] == [pytest.approx(0.0), pytest.approx(2.0)]
    assert values["peak - final (points)"]["eval_opt, L=0"] == [pytest.approx(0.0), pytest.approx(2.0)]


def test_restore_puts_kept_runs_back_where_a_sweep_rerun_skips_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    monkeypatch.setattr(studies, "GZIP_OVER", 2000)   # the metrics are kept compressed
    old = tmp_path / "old-machine" / "study" / "runs" / "amplification"
    run = finished(old, "voting-n-voters8-s0", 0, [0.5, 0.6, 0.3], n_voters=8, mini_batch=128)
    _with_config(run, out=run)
    studies.keep("amplification", run)
    new = tmp_path / "new-machine" / "study"
    (cell,) = studies.restore("amplification", str(new))
    assert cell == str(new / "runs" / "amplification" / "voting-n-voters8-s0")
    assert sorted(os.listdir(cell)) == ["config.json", "done", "eval.jsonl", "metrics.jsonl"]
    for f in ("config.json", "eval.jsonl", "metrics.jsonl"):
        assert open(os.path.join(cell, f), "rb").read() == open(os.path.join(run, f), "rb").read()
    assert studies.restore("amplification", str(new)) == []        # already there: left alone
    assert "already there" in capsys.readouterr().err


def test_arms_contrasts_and_the_table(tmp_path, monkeypatch):
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    runs = tmp_path / "runs"
    finals = {("N=8", 0): 0.30, ("N=8", 1): 0.40, ("N=8", 2): 0.41, ("N=1", 0): 0.50, ("N=1", 1): 0.56,
              ("N=1", 2): 0.52, ("N=8, equal steps", 0): 0.45, ("N=8, equal steps", 1): 0.49}
    for (arm, seed), final in finals.items():
        n = int(arm.split(",")[0][2:])
        extra = {"mini_batch": 1024} if "equal" in arm else {"mini_batch": 128}
        folder = finished(runs, f"{arm}-{seed}".replace(" ", "").replace(",", "-").replace("=", ""), seed,
                          [0.5, 0.6, final, final], n_voters=n, **extra)
        studies.keep("amplification", folder)
    text = studies.report_text("amplification")
    line = next(x for x in text.splitlines() if x.startswith("- final accuracy, N=8 minus N=1,"))
    # paired by seed: 30 - 50, 40 - 56, 41 - 52 = -20, -16, -11: mean -15.67, sd 4.509, se 2.603, df 2
    se = math.sqrt(sum((x + 47 / 3) ** 2 for x in (-20, -16, -11)) / 2 / 3)
    h = 4.302653 * se
    assert line == (f"- final accuracy, N=8 minus N=1, paired by seed, in points: -15.7 ± {se:.1f} (95% CI "
                    f"[{-47 / 3 - h:+.1f}, {-47 / 3 + h:+.1f}], n = 3, df 2); the interval excludes 0: the arms differ")
    two = next(x for x in text.splitlines() if x.startswith("- final accuracy, N=8 minus N=8, equal steps,"))
    assert two.endswith("-12.0 (n = 2: -15.0, -9.0); too few units for an interval: not told apart")   # no ± 0.0
    # a learned peak (+10 at step 10), then the last two evaluations 15 or 11 points below it: a
    # terminal cliff at D=10, none at D=20; N=8 ends 30, 20 and 19 below: 3 cliffs at D=10, 2 at D=20
    assert "| N=8, equal steps | 0,1 | 50.0 (n=2) | 60.0 (n=2) | 47.0 (n=2) | 13.0 (n=2) | 2/0/0 of 2 | 0/0/0 of 2 |" \
        in text
    assert "| N=8 | 0,1,2 | 50.0 (all 3 equal) | 60.0 (all 3 equal) | 37.0 ± 3.5 | 23.0 ± 3.5 | 3/0/0 of 3 | 2/0/0 of 3 |" in text
    assert text.index("| N=1 |") < text.index("| N=8 |") < text.index("| N=8, equal steps |")   # the study's order
    assert "8 runs in results/amplification/, from commit aaaaaaa and toy model bbbbbbbbbbbb" in text


def test_a_block_is_rewritten_in_place(tmp_path):
    page = tmp_path / "RESULTS.md"
    page.write_text("# Results\n\nintro\n\n<!-- study x -->\nold\n<!-- end x -->\n\nafter\n")
    studies.write_block("x", "new\ntable", str(page))
    assert page.read_text() == "# Results\n\nintro\n\n<!-- study x -->\nnew\ntable\n<!-- end x -->\n\nafter\n"
    assert studies.read_block("x", str(page)) == "new\ntable"
    studies.write_block("y", "more", str(page))
    assert studies.read_block("y", str(page)) == "more" and studies.read_block("x", str(page)) == "new\ntable"


def test_under_shared_the_one_adapters_move_is_given_once_and_move_cos_per_role():
    def step(disp, cos_g, cos_e):
        return {"roles": {"generator": {"displacement": disp, "move_cos": cos_g},
                          "evaluator": {"displacement": disp, "move_cos": cos_e}}}
    run = {"config": {"sharing": "shared"}, "metrics": [step(0.2, 0.5, 0.1), step(0.4, 0.3, None)]}
    S = {"mechanisms": {}}
    assert studies._mechanism(run, S, "displacement", "generator") == pytest.approx(0.3)
    assert studies._mechanism(run, S, "displacement", "evaluator") is None        # the same adapter, not twice
    assert studies._mechanism(run, S, "move_cos", "generator") == pytest.approx(0.4)
    assert studies._mechanism(run, S, "move_cos", "evaluator") == pytest.approx(0.1)  # steps with no gradient skip
    run["config"]["sharing"] = "isolated"                                               # each role its own adapter
    assert studies._mechanism(run, S, "displacement", "evaluator") == pytest.approx(0.3)


def test_credit_crosses_the_toy_model_with_the_arms_and_gives_each_contrast_per_model_and_across(tmp_path, monkeypatch):
    """A run of credit is a (toy model, seed): seed 0 on two models is two runs of one arm; each
    contrast is given pooled, per model (paired by seed) and across models (the mean of the
    per-model effects and its standard error), with whether its sign held on every model."""
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    shipped = next(iter(studies.shipped_models()))                     # model 0 is a shipped one
    finals = {(0, 0): (0.40, 0.50), (0, 1): (0.44, 0.50), (1, 0): (0.30, 0.36), (1, 1): (0.34, 0.36)}
    for (model, seed), (final_own, final_final) in finals.items():
        for credit, final in (("own", final_own), ("final", final_final)):
            folder = finished(tmp_path / "runs", f"c{credit}-m{model}-s{seed}", seed, [0.5, 0.6, final], n_voters=2,
                              credit=credit, toy_seed=model,
                              provenance={**ORIGIN, "model_sha256": shipped if model == 0 else "e" * 64})
            studies.keep("credit", folder)
    text = studies.report_text("credit")
    assert text.startswith("8 runs in results/credit/, from commit aaaaaaa and toy model ")
    assert f"toy model {shipped[:12]} (toy_seed 0), shipped as toy_models/" in text
    assert "toy model eeeeeeeeeeee (toy_seed 1), not shipped" in text
    assert "| N=2, own | m0: 0,1; m1: 0,1 |" in text
    lines = text.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("- final accuracy, N=2, own minus N=2, final,")))
    # paired by model and seed: -10, -6, -6, -2 (mean -6, sd 3.27, se 1.63, df 3)
    assert lines[at].startswith("- final accuracy, N=2, own minus N=2, final, paired by model and seed, in points: "
                                "-6.0 ± 1.6 (95% CI [-11.2, -0.8], n = 4, df 3)")
    assert lines[at + 1].strip() == "- per toy model: m0 -8.0 (n = 2: -10.0, -6.0); m1 -4.0 (n = 2: -6.0, -2.0)"
    # across models: the models' own errors (2.0 each, df 1) carried through, not the spread of -8 and -4
    # alone: var = (4 + 4) / 4, and tau^2 = max(0, 8 - 4) = 4 adds 4 / 2 = 2: se 2.0 on Satterthwaite's df
    e = intervals.across([intervals.Estimate(-8.0, 2.0, 1, 2), intervals.Estimate(-4.0, 2.0, 1, 2)])
    assert e.se == pytest.approx(2.0)
    assert lines[at + 2].strip() == ("- across toy models (each model weighing the same, its own error carried "
                                     f"through): {e.text()}: {e.verdict()}; the sign held on every model")


def _roles(start_one, end_one, start_sel, end_sel, voters=8):
    def ev(acc, sel):
        return {"acc": acc, "selection_acc": sel, "oracle_rate": 0.9}
    return {"problems": 256, "voters": voters, "commit": "a" * 40,
            "start": {"one voter": ev(start_one, None), f"{voters} voters": ev(0.5, start_sel)},
            "end": {"one voter": ev(end_one, None), f"{voters} voters": ev(0.3, end_sel)}}


def test_voterfall_borrows_credits_arms_and_shows_each_runs_roles(tmp_path, monkeypatch):
    """The 2x2 holds its own one-step runs and the credit study's N=1 and 8-step runs of one
    commit; a run's roles.json (its end evaluated role by role) is kept with it and read into
    the per-run table and the own_change columns; a run of another commit is refused."""
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    runs = tmp_path / "runs"
    for seed in (0, 1, 2):
        studies.keep("credit", finished(runs / "d", f"n1-s{seed}", seed, [0.5, 0.55, 0.6, 0.6], n_voters=1))
        studies.keep("credit", finished(runs / "d", f"n2-s{seed}", seed, [0.5, 0.55, 0.6, 0.6], n_voters=2))
        d = finished(runs / "d", f"n8-s{seed}", seed, [0.5, 0.4, 0.3, 0.3], n_voters=8, mini_batch=128)
        with open(os.path.join(d, studies.ROLES), "w") as f:
            json.dump(_roles(0.5, 0.25 + 0.05 * seed, 0.8, 0.75), f)
        studies.keep("credit", d)
        studies.keep("voterfall", finished(runs / "e", f"n8b-s{seed}", seed, [0.5, 0.5, 0.45 + 0.01 * seed, 0.5],
                                           n_voters=8, mini_batch=1024))
    groups = studies.arms("voterfall")
    assert sorted(groups) == ["N=1", "N=8, final, 1 step", "N=8, final, 8 steps"]   # credit's N=2 is not an arm here
    text = studies.report_text("voterfall")
    assert text.startswith("3 runs in results/voterfall/ and 6 of results/credit/ (the arms they share)")
    assert "| N=8, final, 8 steps | (0, 0) | 50.0 -> 30.0 | 50.0 -> 25.0 | 80.0 -> 75.0 (90.0) |" in text
    row = next(x for x in text.splitlines() if x.startswith("| N=8, final, 8 steps | m0: 0,1,2 |"))
    assert row.endswith("| -20 | -5 |")          # own_change: generator alone -25, -20, -15 points, selection -5
    # each role's change with its t interval: sd 5 over 3 runs, SE 2.89, t(0.975, 2) = 4.303
    assert ("- the generator alone, N=8, final, 8 steps, end minus untrained, in points: -20.0 ± 2.9 "
            "(95% CI [-32.4, -7.6], n = 3, df 2); lower on 3 of 3 runs") in text
    assert "- final accuracy, N=8, final, 1 step minus N=1, paired by model and seed" in text
    other = finished(runs / "e", "n8b-other", 3, [0.5, 0.5, 0.5], n_voters=8, mini_batch=1024,
                     provenance={**ORIGIN, "commit": "c" * 40})
    with pytest.raises(ValueError, match="differ from the study's runs"):
        studies.keep("voterfall", other)   # it could not pair with credit's runs


def test_the_map_pairs_isolated_with_shared_gives_each_arms_gain_and_each_falls_signature(tmp_path, monkeypatch):
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    runs = tmp_path / "runs"
    curves = {("shared", 0): [0.5, 0.6, 0.7, 0.7], ("shared", 1): [0.5, 0.62, 0.66, 0.7], ("shared", 2): [0.4, 0.5, 0.6, 0.6],
              ("isolated", 0): [0.5, 0.8, 0.3, 0.2], ("isolated", 1): [0.5, 0.75, 0.6, 0.74],
              ("isolated", 2): [0.4, 0.6, 0.55, 0.6]}
    for (sharing, seed), accs in curves.items():
        folder = synthetic_run(runs, "eval_opt", "math", sharing, seed=seed, lr=1e-3, accs=accs, steps=30,
                               eval_every=10, name=f"{sharing}-s{seed}")
        _with_config(folder, provenance=ORIGIN)
        open(os.path.join(folder, "done"), "w").close()
        studies.keep("map", folder)
    text = studies.report_text("map")
    # peak, paired by seed: 80 - 70, 75 - 70, 60 - 60 = +10, +5, 0
    assert "- peak accuracy, eval_opt, isolated minus eval_opt, shared, paired by seed, in points: +5.0 ± 2.9" in text
    assert "- gain over step 0, eval_opt, shared, in points: final +20.0 (n = 3, all equal: no spread to give an interval)" in text     # 20, 20, 20
    assert "| eval_opt, isolated | 0,1,2 |" in text and "| 1/0/0 of 3 | 1/0/0 of 3 |" in text   # seed 0: 80 -> 30, 20
    # the fallen run's row; the synthetic run's roles never change, so no signal left its place
    assert "| eval_opt, isolated | 0 | terminal cliff | 10 -> 20 | none |" in text
    # seed 1 fell 15 points below its best at step 20 and came back: not an outcome, but a dip the page shows
    assert "| eval_opt, isolated | 1 | learned; dipped 15.0 points and recovered | 10 -> 20 | none |" in text
    row = next(line for line in text.splitlines() if line.startswith("| eval_opt, isolated | 0,1,2 |"))
    assert "| 26.7 ± 16.9 | 1 of 3 |" in row          # deepest dips 60 (its end), 15 and 5
    assert "- the deepest dip, eval_opt, isolated minus eval_opt, shared, paired by seed" in text
    curves_ = studies.curve_values("map")
    assert list(curves_) == ["eval_opt"] and len(curves_["eval_opt"]) == 6
    assert curves_["eval_opt"][0][0] == "isolated seed 0" and curves_["eval_opt"][0][1][1] == (10, 80.0)



def test_the_real_study_gives_each_arms_gain_with_its_95_interval_and_keeps_transcripts(tmp_path, monkeypatch):
    """Study R (a real model learns): whatever the runs show, each arm's gain over step 0 with its
    95% interval over seeds (t with n - 1 degrees of freedom); the lengths at the start and end
    and the median wall time per step; samples.jsonl kept for the page's examples; a curve figure."""
    from test_analysis import synthetic_run
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    monkeypatch.setattr(studies, "FIGURES", str(tmp_path / "figures"))
    for seed, accs in enumerate([[0.2, 0.3, 0.35], [0.21, 0.25, 0.3], [0.2, 0.4, 0.45]]):
        folder = synthetic_run(tmp_path / "runs", "single", "arith", "shared", seed=seed, lr=2e-4, accs=accs,
                               steps=20, eval_every=10, name=f"single-arith-s{seed}")
        path = os.path.join(folder, "metrics.jsonl")
        rows = analysis.read_jsonl(path)
        with open(path, "w") as f:
            # the first step paused an hour (a benchmark beside it): the median step time ignores it
            f.writelines(json.dumps({**r, "time": {"step": 3600.0 if i == 0 else 60.0 + seed}}) + "\n"
                         for i, r in enumerate(rows))
        with open(os.path.join(folder, "samples.jsonl"), "w") as f:
            f.write(json.dumps({"step": 1, "role": "generator", "completion": "3 + 4 = 7"}) + "\n")
        _with_config(folder, provenance=ORIGIN, problems_per_step=8, group_size=8, scale="smollm2-135m")
        open(os.path.join(folder, "done"), "w").close()
        kept = studies.keep("real", folder)
        assert sorted(os.listdir(kept)) == ["config.json", "done", "eval.jsonl", "metrics.jsonl", "samples.jsonl"]
    text = studies.report_text("real")
    # gains 15, 9 and 25 points: mean 16.3, standard error 4.7, t(0.975, 2) = 4.303
    assert text.startswith("3 runs in results/real/, from commit aaaaaaa and model (smollm2-135m) bbbbbbbbbbbb. ")
    assert "- gain over step 0, single, in points: final +16.3 ± 4.7 (95% CI [-3.7, +36.4], n = 3, df 2)" in text
    head, row = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]
    cells = dict(zip(head, row))
    assert (cells["final - base"], cells["len0 generator"], cells["step_s generator"]) == ("16.3 ± 4.7", "10.1", "61")
    assert studies.write_figure("real") == str(tmp_path / "figures" / "study-real.png")
    assert os.path.isfile(tmp_path / "figures" / "study-real-curve.png")


def test_roles_evaluates_finished_runs_only_and_refuses_an_end_that_is_not_the_runs(tmp_path, monkeypatch, capsys):
    """studies.py roles: a run without `done` has a ckpt-last that is not its end; and the end's
    evaluation with the run's voters must be the run's last eval.jsonl line, or it is not written."""
    runs = tmp_path / "runs"
    done = finished(runs, "n8-s0", 0, [0.5, 0.4, 0.3], n_voters=8)
    going = finished(runs, "n8-s1", 1, [0.5, 0.4], n_voters=8)
    os.remove(os.path.join(going, "done"))
    for r in (done, going):
        os.makedirs(os.path.join(r, "ckpt-last"))
    ends = iter([0.3, 0.35])      # the first call's end is the run's last line (30%), the second's is not

    def fake(run, problems, cache):
        end = next(ends)
        return {"problems": problems, "voters": 8, "commit": "c",
                "start": {"one voter": {"acc": 0.5}, "8 voters": {"acc": 0.5, "selection_acc": 0.5}},
                "end": {"one voter": {"acc": 0.2}, "8 voters": {"acc": end, "selection_acc": 0.4}}}
    monkeypatch.setattr(studies, "role_evals", fake)
    studies.main(["roles", str(runs)])
    assert os.path.isfile(os.path.join(done, studies.ROLES)) and not os.path.isfile(os.path.join(going, studies.ROLES))
    assert "not finished" in capsys.readouterr().err
    os.remove(os.path.join(done, studies.ROLES))
    studies.main(["roles", done])
    assert not os.path.isfile(os.path.join(done, studies.ROLES))
    assert "its end evaluates to 0.35 here, its eval.jsonl says 0.3" in capsys.readouterr().err


def test_a_table_cell_never_prints_a_zero_error():
    """Units that all agree have no spread to report: the cell says so rather than '± 0.0';
    an error that rounds to 0 is printed as a bound."""
    assert studies._pm(intervals.sample([0.0, 0.0, 0.0, 0.0])) == "0.0 (all 4 equal)"
    assert studies._pm(intervals.sample([1.0, 1.02, 1.04])) == "1.0 ± <0.1"
    assert studies._pm(intervals.sample([1.0, 2.0, 3.0])) == "2.0 ± 0.6"
    assert studies._pm(intervals.sample([1.0, 3.0])) == "2.0 (n=2)"


def _with_skill(folder, picked, rights, verdicts=None):
    """Rewrite a synthetic run's eval.jsonl with the aggregator's counts (100 picks an
    evaluation: `picked` right, `rights` of 300 candidates right, a majority of 40 and an oracle
    of 70) or the evaluator's (tp, fp, fn, tn), one value per evaluation."""
    path = os.path.join(folder, "eval.jsonl")
    recs = analysis.read_jsonl(path)
    for i, r in enumerate(recs):
        r["skill"] = ({"evaluator": dict(zip(("tp", "fp", "fn", "tn"), verdicts[i]), calls=sum(verdicts[i]))}
                      if verdicts else {"aggregator": {"resolved": 100, "picked": picked[i], "majority": 40,
                                                       "with_correct": 70, "right_candidates": rights[i],
                                                       "candidates": 300}})
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


def test_study_q_reads_the_supervisors_skill_against_chance_the_end_and_the_base_rates(tmp_path, monkeypatch):
    """Study Q: the end is the mean of the last 3 evaluations; Isolated minus Shared and each
    workflow minus single, paired by seed; the aggregator's picks against a random pick (chance)
    and the majority, the evaluator's J, at step 0 and at the end; "not logged" for runs whose
    evaluations predate it; the base rates kept beside the runs."""
    monkeypatch.setattr(studies, "RESULTS", str(tmp_path / "results"))
    runs = tmp_path / "runs"
    for seed in range(3):
        for wf, sharing, accs in (("single", "shared", [0.2, 0.3, 0.4, 0.5]),
                                  ("voting", "shared", [0.2, 0.4, 0.5, 0.6 + 0.01 * seed]),
                                  ("voting", "isolated", [0.2, 0.5, 0.6, 0.3]),
                                  ("eval_opt", "shared", [0.2, 0.3, 0.3, 0.3])):
            folder = synthetic_run(runs, wf, "arith", sharing, seed=seed, lr=1e-4, accs=accs, steps=30,
                                   eval_every=10, name=f"{wf}-{sharing}-s{seed}")
            _with_config(folder, provenance=ORIGIN, scale="smollm2-135m")
            if wf == "voting" and sharing == "shared":
                _with_skill(folder, picked=[30, 40, 50, 60 + seed], rights=[90, 120, 150, 150])
            open(os.path.join(folder, "samples.jsonl"), "w").close()
            open(os.path.join(folder, "done"), "w").close()
            studies.keep("q", folder)
    os.makedirs(tmp_path / "results" / "q" / "base")
    base = {"workflow": "single", "problems": 162, "samples": 4, "episodes": 648, "temperature": 0.7,
            "max_new_tokens": 384, "instruction": None, "pass@k": {"1": 0.25},
            "cut": {"cut": {"generator": 26}, "graded_cut": 26, "uncut_correct": 150},
            "quality": {"roles": {"generator": {"len_tokens": 70.25}}}}
    with open(tmp_path / "results" / "q" / "base" / "task.json", "w") as f:
        json.dump(base, f)
    text = studies.report_text("q")
    # the end: mean of the last 3 evaluations; voting shared minus single: (40 + 50 + 60 + s) / 3 - 40 = +10.0 + s / 3
    assert ("- the end (mean of the last 3 evaluations), voting, shared minus single, paired by seed, in points: "
            "+10.3 ± 0.2") in text
    # voting isolated ends on one low evaluation (30 after 60): not a fall (two are needed), nor a dip it recovered from
    assert "| voting, isolated | 0,1,2 |" in text and "dipped 30.0 points and recovered" not in text
    # voting isolated: the end 46.7 against shared's 56.7+; its peak 60 against 60-62
    assert "- peak accuracy, voting, isolated minus voting, shared, paired by seed, in points: -1.0 ± 0.6" in text
    # step 0: 30 of 100 right picks against a random pick's 90/300 = 30%; the last evaluation: 60-62 against 50%
    assert ("- the aggregator's skill, voting, shared, step 0: picks right 30.0% (random pick 30.0%, majority 40.0%, "
            "oracle 70.0%); picked minus random +0.0 (n = 3, all equal: no spread to give an interval)") in text
    assert "- the aggregator's skill, voting, shared, the last evaluation: picks right 61.0% (random pick 50.0%" in text
    assert "picked minus random +11.0 ± 0.6 (95% CI [+8.5, +13.5], n = 3, df 2): above chance" in text
    assert "picked minus majority +21.0 ± 0.6 (95% CI [+18.5, +23.5], n = 3, df 2): above the majority vote" in text
    assert "- the aggregator's skill, voting, isolated: not logged" in text
    # the contrasts of one measure read together: two with an interval, both kept by Holm
    assert ("- read together, the 2 contrasts of the end (mean of the last 3 evaluations): 2 exclude 0 each at 95%; "
            "at a family-wise 5% (Holm) 2 do (voting, isolated minus voting, shared; voting, shared minus single)") in text
    assert "- the evaluator's skill, eval_opt, shared: not logged" in text
    assert ("- base rate, single under the task's own instruction (task.json): 25.0% of 162 problems x 4 samples, "
            "T = 0.7, at most 384 new tokens; 4.0% cut at that cap, 24.1% right among the uncut; 70.2 tokens") in text


def test_the_evaluators_skill_is_youdens_j_against_chance():
    """J = 1 - false accepts - false rejects: 0 for verdicts that ignore the attempt's grade."""
    at_chance = {"verdicts": 100.0, "accepts": 50.0, "verdict accuracy": 50.0, "false accept": 50.0,
                 "false reject": 50.0, "decision J": 0.0}
    sharp = {"verdicts": 40.0, "accepts": 20.0, "verdict accuracy": 90.0, "false accept": 10.0,
             "false reject": 10.0, "decision J": 30.0}
    text = studies._skill_text("evaluator", [at_chance, sharp, sharp])
    assert text.startswith("a verdict in 60.0% of its calls, a Correct in 30.0%; of the verdicts, verdict accuracy "
                           "76.7%, false accepts 23.3%, false rejects 23.3%; J over its verdicts +53.3 ± 26.7")
    # the gate's J, over every attempt (a missing verdict a revise): +20.0 ± 10.0, t(2) 4.30: [-23.0, +63.0]
    assert ("J of the gate (accept on Correct, else revise) +20.0 ± 10.0 (95% CI [-23.0, +63.0], n = 3, df 2): "
            "not told apart from chance (up to 63.0 points could hide)") in text


def test_an_evaluator_that_never_gave_a_verdict_is_logged_and_said_so():
    # SmolLM2's evaluator writes a critique but no verdict: its skill is logged (0 verdicts of its
    # calls), not "not logged", and J is 0 by construction (every attempt revised)
    mute = {"verdicts": 0.0, "accepts": 0.0, "verdict accuracy": None, "false accept": None, "false reject": None}
    text = studies._skill_text("evaluator", [mute, mute])
    assert text.startswith("a verdict in 0.0% of its calls, a Correct in 0.0%; of the verdicts, verdict accuracy -%")
    assert "(no verdict in any run:" in text and "at chance by construction, J = 0)" in text
    unlogged = {**mute, "verdicts": None, "accepts": None}   # an evaluation that did not log it: no claim on it
    assert "by construction" not in studies._skill_text("evaluator", [unlogged, mute])
    # verdicts, but never a Correct (SmolLM2's Eval-Opt / Shared, seed 0): every attempt revised all the same
    rejecting = {"verdicts": 0.6, "accepts": 0.0, "verdict accuracy": 0.0, "false accept": None, "false reject": 100.0}
    assert "(no Correct in any run:" in studies._skill_text("evaluator", [rejecting, mute])
    run = {"config": {"workflow": "eval_opt"}, "evals": [
        {"step": s, "acc": 0.2, "n": 10, "calls": {"generator": 20, "evaluator": 10},
         "skill": {"evaluator": {"calls": 10, "tp": 0, "fp": 0, "fn": 0, "tn": 0}}} for s in (0, 6)]}
    lines = studies.skill_lines("q", {"eval_opt, isolated": [(run, None)]})
    assert [line.split(":")[0] for line in lines] == ["- the evaluator's skill, eval_opt, isolated, step 0",
                                                     "- the evaluator's skill, eval_opt, isolated, the last evaluation"]


def test_a_skill_difference_whose_interval_holds_0_is_not_told_apart_from_chance():
    e = intervals.sample([1.0, -1.0, 3.0])   # mean +1.0, se 1.15, t(2) 4.30: [-4.0, +6.0]
    assert studies._against(e, "chance") == ": not told apart from chance (up to 6.0 points could hide)"
    assert studies._against(intervals.sample([-5.0, -6.0, -7.0]), "the majority vote") == ": below the majority vote"
    assert studies._against(intervals.sample([2.0, 2.0]), "chance") == ""   # two units: no interval


def test_every_block_header_defines_its_columns():
    """A study's mechanism column the header does not define is a number a reader cannot read:
    every mechanism any study shows has its words, and the header says which evaluation `final` is."""
    for name, st in studies.STUDIES.items():
        assert set(st.mechanisms) <= set(studies.MECHANISM_TEXT), name
    head = studies._glossary(studies.STUDIES["q"])
    assert "len0: as len, over the first tenth of the steps" in head and "displacement" not in head
    for name in studies.STUDIES:
        first = studies.read_block(name).split("\n", 1)[0]
        assert "final: the last one" in first and "; mechanisms: means over seeds (" in first, name
