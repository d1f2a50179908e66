"""Evaluate a model or a checkpoint through a workflow; the command line of both of eval.py's
modes: evaluating, and analysing run folders (analysis.py, plots.py).

Two modes.

Evaluate a base model or a checkpoint through a workflow on a test split:

    python eval.py --workflow voting --task math --scale toy [--samples 4] [--problems 256] [--json]
    python eval.py --checkpoint runs/voting-math-shared-toy-s0          # its ckpt-best, its settings

- With `--checkpoint RUN` (a run folder: its ckpt-best, else ckpt-last) or `RUN/ckpt-N`, the
  workflow, task, data (the run's --eval-data when it had one), scale, sharing, isolation,
  length limits, temperature and top-p come from RUN/config.json; a flag given on the command
  line wins.
- The test set: the whole test split of the data, or the run's own evaluation set (its
  --eval-problems) for a checkpoint; `--problems N` draws N (capped at the split's size).
- Sampling at the run's temperature and top-p (the paper's 0.7 and 1 without a run),
  `--samples` episodes per problem. pass@1 is the mean over problems of c/n; pass@k is the
  unbiased estimator 1 - C(n-c, k) / C(n, k) averaged over problems (n episodes, c correct),
  reported for k = 1, 2, 4, ... up to n.
- Per-role quality where the task gives ground truth (every judged or candidate solution is
  scored with taskkinds.score):
  * evaluator: a verdict "Correct" counts as a positive; precision = P(solution correct |
    said Correct), recall = P(said Correct | solution correct), over the evaluator calls that
    gave a verdict (workflows.parse_verdict without a fallback), each compared with the
    generator turn just before it;
  * evaluator, also: false accepts (Correct on a wrong attempt, of the wrong ones) and false
    rejects (Incorrect on a right one, of the right ones); and over every attempt it judged,
    verdict or not, Youden's J of the workflow's gate (accept on Correct, else revise):
    decision_j, 0 for a gate that ignores the grade, as one that never says Correct;
  * aggregator: selection accuracy = P(the chosen candidate is correct | at least one of its
    candidates is correct), next to that oracle rate and the plain rate of correct choices,
    and two references over the same candidates: a uniformly random pick (chance: the share
    of candidates that are right) and the majority vote by the task's key (ties to the
    earliest candidate);
  * what the length cap cut: calls cut per role, graded answers cut, and the accuracy among
    the answers left whole (cut_counts);
  * orchestrator: parse rate (at least one `STRATEGY k:` line) and mean number of strategies
    (0 when none parsed);
  * every role: mean output length (characters, and tokens where the calls carry
    completion ids), code-block rate (rewards.last_code_block finds a block), parser
    fallbacks per call (from Episode.fallbacks).

Analyse the run folders train.py writes:

    python eval.py --runs runs/matrix/* [--report runs/matrix/report.md] [--json] [--no-plots]

- Prints three tables that fit 120 columns, each with a one-line legend: one row per run (base,
  peak and final accuracy, gains, the terminal cliff), one per cell (the seeds of a workflow,
  task, scale, sharing and lr: mean, spread, cliffs k/n), and the role-level mechanisms
  (gradient norms, the dominant role, slot coherence). Files that are not run folders are
  skipped with a note; broken lines in a run's files get one warning each.
- `--report PATH` writes the Markdown report (also the before-the-cliff and capture tables);
  `--json` prints every summary instead of the tables.
- analysis.py reads the runs and defines every number, the cliff rule included (--cliff-drop,
  --cliff-window, --pre-cliff-steps); plots.py draws the PNGs that both --runs (three per run
  folder) and --report (the map, per-cell and Shared-against-Isolated figures next to the
  report) write, none with --no-plots.
"""
import argparse
import dataclasses
import functools
import json
import os
import sys
from collections import Counter, defaultdict

import flags      # one-line errors as train.py's, and the workflows' parameter flags
import taskkinds  # torch-free: the registry of task kinds
import workflows  # torch-free: the registry of workflows, roles and role kinds

# analysis.py (reading, summarising and reporting run folders) is the lab's: the command line and
# the --runs mode import it where they use it, so a training run's evaluation (eval_record, which
# train.py calls) loads none of it (tests/test_train.py checks which modules a run loads).


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
    """correct(ep, text) for every generator text, scored with taskkinds.score in one batch."""
    scored = dict(scored)
    need = {(ep.problem_id, c.text): ep.problem for ep in episodes for c in ep.calls
            if c.role == "generator" and (ep.problem_id, c.text) not in scored}
    if need:
        keys = list(need)
        rs = taskkinds.score([t for _, t in keys], [need[k] for k in keys], task)
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
    verdict_rate. A "Correct" on a wrong attempt is a false accept, an "Incorrect" on a right
    one a false reject; the rates are over the wrong and the right attempts that got a verdict.
    `judged` attempts, `right` of them, count every call after an attempt, verdict or not, for
    the workflow's decision (accept on Correct, revise otherwise: a missing verdict is Incorrect):
    decision_j = tp / right - fp / (judged - right), Youden's J of that gate, 0 when it ignores
    the grade (as one that never accepts does)."""
    c = {"calls": 0, "verdicts": 0, "tp": 0, "fp": 0, "fn": 0, "tn": 0, "judged": 0, "right": 0}
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
            truth = correct(ep, last_gen)
            c["judged"] += 1
            c["right"] += bool(truth)
            said_correct, fallback = _unpack(parse_verdict(call.text))
            if fallback or said_correct is None:
                continue
            c["verdicts"] += 1
            c[("tp" if truth else "fp") if said_correct else ("fn" if truth else "tn")] += 1
    if not c["calls"]:
        return None
    wrong = c["judged"] - c["right"]
    return {"calls": c["calls"], "verdict_rate": _div(c["verdicts"], c["calls"]),
            "precision": _div(c["tp"], c["tp"] + c["fp"]), "recall": _div(c["tp"], c["tp"] + c["fn"]),
            "accuracy": _div(c["tp"] + c["tn"], c["verdicts"]),
            "false_accept": _div(c["fp"], c["fp"] + c["tn"]), "false_reject": _div(c["fn"], c["fn"] + c["tp"]),
            "decision_j": c["tp"] / c["right"] - c["fp"] / wrong if c["right"] and wrong else None,
            "confusion": {k: c[k] for k in ("tp", "fp", "fn", "tn")},
            "attempts": {"judged": c["judged"], "right": c["right"]}}


def _chosen(ep, call, candidates, parse_choice):
    """The candidate text an aggregator call chose, or None."""
    if parse_choice is not None and candidates:
        k, _ = _unpack(parse_choice(call.text, len(candidates)))
        return candidates[k - 1] if isinstance(k, int) and 1 <= k <= len(candidates) else None  # 1-based
    if ep.final_text in candidates:  # without the parser: Voting grades the chosen text
        return ep.final_text
    return None


def _shown(call, written: list) -> list:
    """The generator texts an aggregator call was shown: as many of the latest as its prompt
    numbers solutions (SOLUTION_HEADERS lines), so a fork whose voters answer twice is judged on
    the answers its aggregator read; all of them when its prompt numbers none."""
    lines = {line.strip() for m in call.messages if isinstance(m, dict)
             for line in str(m.get("content", "")).split("\n")}
    n = sum(h in lines for h in workflows.SOLUTION_HEADERS)
    return written[-n:] if 0 < n <= len(written) else written


def _majority(candidates: list, key) -> int:
    """Index of the plurality answer among `candidates` (texts with one task key get one grade),
    ties going to the answer that came first, as the aggregator's own fallback takes voter 1."""
    counts = Counter(key(t) for t in candidates)
    top = max(counts.values())
    return next(i for i, t in enumerate(candidates) if counts[key(t)] == top)


def _aggregator_quality(episodes: list, correct, parse_choice, key) -> dict | None:
    """The aggregator's pick against three references over the same candidates: a uniformly
    random pick (right with the share of candidates that are right: `random_pick_acc` sums the
    right candidates over all candidates, which is that expectation when every call has as many,
    as in Voting), the majority vote by the task's key, and the oracle (some candidate right).
    The candidates are the generator calls the aggregator was shown (_shown)."""
    c = Counter()
    for ep in episodes:
        written = []
        for call in ep.calls:
            if call.role == "generator":
                written.append(call.text)
            if call.role != "aggregator":
                continue
            c["calls"] += 1
            candidates = _shown(call, written)
            chosen = _chosen(ep, call, candidates, parse_choice)
            if chosen is None or not candidates:
                continue
            c["resolved"] += 1
            right = [correct(ep, t) for t in candidates]
            picked = correct(ep, chosen)
            c["picked"] += picked
            c["right_candidates"] += sum(right)
            c["candidates"] += len(right)
            c["majority"] += right[_majority(candidates, lambda t: key(t, ep.problem))]
            if any(right):
                c["with_correct"] += 1
                c["picked_given_any"] += picked
    if not c["calls"]:
        return None
    return {"calls": c["calls"], "resolved": c["resolved"],
            "selection_acc": _div(c["picked_given_any"], c["with_correct"]),
            "oracle_rate": _div(c["with_correct"], c["resolved"]),
            "picked_correct_rate": _div(c["picked"], c["resolved"]),
            "random_pick_acc": _div(c["right_candidates"], c["candidates"]),
            "majority_acc": _div(c["majority"], c["resolved"]),
            "counts": {k: c[k] for k in ("resolved", "picked", "majority", "with_correct", "right_candidates",
                                         "candidates")}}


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

    Every solution a role judged or chose from is scored with taskkinds.score (batched once);
    `scored` maps (problem id, text) -> reward already known, to skip re-running code tests.
    Returns {"roles": {role: {"calls", "len_chars", "len_tokens", "code_block_rate",
    "fallbacks_per_call"}}, "evaluator": {...}, "aggregator": {...}, "orchestrator": {...},
    "notes": [...]}; a section is present only when its role appears."""
    parse_verdict, parse_choice, parse_strategies, notes = _parsers()
    correct = _scorer(episodes, task, scored or {})
    out = {"roles": _role_outputs(episodes), "notes": notes}
    for name, section in (("evaluator", _evaluator_quality(episodes, correct, parse_verdict)),
                          ("aggregator", _aggregator_quality(episodes, correct, parse_choice,
                                                             taskkinds.get(task).key)),
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
             progress: bool = True, stream: tuple = ("eval", 0), **wf_params) -> dict:
    """Run `workflow` with `llm` on every problem `samples` times, score, and measure.

    Returns {"workflow", "task", "problems", "samples", "episodes", "pass@k": {k: mean over
    problems}, "quality": role_quality(...), "cut": cut_counts(...)}; "pass@1" is the mean
    per-problem fraction correct."""
    import rollout
    from tqdm import tqdm

    assert samples >= 1 and problems, "need at least one problem and one sample"
    episodes = []
    bar = tqdm(total=len(problems), desc=f"eval {workflow}/{task}", disable=not progress)
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        eps = rollout.run_episodes(llm, workflow, chunk, samples, task, stream, **wf_params)
        rs = taskkinds.score([e.final_text for e in eps], [e.problem for e in eps], task)
        for e, r in zip(eps, rs):
            e.reward = float(r)
        episodes += eps
        bar.update(len(chunk))
    bar.close()
    known = {(e.problem_id, e.final_text): e.reward for e in episodes}
    return {"workflow": workflow, "task": task, "problems": len({e.problem_id for e in episodes}),
            "samples": samples, "episodes": len(episodes), "pass@k": _pass_at_ks(episodes, samples),
            "quality": role_quality(episodes, task, scored=known), "cut": cut_counts(episodes)}


def _graded_call(ep):
    """The call whose text the episode graded (the last with that text), or None."""
    return next((c for c in reversed(ep.calls) if c.text == ep.final_text), None)


def cut_counts(episodes: list) -> dict:
    """What the length caps cut, as whole numbers: {"cut": {role: calls cut before a stop token},
    "graded_cut": episodes whose graded answer was cut, "uncut_correct": right episodes among
    the others, "prompt_cut": {role: calls whose prompt lost its start}}. Rates: cut / calls,
    and uncut_correct / (n - graded_cut) is the accuracy among the answers the cap left whole."""
    cut = Counter(c.role for ep in episodes for c in ep.calls if not c.finished)
    prompt_cut = Counter(c.role for ep in episodes for c in ep.calls if c.prompt_cut)
    graded_cut = [not getattr(_graded_call(ep), "finished", True) for ep in episodes]
    return {"cut": dict(sorted(cut.items())), "prompt_cut": dict(sorted(prompt_cut.items())),
            "graded_cut": sum(graded_cut),
            "uncut_correct": sum(ep.reward > 0.5 for ep, g in zip(episodes, graded_cut) if not g)}


def _skill(quality: dict) -> dict:
    """The supervisors' skill as whole numbers (eval.jsonl's `skill`; RUNFOLDER.md gives the rates)."""
    out = {}
    if "aggregator" in quality:
        out["aggregator"] = dict(sorted(quality["aggregator"]["counts"].items()))
    if "evaluator" in quality:
        e = quality["evaluator"]
        out["evaluator"] = dict(sorted({"calls": e["calls"], **e["confusion"], **e["attempts"]}.items()))
    return out   # keys sorted at every level, as merge_records writes them: 1 and N ranks give the same bytes


def eval_record(llm, workflow: str, problems: list, task: str, step: int, batch_size: int = 16,
                progress: bool = True, **wf_params) -> dict:
    """The eval.jsonl record of a training run's evaluation at `step`: pass@1 on the held-out
    problems, with per-role parse-failure rate, mean length, code-block rate and calls; what
    the length cap cut (cut_counts); and, where the workflow has one, the aggregator's picks
    against a random pick, the majority and the oracle, and the evaluator's verdicts (`skill`)."""
    res = evaluate(llm, workflow, problems, task, samples=1, batch_size=batch_size, progress=progress,
                   stream=("eval", step), **wf_params)
    roles = res["quality"]["roles"]
    return {"step": step, "acc": res["pass@k"][1], "n": res["problems"],
            "parse_fail": {r: q.get("fallbacks_per_call", 0.0) for r, q in roles.items()},
            "len": {r: q.get("len_tokens", q.get("len_chars")) for r, q in roles.items()},
            "code_block_rate": {r: q.get("code_block_rate", 0.0) for r, q in roles.items()},
            "calls": {r: q.get("calls", 0) for r, q in roles.items()},
            **res["cut"], "skill": _skill(res["quality"])}


def _sum_counts(dicts: list) -> dict:
    """Nested dicts of whole numbers, summed key by key."""
    out = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = _sum_counts([out.get(k, {}), v]) if isinstance(v, dict) else out.get(k, 0) + v
    return dict(sorted(out.items()))


def merge_records(recs: list) -> dict:
    """One evaluation record from every rank's share, the same to the last bit as one process
    would have written: each rate times its count is a whole number (correct problems, parse
    failures, tokens, code blocks), so the shares are summed as integers and divided once; the
    counts (cut, skill) are summed as they are."""
    recs = [r for r in recs if r]
    n = sum(r["n"] for r in recs)
    calls = {}
    for r in recs:
        for role, c in r["calls"].items():
            calls[role] = calls.get(role, 0) + c
    out = {"step": recs[0]["step"], "acc": sum(round(r["acc"] * r["n"]) for r in recs) / n, "n": n}
    for key in ("parse_fail", "len", "code_block_rate"):
        out[key] = {role: sum(round((r[key].get(role) or 0.0) * r["calls"].get(role, 0)) for r in recs) / c
                    for role, c in sorted(calls.items()) if c}
    out["calls"] = dict(sorted(calls.items()))
    for key in ("cut", "prompt_cut", "graded_cut", "uncut_correct", "skill"):
        if key in recs[0]:
            out[key] = (_sum_counts([r[key] for r in recs]) if isinstance(recs[0][key], dict)
                        else sum(r[key] for r in recs))
    return out


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
    import analysis
    cfg = analysis.read_config(run_dir)
    for name in sorted(os.listdir(checkpoint)):
        path = os.path.join(checkpoint, name, "adapter_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                a = json.load(f)
            cfg.update(lora_rank=a.get("r", cfg.get("lora_rank")), lora_alpha=a.get("lora_alpha", cfg.get("lora_alpha")))
            break
    return cfg


RUN_SETTINGS = ("workflow", "task", "scale", "sharing", "isolation", "max_new_tokens", "max_prompt_tokens",
                "max_embed_tokens", "temperature", "top_p")
FALLBACKS = {"scale": "toy", "sharing": "shared", "isolation": "lora", "task": "math", "temperature": 0.7, "top_p": 1.0}


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
    if not st["workflow"]:
        raise ValueError("give --workflow, or --checkpoint of a run that has one in its config.json")
    if not (0 < st["top_p"] <= 1 and st["temperature"] >= 0):
        raise ValueError(f"--top-p must be in (0, 1] and --temperature >= 0, got {st['top_p']} and {st['temperature']}")
    run_data = cfg.get("eval_data") or cfg.get("data")
    st.update(checkpoint=checkpoint, data=args.data or run_data or tasks.default_data(st["scale"], st["task"]),
              lora_rank=int(cfg.get("lora_rank", 64)), lora_alpha=float(cfg.get("lora_alpha", 32.0)))
    # scoring a run on its own evaluation set: the same subset, so the number compares with eval.jsonl
    st["problems"] = args.problems or (cfg.get("eval_problems") if run_data and st["data"] == run_data else None)
    st.update(_draws(args, cfg, checkpoint))
    if not st["data"]:
        raise ValueError(f"--task {st['task']} has no default data set at this scale; pass --data")
    st["params"] = _workflow_params(args, cfg, st["workflow"])
    st["toy_check"] = cfg.get("toy_check") or 0
    st["toy_seed"] = args.toy_seed if args.toy_seed is not None else cfg.get("toy_seed") or 0
    if args.toy_seed is not None and (st["scale"] != "toy" or args.toy_seed < 0):
        raise ValueError("--toy-seed is a toy model's warm-start seed (>= 0, at --scale toy)")
    default_new, default_prompt, default_embed = tasks.length_limits(st["scale"], st["task"])
    st["max_new_tokens"] = st["max_new_tokens"] or default_new
    for k, default in (("max_prompt_tokens", default_prompt), ("max_embed_tokens", default_embed)):
        given = getattr(args, k)
        # the flag's 0 is "no limit", and so is a run's null (train.py saves its 0 so), not "unset"
        unlimited = given == 0 or (given is None and k in cfg and cfg[k] is None)
        st[k] = None if unlimited else st[k] or default
    taken = [k for k in (*RUN_SETTINGS, "data") if cfg.get(k) is not None and getattr(args, k) is None]
    if taken:
        notes.append(f"from {os.path.join(run_dir, 'config.json')}: " + ", ".join(f"{k} {st[k]}" for k in taken))
    return st, notes


def _workflow_params(args, cfg: dict, workflow: str) -> dict:
    """The workflow's keyword arguments: each parameter's flag, else the checkpoint run's value
    when it ran the same workflow (flags.add_workflow_flags), checked as train.py checks them."""
    saved = cfg if cfg.get("workflow") == workflow else {}
    values = {dest: getattr(args, dest) if getattr(args, dest) is not None else saved.get(dest)
              for dest in workflows.params_by_dest()}
    error = flags.workflow_param_error(workflow, values)
    if error:
        raise ValueError(error)
    return {p.name: values[p.dest] for p in workflows.PARAMS[workflow] if values[p.dest] is not None}


def _draws(args, cfg: dict, checkpoint) -> dict:
    """The sampler's seed and stream, and the rollout batch. A checkpoint of a run is scored
    with the draws its run's evaluation at that step took (the run's --seed, stream ("eval",
    step)) and the run's batch of episodes, so its pass@1 is the one eval.jsonl holds for the
    same problems; --seed chooses other draws. A base model: --seed (default 0), step 0."""
    import analysis
    step = None
    if checkpoint and os.path.isfile(os.path.join(checkpoint, "state.pt")) and "seed" in cfg:
        import torch
        step = torch.load(os.path.join(checkpoint, "state.pt"), weights_only=False, map_location="cpu")["step"]
    seed = args.seed if args.seed is not None else cfg.get("seed", 0) if step is not None else 0
    batch = args.batch_size or (cfg["problems_per_step"] * cfg["group_size"] if step is not None and
                                "problems_per_step" in cfg else 16)
    logged = step is not None and seed == cfg.get("seed") and step in {
        r.get("step") for r in analysis.read_jsonl(os.path.join(os.path.dirname(checkpoint), "eval.jsonl"), quiet=True)}
    note = (f"draws: seed {seed}, those of the run's evaluation at step {step}" + (" (its eval.jsonl line)" if logged else "")
            if step is not None else f"draws: seed {seed}")
    return {"seed": seed, "stream": ("eval", step or 0), "batch_size": batch, "draws_note": note}


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


def reword_generator(task: str, text: str, scale: str) -> str:
    """Register `task` again with `text` as its generator's instruction, in this process only
    (register_task's replace=True, so the phrase rules hold); a note saying so."""
    if scale == "toy":
        raise ValueError("--instruction needs a real model: the toy model knows the built-in phrases alone")
    kind = taskkinds.get(task)
    options = {f.name: getattr(kind, f.name) for f in dataclasses.fields(kind)
               if f.name not in ("name", "reward", "instructions", "default", "check")}
    taskkinds.register_task(task, kind.reward, {**kind.instructions, "generator": text}, kind.default, kind.check,
                            replace=True, **options)
    return f"--instruction: the generator's instruction on {task} is {text!r} for this evaluation"


def _llm_from_settings(args, st: dict, kind: str):
    import engine
    import policies
    import rollout
    model, tokenizer = policies.load(st["scale"], device=args.device, toy_task=kind, quiet=args.quiet or args.json,
                                     toy_check=st["toy_check"], toy_seed=st["toy_seed"])
    policy = policies.Policy(model, tokenizer, workflows.ROLES[st["workflow"]], st["sharing"],
                             isolation=st["isolation"], rank=st["lora_rank"], alpha=st["lora_alpha"])
    if st["checkpoint"]:
        policy.load_adapters(st["checkpoint"])
    sampler = functools.partial(engine.generate, kv_budget=engine.default_kv_budget(args.device), host=True)
    return rollout.make_llm(policy, sampler=sampler, temperature=st["temperature"], top_p=st["top_p"], seed=st["seed"],
                            max_new_tokens=st["max_new_tokens"], max_prompt_tokens=st["max_prompt_tokens"],
                            max_embed_tokens=st["max_embed_tokens"])


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x, fmt=".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _print_evaluation(res: dict):
    import analysis
    print(f"{res['workflow']} / {res['data']} ({res['task']}) / {res['scale']} / {res['checkpoint'] or 'base'}: "
          f"{res['problems']} problems x {res['samples']} samples, T={res['temperature']}"
          + (f", top-p {res['top_p']}" if res["top_p"] < 1 else ""))
    print(analysis.text_table(["k", "pass@k (%)"], [[k, _pct(v)] for k, v in res["pass@k"].items()]))
    q = res["quality"]
    print()
    print(analysis.text_table(["role", "calls", "len (chars)", "len (tokens)", "code-block rate", "fallbacks/call"],
                              [[r, d["calls"], _num(d["len_chars"], ".1f"), _num(d["len_tokens"], ".1f"),
                                _num(d["code_block_rate"], ".2f"), _num(d["fallbacks_per_call"], ".2f")]
                               for r, d in q["roles"].items()]))
    for role in ("evaluator", "aggregator", "orchestrator"):
        if role in q:
            print(f"{role}: " + ", ".join(f"{k} {_num(v, '.3f') if isinstance(v, float) else v}"
                                          for k, v in q[role].items()))
    cut, n = res["cut"], res["episodes"]
    uncut = _div(cut["uncut_correct"], n - cut["graded_cut"])
    print(f"cut at {res['max_new_tokens']} tokens: {_pct(cut['graded_cut'] / n)}% of graded answers "
          f"({', '.join(f'{r} {c}' for r, c in cut['cut'].items()) or 'no call'} cut); "
          f"accuracy among the uncut {_pct(uncut)}%")
    for note in q["notes"]:
        print("note:", note)


def _evaluate_cli(args):
    """Thin glue: settings (flags, else the checkpoint's run) -> problems -> llm -> evaluate."""
    import tasks
    import toy
    args.device = flags.device_or_default(args.device)
    try:
        st, notes = resolve_settings(args)
        if args.instruction is not None:
            notes.append(reword_generator(st["task"], args.instruction, st["scale"]))
        workflows.check_run(st["workflow"], st["task"], st["params"])   # before the model loads, as train.py's flags
        if st["scale"] == "toy":
            tasks.check_toy_data("--data", st["data"])
            toy.check_roles(st["workflow"], workflows.ROLES[st["workflow"]])
        # the run's evaluation set is a fixed subset (seed 0, as train.py draws it)
        problems, note = load_problems(st["data"], st["task"], st["problems"], 0)
        llm = _llm_from_settings(args, st, st["task"])
    except (ValueError, RuntimeError, OSError, ImportError, KeyError) as e:
        raise SystemExit(f"error: {e}")
    for n in notes + ([note] if note else []) + [st["draws_note"]] + workflows.replaced(st["workflow"], st["task"]):
        if not args.quiet:
            print(n, file=sys.stderr)
    res = evaluate(llm, st["workflow"], problems, st["task"], samples=args.samples, batch_size=st["batch_size"],
                   progress=not (args.json or args.quiet), stream=st["stream"], **st["params"])
    res.update(scale=st["scale"], checkpoint=st["checkpoint"], data=st["data"], temperature=st["temperature"],
               top_p=st["top_p"],
               seed=st["seed"], stream=list(st["stream"]), instruction=args.instruction,
               sharing=st["sharing"], isolation=st["isolation"], max_new_tokens=st["max_new_tokens"],
               max_prompt_tokens=st["max_prompt_tokens"])
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        _print_evaluation(res)


# ----------------------------------------------------------------------------- analyse run folders: summaries, plots, report

def _write_plots(summaries: list, runs: dict, report: str | None, quiet: bool) -> list:
    """Each run's plots into its folder; with a report, the cross-run figures next to it."""
    import analysis
    import plots  # here: matplotlib is optional, and plots.py imports it only when drawing
    try:
        for s in summaries:
            s["plots"] = plots.plot_run(s["run"], run=runs[s["run"]], summary=s)
        return plots.plot_runs(summaries, runs, analysis.figures_folder(report)) if report and summaries else []
    except ImportError as e:
        if not quiet:
            print(str(e), file=sys.stderr)
        return []


def analyse_runs(folders: list, cliff_drop: float | None = None, cliff_window: int | None = None,
                 plots: bool = True, report: str | None = None, quiet: bool = False,
                 pre_cliff_steps: int | None = None) -> tuple:
    """(summaries, cross-run figures written) of every run folder among `folders` (the cliff rule:
    analysis.CLIFF_DROP and CLIFF_WINDOW where None)."""
    import analysis
    cliff_drop = analysis.CLIFF_DROP if cliff_drop is None else cliff_drop
    cliff_window = analysis.CLIFF_WINDOW if cliff_window is None else cliff_window
    folders, notes = analysis.run_folders(folders)
    if not quiet:
        for note in notes:  # e.g. a shell glob that also caught report.md
            print(f"skipped: {note}", file=sys.stderr)
    runs = {f: analysis.load_run(f, quiet) for f in folders}
    summaries = analysis.label_variants([analysis.analyse_run(f, cliff_drop, cliff_window, run=runs[f],
                                                              pre_cliff_steps=pre_cliff_steps) for f in folders])
    figures = _write_plots(summaries, runs, report, quiet) if plots else []
    if report:
        analysis.write_report(summaries, report, cliff_drop, cliff_window, figures)
    return summaries, figures


def analyse(folders: list, cliff_drop: float | None = None, cliff_window: int | None = None,
            plots: bool = True, report: str | None = None, quiet: bool = False,
            pre_cliff_steps: int | None = None) -> list:
    """Summaries of every run folder among `folders`; plots written into each folder (when
    matplotlib is there), and a Markdown report with its figures at `report`. Used by sweep.py."""
    return analyse_runs(folders, cliff_drop, cliff_window, plots, report, quiet, pre_cliff_steps)[0]


# ----------------------------------------------------------------------------- CLI: analyse

def _analyse_cli(args):
    import analysis
    folders, notes = analysis.run_folders(args.runs)
    if not folders:
        raise SystemExit(f"error: no run folder among --runs: {'; '.join(notes)}")
    summaries, figures = analyse_runs(args.runs, args.cliff_drop, args.cliff_window, plots=not args.no_plots,
                                      report=args.report, pre_cliff_steps=args.pre_cliff_steps)
    if args.json:
        print(json.dumps({"cliff_drop": args.cliff_drop, "cliff_window": args.cliff_window,
                          "outcome_rule": analysis.OUTCOME_RULE, "runs": summaries, "cells": analysis.cells(summaries),
                          "figures": figures}, indent=1))
        return
    if args.dose:
        return _dose_cli(args, summaries)
    tables = ((analysis.run_legend(args.cliff_drop, args.cliff_window), analysis.RUN_HEADERS, analysis.run_rows(summaries)),
              (analysis.CELL_LEGEND, *analysis.cell_table(summaries)),
              (analysis.TERM_MECH_LEGEND, analysis.TERM_MECH_HEADERS, analysis.terminal_mechanism_rows(summaries)))
    for legend, headers, rows in tables:
        print(analysis.text_table(headers, rows))
        print(legend + "\n")
    written = sum(len(s["plots"]) for s in summaries)
    if written:
        print(f"plots: {written} PNGs in the run folders (acc.png, grad.png, length.png)")
    if figures:
        print(f"figures: {len(figures)} PNGs (map, cells, Shared vs Isolated) in {analysis.figures_folder(args.report)}")
    if args.report:
        print(f"report: {args.report} (with per-role mechanisms, before-the-cliff and capture tables)")


def _dose_cli(args, summaries):
    """The dose-response of the runs against --dose KNOB: a table, and its figure at --dose-figure."""
    import analysis
    try:
        points = analysis.dose(summaries, args.dose.replace("-", "_"))
    except ValueError as e:
        sys.exit(f"error: {e}")
    if args.json:
        print(json.dumps(points, indent=1))
    else:
        print(analysis.text_table(analysis.DOSE_HEADERS, analysis.dose_rows(points), width=None))   # whole cells
        print(f"accuracy %, mean ±sd over seeds; norm / coherence / share: means over each run, then over seeds "
              f"(roles abbreviated); knob {args.dose}")
        for lr in dict.fromkeys(p["lr"] for p in points):   # how each role's norm scales with the knob
            slopes = {r: analysis.dose_slope(points, lr, r) for r in sorted({r for p in points for r in p["norm"]})}
            fits = ", ".join(f"{r} {b:+.2f}" for r, b in slopes.items() if b is not None)
            if fits:
                print(f"lr {analysis.lr_label(lr)}: norm/opt step ~ {args.dose}^b, b = {fits} (least squares, log-log)")
        print()
    if args.dose_figure:
        import plots
        try:
            path = plots.plot_dose(points, args.dose, args.dose_figure)
            print(f"figure: {path}")
        except ImportError as e:
            print(str(e), file=sys.stderr)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown in --help, except None: those flags' help says what unset means."""
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def _analyse_flags(p):
    """eval.py --runs' flags: analysing run folders."""
    import analysis
    a = p.add_argument_group("analyse run folders")
    a.add_argument("--runs", nargs="+", help="run folders written by train.py to analyse (writes PNG plots into them)")
    a.add_argument("--cliff-drop", type=float, default=analysis.CLIFF_DROP,
                   help="cliff threshold: percentage points below the peak")
    a.add_argument("--cliff-window", type=int, default=analysis.CLIFF_WINDOW,
                   help="how many last evaluations must all lie after the peak and below the threshold")
    a.add_argument("--pre-cliff-steps", type=int, default=None,
                   help="training steps just before a cliff to compare with earlier ones (default: those since the "
                   "evaluation before the cliff step)")
    a.add_argument("--report", default=None, help="write a Markdown report of the runs to this path, and its figures "
                   "(map, per-cell mechanisms, Shared vs Isolated) next to it: runs/report.md -> runs/report-figures/")
    a.add_argument("--no-plots", action="store_true", help="write no PNG plots (neither --runs' nor --report's)")
    a.add_argument("--dose", default=None, metavar="KNOB", help="a dose-response instead of the tables: the runs "
                   "against a config value (n-voters, toy-check, eval-rounds, max-workers) or `damping` (none, damp, "
                   "placebo), per lr")
    a.add_argument("--dose-figure", default=None, metavar="PNG", help="with --dose: draw it into this PNG")


def _parser():
    import analysis
    import tasks
    p = flags.Parser(
        prog="eval.py", description="Evaluate a workflow (--workflow/--task/--scale, or --checkpoint) or analyse run folders (--runs).",
        epilog=f"Outcomes: {analysis.OUTCOME_RULE}. Dips: {analysis.DIP_RULE}. Both --runs and --report write PNG plots (acc.png, grad.png, "
               "length.png into each run folder; with --report also the map and per-cell figures next to the "
               "report); --no-plots writes none. Run-folder format: docs/RUNFOLDER.md.",
        formatter_class=_Help)
    _analyse_flags(p)
    e = p.add_argument_group("evaluate a model or checkpoint (unset flags come from the checkpoint's run, else the default)")
    e.add_argument("--checkpoint", default=None, help="a run folder (its ckpt-best, else ckpt-last) or RUN/ckpt-N; "
                   "unset evaluates the base model")
    e.add_argument("--workflow", choices=sorted(workflows.WORKFLOWS), help="workflow to evaluate")
    e.add_argument("--task", choices=list(taskkinds.TASK_KINDS), help="task kind (default: the checkpoint run's, else math)")
    e.add_argument("--data", default=None, help=f"data set ({', '.join(tasks.DATA_SETS)}) or .jsonl file; unset: the "
                   "run's --eval-data or --data, else the task kind's (toy_TASK at --scale toy, dapo_math / deepcoder otherwise)")
    e.add_argument("--scale", default=None, help="toy, 0.6b, 1.7b, 4b, smollm2-135m, or a local model folder (default: toy)")
    e.add_argument("--sharing", default=None, choices=["shared", "isolated"], help="adapter sharing (default: shared)")
    e.add_argument("--isolation", default=None, choices=["lora", "full"], help="what a role's weights are (default: lora)")
    e.add_argument("--toy-seed", type=int, default=None, help="toy world only: the toy model's warm-start seed "
                   "(train.py's --toy-seed; default: the checkpoint run's, else 0)")
    flags.add_workflow_flags(e)   # unset: the checkpoint run's, else the workflow's default
    e.add_argument("--samples", type=int, default=1, help="episodes per problem; > 1 adds unbiased pass@k")
    e.add_argument("--problems", type=int, default=None, help="test problems to draw (capped at the split's size); "
                   "unset: the run's evaluation set, else the whole test split")
    e.add_argument("--batch-size", type=int, default=None, help="problems per rollout batch (default: the checkpoint "
                   "run's episodes per step, else 16; the draws do not depend on it)")
    e.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the checkpoint "
                   "run's, else the paper's 0.7)")
    e.add_argument("--top-p", type=float, default=None, help="nucleus sampling's mass (default: the checkpoint run's, "
                   "else 1, the paper's)")
    e.add_argument("--max-new-tokens", type=int, default=None, help="completion length limit per call (default: "
                   "tasks.length_limits: 48 at --scale toy, the paper's 5120 math / 2048 code)")
    e.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="prompt length limit per call, 0 for none (default: the checkpoint run's, its none included, "
                   "else 400 at --scale toy, else none)")
    e.add_argument("--max-embed-tokens", type=int, default=None,
                   help="tokens kept of a solution embedded in a later prompt (default: the checkpoint run's, "
                   "else none at --scale toy, else tasks.MAX_EMBED_TOKENS)")
    e.add_argument("--instruction", default=None, metavar="TEXT", help="the generator's instruction for this "
                   "evaluation instead of the task kind's (a base rate under another wording; real models only)")
    e.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    e.add_argument("--seed", type=int, default=None, help="seed of the sampler's draws (default: the checkpoint run's "
                   "--seed, so that a checkpoint scores as its run's evaluation did, else 0); --problems N draws its "
                   "subset with seed 0 whatever this is, as train.py does")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--quiet", action="store_true", help="no progress bars and no notes on stderr")
    return p


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    if args.cliff_window < 1 or args.cliff_drop < 0 or (args.pre_cliff_steps or 1) < 1:
        p.error("--cliff-window and --pre-cliff-steps must be >= 1 and --cliff-drop >= 0")
    if args.runs:
        _analyse_cli(args)
    elif args.checkpoint or args.workflow:
        if min(args.samples, args.problems or 1, args.batch_size or 1) < 1:
            p.error("--samples, --problems and --batch-size must be >= 1")
        _evaluate_cli(args)
    else:
        p.error("give --runs RUN [RUN ...] to analyse, or --checkpoint RUN, or --workflow [--task] to evaluate")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:   # the reader closed the pipe (`| head`): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # so the exit's flush fails silently
        sys.exit(141)
