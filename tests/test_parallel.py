"""Data parallelism on CPU with gloo (no GPU): 2 torchrun ranks against 1 process.

- the same samples split over 2 ranks (unequal calls per role) give the same adapters after
  two updates, and the same per-role and per-slot diagnostics, as 1 process holding them all;
- a 2-rank toy run of train.py writes one well-formed run folder, and --resume continues it;
- a rank that raises ends the job non-zero within a bounded time, naming the rank and why;
- a stop sent to the ranks saves the step before any rank leaves;
- a refusal on one rank ends every rank, and a fresh run leaves no folder.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import save_tiny_toy_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "dp_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def rel(a, b):
    """Relative difference of two vectors, fp32 rounding being ~1e-7."""
    return float((a - b).norm() / a.norm().clamp(min=1e-30))


def torchrun(*args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


CASES = ["shared", "isolated", "shared-plain", "isolated-plain"]


@pytest.fixture(scope="module")
def dp_updates(tmp_path_factory):
    """(one process, 2 ranks): folders holding each case's CASE/rank{R}.pt (tests/dp_worker.py),
    every case run by one launch of each."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    r = subprocess.run([sys.executable, WORKER, str(one), *CASES], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = torchrun(WORKER, str(two), *CASES)
    assert r.returncode == 0, r.stderr[-3000:]
    return one, two


def results_of(dp_updates, case):
    one, two = dp_updates
    return torch.load(one / case / "rank0.pt"), [torch.load(two / case / f"rank{k}.pt") for k in (0, 1)]


@pytest.mark.parametrize("sharing", ["shared", "isolated"])
def test_two_ranks_update_like_one_process(dp_updates, sharing):
    ref, ranks = results_of(dp_updates, sharing)
    for res in ranks:   # every rank applied the same gradients and holds the same weights as one process
        assert [n for n, _ in res["applied"]] == [n for n, _ in ref["applied"]] and len(ref["applied"]) > 2
        for (_, a), (_, b) in zip(ref["applied"], res["applied"]):
            # sums over ranks add the per-slot parts in another order: fp32 rounding (measured 1.2e-6)
            assert rel(a, b) < 1e-5
        for name, params in ref["params"].items():
            assert rel(torch.cat([p.flatten() for p in params]), torch.cat([p.flatten() for p in res["params"][name]])) < 1e-6
    for s_ref, s_two in zip(ref["stats"], ranks[0]["stats"]):
        for name, a in s_ref["adapters"].items():
            assert s_two["adapters"][name] == pytest.approx(a, rel=1e-5)
        for role, q in s_ref["roles"].items():
            for key in ("n", "len", "skipped", "grad_norm", "grad_share", "grad_norm_opt", "grad_norm_opt_max",
                        "opt_steps", "clip_frac", "ratio_mean", "entropy"):
                assert s_two["roles"][role][key] == pytest.approx(q[key], rel=1e-5, abs=1e-9), (role, key)
        for slot, q in s_ref["slots"].items():
            assert s_two["slots"][slot] == pytest.approx(q, rel=1e-5, abs=1e-9)
        assert s_two["coherence"] == pytest.approx(s_ref["coherence"], rel=1e-5)
    assert ranks[0]["stats"][0]["roles"]["generator"]["damp_scale"] < 1.0  # damping saw the global gradient


@pytest.mark.parametrize("sharing", ["shared", "isolated"])
def test_without_probe_or_intervention_two_ranks_update_like_one_process(dp_updates, sharing):
    """The update sums the ranks' gradients itself: the plain method (probe=None) under 2 ranks
    takes the 1-process steps. Within fp32 rounding, not bit for bit: a micro-batch of one
    process adds its rows' gradients inside one matmul, which 2 ranks split into two sums added
    by the all-reduce (measured 1.5e-7; the train.py run below, whose micro-batches hold at most
    one row per rank, is bit-identical)."""
    ref, ranks = results_of(dp_updates, f"{sharing}-plain")
    assert ref["stats"] == [] and ranks[0]["stats"] == []   # no probe ran
    for res in ranks:
        assert [n for n, _ in res["applied"]] == [n for n, _ in ref["applied"]] and len(ref["applied"]) > 2
        for name, params in ref["params"].items():
            a = torch.cat([p.flatten() for p in params])
            b = torch.cat([p.flatten() for p in res["params"][name]])
            print(f"{sharing} {name}: 2 ranks against 1 process, no probe: {rel(a, b):.1e} relative")
            assert rel(a, b) < 1e-6, name
        for (_, a), (_, b) in zip(ref["applied"], res["applied"]):
            assert rel(a, b) < 1e-5


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


TRAIN_FLAGS = ["--data", "toy_math", "--workflow", "voting", "--sharing", "isolated", "--problems-per-step", "3",
               "--group-size", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "120", "--eval-problems", "5",
               "--eval-every", "1", "--lora-rank", "2", "--lr", "1e-2", "--warmup-steps", "1", "--mini-batch", "4",
               "--samples-every", "1", "--device", "cpu", "--quiet", "--steps", "2"]


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    """(one process, 2 ranks): the run folders of one 2-step toy Voting run of train.py, made by
    one process and by 2 torchrun ranks; --mini-batch is smaller than an adapter's rows (the
    generator's 18 rows take 5 optimizer steps a step)."""
    root = tmp_path_factory.mktemp("toy_runs")
    model = save_tiny_toy_model(root / "model")
    one, two = root / "one", root / "two"
    r = subprocess.run([sys.executable, "train.py", "--scale", str(model), *TRAIN_FLAGS, "--out", str(one)], cwd=ROOT,
                       env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = torchrun("train.py", "--scale", str(model), *TRAIN_FLAGS, "--out", str(two))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("done:") == 1 and r.stdout.count("config:") == 1     # rank 0 alone speaks
    return one, two


def test_a_two_rank_toy_run_writes_one_run_folder_and_resumes(toy_runs, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(toy_runs[1], out)          # the resume below must not touch the fixture's run
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1, 2] and all(e["n"] == 5 for e in evals)  # both shares merged
    m = read_jsonl(out / "metrics.jsonl")[0]
    assert m["roles"]["generator"]["n"] == 3 * 2 * 3 and m["roles"]["aggregator"]["n"] == 3 * 2   # global counts
    st = torch.load(out / "ckpt-last" / "state.pt", weights_only=False)
    assert st["step"] == 2
    r = torchrun("train.py", "--resume", str(out), "--steps", "3", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3] and (out / "done").exists()


def test_a_two_rank_run_takes_the_same_samples_and_steps_as_one_process(toy_runs):
    # every draw is keyed by (seed, step, problem, rollout, call, position) and every rank
    # shuffles the step's global rows alike, so 2 ranks run the 1-process run
    from safetensors.torch import load_file
    one, two = toy_runs
    for name in ("generator", "aggregator"):
        a, b = (load_file(run / "ckpt-last" / name / "adapter_model.safetensors") for run in (one, two))
        va, vb = torch.cat([a[k].flatten() for k in sorted(a)]), torch.cat([b[k].flatten() for k in sorted(b)])
        print(f"{name}: adapters of 2 ranks against 1 process after 2 steps, {rel(va, vb):.1e} relative")
        assert rel(va, vb) < 1e-6, name
    assert (one / "samples.jsonl").read_bytes() == (two / "samples.jsonl").read_bytes()   # the same rollouts
    assert (one / "eval.jsonl").read_bytes() == (two / "eval.jsonl").read_bytes()
    for ma, mb in zip(read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl"), strict=True):
        for rec in (ma, mb):
            rec.pop("time"), rec.pop("tokens_per_s")
        assert same_numbers(ma, mb), (ma, mb)


def test_two_ranks_on_an_empty_toy_cache_build_the_toy_model_once(tmp_path):
    env = {**ENV, "MARL_CACHE": str(tmp_path / "cache"), "MARL_TOY_WARM": json.dumps({"steps": 2, "batch": 4})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
           "--scale", "toy", "--workflow", "single", "--steps", "1", "--problems-per-step", "2", "--group-size", "2",
           "--max-new-tokens", "4", "--eval-problems", "2", "--lora-rank", "2", "--device", "cpu", "--quiet",
           "--out", str(tmp_path / "run")]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("toy: building") == 1 and (tmp_path / "run" / "done").exists()


def same_numbers(a, b, path=""):
    """Equal records, but for the gradient quantities (norms, shares, cosines, coherence),
    which sums over ranks round differently: those within 1e-6 relative."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_numbers(a[k], b[k], f"{path}/{k}") for k in a)
    if isinstance(a, float) and any(w in path for w in ("grad", "cos", "coherence")):
        return abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1e-12)
    return a == b


def test_a_failing_rank_ends_the_job_and_is_named(tmp_path):
    model = save_tiny_toy_model(tmp_path / "model")
    t0 = time.time()
    r = torchrun(WORKER, str(tmp_path / "run"), "fail", model, timeout=150)
    assert r.returncode != 0 and time.time() - t0 < 150
    summary = r.stderr[r.stderr.index("Root Cause"):]      # torchrun's summary of the failure
    assert re.search(r"rank\s*: 1 ", summary) and "rank 1 failed on purpose" in summary


def test_a_stop_sent_to_the_ranks_saves_the_step_before_any_rank_leaves(tmp_path):
    # rank 0 saves for 3 s; a rank that left at once (exit 130) would make torchrun stop rank 0
    # in the middle of its save, which then aborts ("this step was not saved")
    model = save_tiny_toy_model(tmp_path / "model")
    r = torchrun(WORKER, str(tmp_path / "run"), "stop", model, timeout=150)
    assert r.returncode != 0 and "interrupted: saved" in r.stdout and "aborted" not in r.stderr, r.stderr[-2000:]
    assert torch.load(tmp_path / "run" / "ckpt-last" / "state.pt", weights_only=False)["step"] == 1


def test_a_refusal_on_one_rank_ends_every_rank_and_leaves_no_fresh_run_folder(tmp_path):
    # rank 1 alone refuses at step 1; without parallel.together rank 0 waited in the next
    # collective, and the folder its step-0 evaluation wrote stayed, so the same command was
    # then refused ("run folder exists")
    model = save_tiny_toy_model(tmp_path / "model")
    t0 = time.time()
    r = torchrun(WORKER, str(tmp_path / "run"), "refuse", model, timeout=150)
    assert r.returncode != 0 and time.time() - t0 < 150
    assert r.stderr.count("error: refused on purpose") == 1 and "error: rank 1: refused on purpose" in r.stderr, \
        r.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_each_rank_takes_its_own_gpu_or_the_one_it_is_shown():
    import parallel
    assert [parallel.rank_device(k, 4) for k in range(4)] == [0, 1, 2, 3]      # every rank sees every GPU
    assert [parallel.rank_device(k, 1) for k in range(4)] == [0, 0, 0, 0]      # one GPU shown to each rank
    with pytest.raises(RuntimeError, match="start at most 2 ranks a node"):
        parallel.rank_device(3, 2)
