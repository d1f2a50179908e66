"""sweep.py with tiny cells: a tiny random model, passed as --scale or standing in for the
cached toy models (so no warm start ever runs), and cells that train for a few steps in
seconds. The matrix and its input checks are tested by dry runs; skipping, failing,
resuming, Ctrl-C and a killed sweep by real runs of train.py children (most of the time goes
to starting them: importing torch). CPU, offline, about a minute:
`python -m pytest -q tests/test_sweep.py`."""
import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

import sweep
import toy
from conftest import save_tiny_toy_model

SWEEP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sweep.py")
TINY = ["--steps", "2", "--problems-per-step", "2", "--group-size", "2", "--max-new-tokens", "6",
        "--max-prompt-tokens", "120", "--eval-problems", "3", "--eval-every", "1", "--lora-rank", "2",
        "--device", "cpu", "--quiet"]
# long enough to be interrupted mid-run (a step takes about 0.2 s), no evaluation in between
LONG = TINY + ["--steps", "12", "--eval-every", "0", "--save-every", "100"]
VOTING = ["--workflows", "voting", "--tasks", "math", "--sharings", "shared"]
CELL = "voting-math-shared-tiny-s0"  # at --scale TMP/tiny
# the paper's matrix, named: a fork that registers a workflow or a task kind adds cells to the default
PAPER = ["--workflows", "single", "voting", "eval_opt", "orch_workers", "--tasks", "math", "code"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer Qwen3 with the toy tokenizer, saved like a hub checkpoint, as folder `tiny`."""
    return save_tiny_toy_model(tmp_path_factory.mktemp("model") / "tiny")


TINY_WARM = {"steps": 1}   # warm-start settings no shipped model has, so they are looked up in the cache


@pytest.fixture(scope="module")
def toy_cache(tiny, tmp_path_factory):
    """A MARL_CACHE whose toy models (math and code) for MARL_TOY_WARM=TINY_WARM are the tiny
    model, at the folders toy.model_folder looks in, so that `--scale toy` loads it at once."""
    cache = str(tmp_path_factory.mktemp("cache"))
    for task in ("math", "code"):
        folder = os.path.join(cache, "toy", f"{task}-{toy._key(task, {**toy.WARM, **TINY_WARM})}")
        shutil.copytree(tiny, folder)
        open(os.path.join(folder, toy.COMPLETE), "w").close()   # as a finished build leaves it
    return cache


def commands(out):
    """The train.py commands a dry run printed, split into words."""
    return [shlex.split(line) for line in out.splitlines() if "train.py" in line]


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- the matrix

def test_dry_run_lists_14_cells_per_seed_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert sweep.main(["--dry-run", *PAPER, "--seeds", "0", "1", "--out", "m"]) == 0
    out = capsys.readouterr().out
    cmds = commands(out)
    assert len(cmds) == 28 and len({flag(c, "--out") for c in cmds}) == 28
    assert sum(flag(c, "--workflow") == "single" for c in cmds) == 4  # once per task and seed
    assert {os.path.dirname(flag(c, "--out")) for c in cmds} == {str(tmp_path / "m")}
    assert [line.split()[-1] for line in out.splitlines() if "toy.py" in line] == ["math", "code"]
    assert os.listdir(tmp_path) == []

    # an lr axis: each lr is a cell, named with its lr and run with --lr; -- flags reach every cell
    assert sweep.main(["--dry-run", *PAPER, "--lrs", "1e-3", "0.003", "--out", "m", "--", "--steps", "7"]) == 0
    cmds = commands(capsys.readouterr().out)
    assert len(cmds) == 28 and all(c[-2:] == ["--steps", "7"] for c in cmds)
    lr3 = [c for c in cmds if flag(c, "--out").endswith("voting-math-shared-toy-lr3e-3-s0")]
    assert len(lr3) == 1 and flag(lr3[0], "--lr") == "0.003"
    assert os.listdir(tmp_path) == []
    assert [sweep.lr_tag(x) for x in (1e-3, 0.003, 2.5e-4, 0.02, 1.0)] == ["1e-3", "3e-3", "2.5e-4", "2e-2", "1e0"]


def test_dry_run_skips_done_cells_and_resumes_started_ones(tmp_path, capsys):
    out = tmp_path / "m"
    (out / "single-math-shared-toy-s0").mkdir(parents=True)
    (out / "single-math-shared-toy-s0" / "done").touch()
    (out / "single-code-shared-toy-s0").mkdir()
    (out / "single-code-shared-toy-s0" / "config.json").write_text("{}")
    before = sorted(p.name for p in out.rglob("*"))
    assert sweep.main(["--dry-run", "--workflows", "single", "--tasks", "math", "code", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    [cmd] = commands(text)
    assert flag(cmd, "--resume") == str(out / "single-code-shared-toy-s0")
    assert "1 done (skipped), 1 to resume, 0 to start" in text
    assert sorted(p.name for p in out.rglob("*")) == before


@pytest.mark.parametrize("argv, message", [
    (["--workflows", "votng"], "invalid choice: 'votng' (choose from 'single', 'voting', 'eval_opt', 'orch_workers'"),
    (["--tasks", "no-such-task-xyz"], "invalid choice: 'no-such-task-xyz' (choose from 'math', 'code'"),
    (["--sharings", "half"], "invalid choice: 'half' (choose from 'shared', 'isolated')"),
    (["--lrs", "0"], "0 is not a positive number"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--", "--seed", "3"], "the sweep sets --seed for each cell; pass --seeds to the sweep instead"),
    (["--lrs", "1e-3", "--", "--lr=3e-3"], "pass --lrs to the sweep instead"),
    (["--", "--group-size", "0"], "cell single-math-shared-toy-s0: train.py refuses its flags: "
                                  "--group-size must be at least 1"),
    (["--workflows", "single", "voting", "--", "--kl-coef-role", "aggregator=0.1"],
     "cell single-math-shared-toy-s0: train.py refuses its flags: --kl-coef-role aggregator: not a role"),
])
def test_bad_input_is_refused_in_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        sweep.main(["--dry-run", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and message in err[-1]
    assert os.listdir(tmp_path) == []


def test_an_axis_of_a_workflow_parameter_multiplies_only_that_workflows_cells(tmp_path, capsys):
    assert sweep.main(["--dry-run", "--workflows", "single", "voting", "--tasks", "math", "--sharings", "shared",
                       "--axis", "n-voters=1,5", "--out", str(tmp_path / "m")]) == 0
    names = sorted(os.path.basename(flag(c, "--out")) for c in commands(capsys.readouterr().out))
    assert names == ["single-math-shared-toy-s0", "voting-math-shared-toy-n-voters1-s0",
                     "voting-math-shared-toy-n-voters5-s0"]


def test_the_run_table_shows_whole_cell_names(tmp_path, capsys):
    from test_analysis import write_run
    name = "orch_workers-math-isolated-a-long-model-folder-name-lr3e-3-max-workers2-s0"
    write_run(str(tmp_path), name, [0.2, 0.3], config={"workflow": "orch_workers"})
    args = argparse.Namespace(out=str(tmp_path), cliff_drop=10.0, cliff_window=2)
    sweep.analyse(args, [(name, [])])
    assert name in capsys.readouterr().out


# ----------------------------------------------------------------------------- running cells

def test_a_failing_cell_is_reported_the_others_finish_and_a_rerun_skips_them(toy_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MARL_CACHE", toy_cache)
    monkeypatch.setenv("MARL_TOY_WARM", json.dumps(TINY_WARM))
    # --data toy_math suits the math cell; train.py refuses it for the code cell once it loads (exit 2)
    argv = ["--workflows", "voting", "--tasks", "math", "code", "--sharings", "shared", "--jobs", "2",
            "--out", str(tmp_path / "m"), "--", *TINY, "--data", "toy_math"]
    assert sweep.main(argv) == 1
    out, err = capsys.readouterr()
    m = tmp_path / "m"
    cell = "voting-math-shared-toy-s0"
    assert (m / cell / "done").exists() and not (m / "voting-code-shared-toy-s0" / "done").exists()
    assert "FAILED voting-code-shared-toy-s0: exit 2" in err and "is a math data set but --task is code" in err
    assert cell in (m / "report.md").read_text() and cell in out and "wall time" in out
    assert toy_cache in (m / "logs" / "toy-math.log").read_text()  # the toy model built first was the tiny one

    log = (m / "logs" / f"{cell}.log").read_text()
    assert sweep.main(argv) == 1  # the done cell is skipped, the failing one fails again
    out, err = capsys.readouterr()
    assert "1 done (skipped)" in out and "FAILED voting-code-shared-toy-s0" in err
    assert (m / "logs" / f"{cell}.log").read_text() == log


def test_a_relative_out_from_another_folder_holds_runs_and_report(tiny, tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert sweep.main(["--workflows", "single", "--tasks", "math", "--scale", tiny, "--out", "rel/m",
                       "--", *TINY, "--data", "toy_math"]) == 0
    m = tmp_path / "elsewhere" / "rel" / "m"
    assert (m / "single-math-shared-tiny-s0" / "done").exists()
    assert "single-math-shared-tiny-s0" in (m / "report.md").read_text()
    assert not os.path.exists(os.path.join(os.path.dirname(SWEEP), "rel"))


# ----------------------------------------------------------------------------- Ctrl-C and kills

def wait_for(condition, timeout=60.0, what="condition"):
    end = time.time() + timeout
    while not condition():
        if time.time() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_sweep(tiny, out, *extra):
    """One voting cell's sweep in a process group of its own, as a terminal's foreground job."""
    cmd = [sys.executable, SWEEP, *VOTING, "--scale", tiny, "--out", str(out), "--", *LONG, "--data", "toy_math", *extra]
    return cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def children(pid):
    """Pids whose parent is `pid`, from /proc."""
    kids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(name))
    return kids


def ended(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def started_training(out):
    metrics = out / CELL / "metrics.jsonl"
    return lambda: metrics.exists() and metrics.stat().st_size > 0


linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc; PR_SET_PDEATHSIG is Linux")


def test_ctrl_c_lets_the_cells_save_and_a_rerun_resumes_them(tiny, tmp_path):
    out = tmp_path / "m"
    cmd, p = start_sweep(tiny, out)
    wait_for(started_training(out), what="the first training step")
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: SIGINT to the foreground group
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in stdout + stderr
    assert f"interrupted: {CELL}; run the same command again to resume" in stdout
    log = out / "logs" / f"{CELL}.log"
    assert "interrupted: saved" in log.read_text()  # one SIGINT reached the cell: it saved and stopped
    assert (out / CELL / "ckpt-last").is_dir() and not (out / CELL / "done").exists()

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert (out / CELL / "done").exists() and "resumed" in log.read_text()
    assert [m["step"] for m in read_jsonl(out / CELL / "metrics.jsonl")] == list(range(1, 13))


@linux_only
def test_a_second_ctrl_c_exits_at_once(tiny, tmp_path):
    out = tmp_path / "m"
    _, p = start_sweep(tiny, out, "--problems-per-step", "32", "--group-size", "8")  # steps of 1-3 s
    wait_for(started_training(out), what="the first training step")
    [child] = children(p.pid)
    log = out / "logs" / f"{CELL}.log"
    os.killpg(p.pid, signal.SIGINT)
    # two signals at once would be handled as one, so the second Ctrl-C comes once the first has
    # reached the cell: the first came just as step 2 began, and the cell is still in that step
    wait_for(lambda: "interrupt: finishing this step" in log.read_text(), what="the first SIGINT to reach the cell")
    os.killpg(p.pid, signal.SIGINT)
    stdout, stderr = p.communicate(timeout=30)
    assert p.returncode == 130 and "Traceback" not in stdout + stderr
    assert f"aborted: {CELL}; run the same command again" in stdout
    wait_for(lambda: ended(child), 30, "the cell to stop")


@linux_only
def test_cells_do_not_outlive_a_killed_sweep(tiny, tmp_path):
    out = tmp_path / "m"
    _, p = start_sweep(tiny, out)
    wait_for(started_training(out), what="the first training step")
    [child] = children(p.pid)
    p.kill()
    p.communicate(timeout=30)
    wait_for(lambda: ended(child), 60, "the orphaned cell to stop")
    # the kernel's SIGINT (PR_SET_PDEATHSIG) let it save, as a Ctrl-C would
    assert "interrupted: saved" in (out / "logs" / f"{CELL}.log").read_text()


def test_a_default_matrix_leaves_out_a_cell_whose_role_has_no_instruction_on_the_task(capsys):
    """A fork's workflow whose new role has instructions on math alone: the default sweep at a
    real scale runs it on math and leaves out its other kinds' cells in one line each, where a
    matrix naming both the workflow and the task is refused as train.py refuses it."""
    import workflows

    def drafted(episodes, llm, task):
        for ep, call in zip(episodes, workflows.stage(llm, task, "drafter", episodes)):
            ep.final_text = call.text

    workflows.register("drafted", drafted, {"drafter": ("drafter",)}, kinds={"drafter": "solution"},
                       instructions={("drafter", "math"): "Draft a worked answer. End with \\boxed{answer}."})
    args, _ = sweep.parse_args(["--dry-run", "--scale", "0.6b", "--workflows", "drafted", "single"])
    err = capsys.readouterr().err
    assert ("drafted", "code") in args.skip and ("drafted", "math") not in args.skip
    assert "sweep: leaving out drafted on --task code: workflow 'drafted' on task 'code': the drafter has no " \
           "instruction of its own" in err
    assert not any(wf == "single" for wf, _ in args.skip)
    with pytest.raises(SystemExit):
        sweep.parse_args(["--dry-run", "--scale", "0.6b", "--workflows", "drafted", "--tasks", "code"])
    assert "cell drafted-code" in capsys.readouterr().err
