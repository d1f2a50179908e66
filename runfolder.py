"""The run folder: what a training run writes, how a run stops, and how a stopped or killed run
continues.

Files (every field: docs/RUNFOLDER.md): config.json (with the run's provenance: commit, dirty
tree, library versions, the base model's sha256), metrics.jsonl (one object per step),
eval.jsonl, samples.jsonl (transcripts), ckpt-last/ and ckpt-best/ (adapters in PEFT layout +
optimizer, scheduler and damping states), and `done` at the end. Rank 0 alone writes them.

- A save is recoverable at every instant: write FOLDER.tmp (state.pt last, itself through a
  rename, listing every file of the checkpoint), move FOLDER aside to FOLDER.old, move
  FOLDER.tmp in, delete FOLDER.old, always through a rename to FOLDER.del first
  (`save_checkpoint`, `publish`, `remove`); `find_checkpoint` finishes whichever save a kill
  left, choosing by completeness in the order of a save, never by the highest step.
- `open_run` on --resume restores ckpt-last and drops every log record after its step
  (`truncate_jsonl`, through a rename, so a kill keeps every line), a ckpt-best of a later
  step, and a `done` the run will go past. With the same seed a resumed run logs exactly what
  an uninterrupted one would have: the problems of step k and every draw are keyed by the step
  (seeds.py), not by a generator's state.
- How a run stops (`interrupts`, `aborted`, `stop_now`, `broken`): Ctrl-C or SIGTERM finishes
  the step, saves ckpt-last and exits 130; a second one aborts at once, saying what was kept; a
  fork's contract broken mid-run (taskkinds.Refused) ends it in one line, exit 2.
"""
import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

FILES = ("metrics", "eval", "samples")


def files(out: str) -> dict:
    """{name: path} of the run's JSONL logs."""
    return {k: os.path.join(out, f"{k}.jsonl") for k in FILES}


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------- logs

def log_jsonl(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_jsonl(path, last_step):
    """Drop records after `last_step` (logged after the checkpoint a resume starts from). A run
    killed mid-append leaves a torn line that does not parse: it is dropped, and said so. The
    kept lines go to PATH.tmp, which then replaces PATH: killed at any point, PATH holds either
    every old line or the kept ones."""
    if not os.path.isfile(path):
        return
    keep = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                step = json.loads(line).get("step", 0)
            except (json.JSONDecodeError, AttributeError):
                print(f"resume: dropped a torn line {os.path.basename(path)}:{n}", file=sys.stderr)
                continue
            if step <= last_step:
                keep.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(policy, optimizers, schedulers, state, folder):
    """Adapters (PEFT layout) + optimizer, scheduler and damping states, recoverable at every
    instant: write FOLDER.tmp (state.pt last, itself via a rename, with the size of every other
    file it holds), then `publish` it. find_checkpoint reads whichever complete one a kill left."""
    import torch
    tmp = folder + ".tmp"
    remove(tmp)
    policy.save(tmp)
    manifest = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
                for d, _, names in os.walk(tmp) for f in names}
    torch.save({"optimizers": {k: o.state_dict() for k, o in optimizers.items()},
                "schedulers": {k: s.state_dict() for k, s in schedulers.items()}, "files": manifest, **state},
               os.path.join(tmp, "state.pt.part"))
    os.replace(os.path.join(tmp, "state.pt.part"), os.path.join(tmp, "state.pt"))
    publish(tmp, folder)


def remove(folder):
    """Delete a folder so that no kill leaves it half deleted under its name: it is renamed to
    FOLDER.del first (a name nothing reads), then deleted."""
    if os.path.isdir(folder):
        shutil.rmtree(folder + ".del", ignore_errors=True)   # a killed delete's leftover
        os.replace(folder, folder + ".del")
        shutil.rmtree(folder + ".del", ignore_errors=True)


def publish(new, folder):
    """Put the complete checkpoint `new` at `folder`: the old one aside as FOLDER.old, the new
    one in, the old one removed. Killed at any point, FOLDER, FOLDER.tmp or FOLDER.old holds a
    complete checkpoint, and none of them is ever half deleted."""
    old = folder + ".old"
    if os.path.isdir(folder):
        remove(old)
        os.replace(folder, old)
    os.replace(new, folder)
    remove(old)


def checkpoint_step(folder):
    """The step of a complete checkpoint folder, else None: state.pt loads and every file it
    lists is there at its size (a folder without the list: state.pt alone, written last)."""
    import torch
    path = os.path.join(folder, "state.pt")
    if not os.path.isfile(path):
        return None
    try:
        st = torch.load(path, weights_only=False, map_location="cpu")
    except Exception:   # torn or unreadable: not a checkpoint
        return None
    for rel, size in st.get("files", {}).items():
        f = os.path.join(folder, rel)
        if not os.path.isfile(f) or os.path.getsize(f) != size:
            return None
    return st["step"]


def find_checkpoint(out, name="ckpt-last", upto=None):
    """(folder, step) of the checkpoint NAME resumes from, published as NAME, every other copy
    removed; (None, None) if there is none. The first complete one of NAME (what the last
    finished save left), NAME.tmp (a save complete but not moved in) and NAME.old (the one
    before, when a kill came between moving NAME aside and moving NAME.tmp in) is taken: the
    order a save goes through, not the highest step. With `upto`, a checkpoint of a later step
    is not taken: it comes from the part of the run that a resume from `upto` replays."""
    target = os.path.join(out, name)
    folder = step = None
    for cand in (target, target + ".tmp", target + ".old"):
        s = checkpoint_step(cand)
        if s is None:
            continue
        if upto is not None and s > upto:
            print(f"resume: {os.path.basename(cand)} is of step {s}, after step {upto} the run resumes from: removed")
            continue
        folder, step = cand, s
        break
    if folder is not None and folder != target:  # finish the save that was interrupted
        print(f"resume: {name} was left mid-save; using {os.path.basename(folder)} (step {step})")
        if folder.endswith(".tmp"):
            publish(folder, target)
        else:                                      # .old: NAME is missing or incomplete
            remove(target)
            os.replace(folder, target)
    for suffix in ("", ".tmp", ".old") if folder is None else (".tmp", ".old"):
        remove(target + suffix)
    for suffix in (".del", ".tmp.del", ".old.del"):        # what a killed delete left
        shutil.rmtree(target + suffix, ignore_errors=True)
    return (target, step) if folder is not None else (None, None)


# ----------------------------------------------------------------------------- provenance

# bytes: larger weight files are not hashed (null), a hub model is named by its id; the fp32
# SmolLM2-135M (538 MB, gguf_models.py) is under it, so its runs record the model's sha256
HASH_LIMIT = 2**30


def _git(*argv):
    """Output of a git command in this file's repository, or None without git or a repository."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, *argv], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def file_sha256(path: str) -> str | None:
    """sha256 of a file of at most HASH_LIMIT bytes, else None."""
    if not os.path.isfile(path) or os.path.getsize(path) > HASH_LIMIT:
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def provenance(model_dir: str | None) -> dict:
    """What a run came from: the code's commit (and whether tracked files differ from it), the
    library versions, and the sha256 of the base model's weights file (the toy model's)."""
    import torch
    import transformers
    status = _git("status", "--porcelain", "--untracked-files=no")
    weights = os.path.join(model_dir, "model.safetensors") if model_dir else ""
    return {"commit": _git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "model_sha256": file_sha256(weights)}


def _record_provenance(args, now: dict) -> None:
    """A fresh run records `now`; a resume that runs other code or another model appends it to
    `provenance_resumed` and says so in one line."""
    first = getattr(args, "provenance", None)
    if first is None:
        args.provenance = now
        return
    keys = ("commit", "dirty", "model_sha256", "torch", "transformers")
    if any(first.get(k) != now.get(k) for k in keys):
        args.provenance_resumed = [*(getattr(args, "provenance_resumed", None) or []), now]
        print(f"warning: resuming with other code or another model than the run started with: "
              f"{', '.join(f'{k} {first.get(k)} -> {now.get(k)}' for k in keys if first.get(k) != now.get(k))}",
              file=sys.stderr)


# ----------------------------------------------------------------------------- a run's state

def open_run(run):
    """Resume from the checkpoint ckpt-last holds, or start the run folder afresh. Rank 0 alone
    touches the files; every rank then loads the same checkpoint."""
    args = run.args
    ck = step = None
    if run.main:
        if not os.path.isdir(args.out):
            run.created.append(args.out)
        os.makedirs(args.out, exist_ok=True)
        if args.resume:
            ck, step = resume_folder(args, run.files)
        _record_provenance(args, provenance(getattr(run.policy.model, "name_or_path", None)))
        path = os.path.join(args.out, "config.json")
        if not os.path.isfile(path):
            run.created.append(path)
        with open(path + ".tmp", "w") as f:
            json.dump(vars(args), f, indent=2)
        os.replace(path + ".tmp", path)
        print("config: " + json.dumps(vars(args)))
    if run.comm:
        ck, step = run.comm.gather((ck, step))[0]
    if ck is not None:
        restore(run, ck, step)


def resume_folder(args, logs):
    """Put the run folder back at its last checkpoint: (ckpt-last, its step) or (None, None).
    Every log record after that step goes, and so does a ckpt-best of a later step; a run that
    goes on past its `done` loses the file at once, so a kill midway cannot leave it finished."""
    ck, step = find_checkpoint(args.out)
    find_checkpoint(args.out, "ckpt-best", upto=step if ck else -1)
    for f in logs.values():
        truncate_jsonl(f, step if ck else -1)
    done = os.path.join(args.out, "done")
    if os.path.exists(done) and (ck is None or step < args.steps):
        os.remove(done)
    print(f"resumed {args.out} at step {step} from {os.path.basename(ck)}" if ck else
          f"resume: {args.out} has no complete checkpoint; starting it over")
    return ck, step


def restore(run, ck, step):
    """Adapters, optimizer and scheduler states and the damping EMA. Nothing else is needed:
    every random draw is keyed by the step (seeds.py), so no generator state is saved. The best
    accuracy is ckpt-best's, or none when the resume removed it."""
    import torch
    run.policy.load_adapters(ck)
    st = torch.load(os.path.join(ck, "state.pt"), weights_only=False, map_location="cpu")  # optimizers move it to their parameters
    for k in run.optimizers:
        run.optimizers[k].load_state_dict(st["optimizers"][k])
        run.schedulers[k].load_state_dict(st["schedulers"][k])
    if run.damp is not None:
        run.damp.load_state_dict(st["damp"], device=run.policy.model.device)
    best = os.path.join(run.args.out, "ckpt-best", "state.pt")
    run.start = step
    run.best = torch.load(best, weights_only=False, map_location="cpu")["best"] if os.path.isfile(best) else -1.0
    accs = [r["acc"] for r in read_jsonl(run.files["eval"])]
    run.last_acc = accs[-1] if accs else None


def checkpoint(run, step, name="ckpt-last"):
    """Rank 0 saves the run's state at `step`; every rank may call this."""
    if not run.main:
        return
    state = {"step": step, "best": run.best}
    if run.damp is not None:
        state["damp"] = run.damp.state_dict()
    save_checkpoint(run.policy, run.optimizers, run.schedulers, state, os.path.join(run.args.out, name))


def remove_fresh(run):
    """Undo a run stopped in its step-0 evaluation: only that attempt wrote the logs, so they
    go, with ckpt-best and every file and folder this process created."""
    for path in [*run.files.values(), os.path.join(run.args.out, "ckpt-best"), *reversed(run.created)]:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.isfile(path):
            os.remove(path)


def mark_done(out):
    """The empty `done` file, written last: the run finished."""
    open(os.path.join(out, "done"), "w").close()


# ----------------------------------------------------------------------------- a step's records

def log_transcripts(path, step, episodes, samples):
    """Every call of a few episodes, with what it was paid (its episode's reward, or under
    --credit own its own text's grade: grpo._paid) and its advantage."""
    import grpo
    adv = {(s.problem_id, s.rollout, s.call): s.advantage for s in samples}
    for e in episodes:
        for i, c in enumerate(e.calls):
            log_jsonl(path, {"step": step, "problem_id": e.problem_id, "episode": e.rollout, "role": c.role,
                             "slot": c.slot, "prompt": c.messages[-1]["content"], "completion": c.text,
                             "reward": grpo._paid(e, c), "advantage": adv.get((e.problem_id, e.rollout, i))})


def step_record(run, step, episodes, stats, times):
    """The metrics.jsonl object of one step (sums over every rank's episodes)."""
    roles = run.policy.roles
    local = [sum(e.reward for e in episodes), len(episodes), sum(len(c.completion_ids) for e in episodes for c in e.calls),
             *(sum(c.role == r for e in episodes for c in e.calls) for r in roles),
             *(sum(e.fallbacks.get(r, 0) for e in episodes) for r in roles),
             *(sum(c.role == r and c.reward is not None and c.reward != e.reward for e in episodes for c in e.calls)
               for r in roles),
             *(sum(c.role == r and c.prompt_cut for e in episodes for c in e.calls) for r in roles)]
    reward, n, tokens, *rest = run.comm.sum(local) if run.comm else local
    k = len(roles)
    calls, fallbacks, apart, cut = rest[:k], rest[k:2 * k], rest[2 * k:3 * k], rest[3 * k:]
    for r, q in stats["roles"].items():
        q["fallback_rate"] = fallbacks[roles.index(r)] / max(1, calls[roles.index(r)])
        q["paid_apart"] = apart[roles.index(r)] / max(1, calls[roles.index(r)])
        q["prompt_cut"] = cut[roles.index(r)] / max(1, calls[roles.index(r)])
    rollout_s = run.comm.sum(times[1] - times[0]) / run.comm.world if run.comm else times[1] - times[0]
    m = {"step": step, "reward": reward / n, "lr": run.schedulers[run.policy.names[0]].get_last_lr()[0], **stats,
         "time": {"rollout": times[1] - times[0], "score": times[2] - times[1],
                  "update": times[3] - times[2], "step": time.time() - times[0]},
         "tokens_per_s": tokens / max(rollout_s, 1e-9)}
    device = run.policy.model.device
    if device.type == "cuda":  # this rank's peak this step (reset at the start of the next)
        import torch
        m["cuda_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    import cudagraphs   # torch-backed, as the sampler it serves: only once a step has run
    if cudagraphs.graphs_status():   # failed captures, or graphs off: decode several times slower
        m["graph_status"] = cudagraphs.graphs_status()
    import engine   # as cudagraphs: loaded by the sampler once a step has run
    if engine.flex_status():         # ATTEND "flex" failed: decoding with "pages" instead
        m["attend_status"] = engine.flex_status()
    return m


def step_line(step, steps, m, last_acc):
    """The console line of a step: its vital signs, one fixed format."""
    roles = m["roles"]
    short = {r: r[:3] for r in roles}
    fmt = lambda key, f: " ".join(f"{short[r]} {roles[r].get(key, 0):{f}}" for r in roles)  # noqa: E731
    acc = "  -  " if last_acc is None else f"{last_acc:.3f}"
    return (f"step {step:4d}/{steps} | reward {m['reward']:.3f} | eval {acc} | len {fmt('len', '.1f')} | "
            f"clip {max((q.get('clip_frac') or 0 for q in roles.values()), default=0):.3f} | "
            f"gnorm {fmt('grad_norm', '.3f')} | {m['tokens_per_s']:.0f} tok/s | {m['time']['step']:.1f}s"
            + (f" | graphs {m['graph_status']}" if "graph_status" in m else "")
            + (f" | attend {m['attend_status']}" if "attend_status" in m else ""))


def log_step(run, step, m, episodes, samples):
    """metrics.jsonl (and the tracker), transcripts: rank 0 only; the first step whose prompts
    were cut at --max-prompt-tokens says so once (a cut prompt keeps its end, so it loses its
    instruction and problem first: the run goes on, the role reading less than it was given)."""
    if not run.main:
        return
    args = run.args
    cut = {r: q["prompt_cut"] for r, q in m["roles"].items() if q.get("prompt_cut")}
    if cut:
        import taskkinds
        taskkinds.note_once(("prompt_cut", args.out), f"note: step {step}: prompts cut at --max-prompt-tokens "
                            f"{args.max_prompt_tokens}, keeping their ends: "
                            + ", ".join(f"{r} {v:.0%}" for r, v in cut.items()) + "; metrics.jsonl logs it per "
                            "role (prompt_cut) every step; raise --max-prompt-tokens or lower --max-embed-tokens")
    log_jsonl(run.files["metrics"], m)
    if run.tracker is not None:
        run.tracker.log(m, step)
    if args.samples_every and (step % args.samples_every == 0 or step == 1):
        log_transcripts(run.files["samples"], step, episodes[:2], samples)


# ----------------------------------------------------------------------------- how a run stops

@contextlib.contextmanager
def broken(run):
    """A fork's workflow or reward that breaks its contract once the run has started (a branch
    its dry run did not take, a reward out of [0, 1]: taskkinds.Refused) ends the run in one
    line, exit 2; a fresh run with no checkpoint yet leaves nothing, so the same command runs
    again once the fork is fixed. Under torchrun every rank gets the refusal
    (parallel.together), and no rank leaves before rank 0 has cleaned up: torchrun stops every
    rank once one exits non-zero."""
    import taskkinds
    try:
        yield
    except taskkinds.Refused as e:
        saved = os.path.isdir(os.path.join(run.args.out, "ckpt-last"))
        if run.main and not run.args.resume and not saved:
            remove_fresh(run)
        if run.comm and getattr(e, "every_rank", False):   # raised alone, the others wait elsewhere
            run.comm.barrier()
        fail(f"{e}" + (f"; once fixed, --resume {run.args.out} continues from ckpt-last" if saved else ""))


@contextlib.contextmanager
def interrupts():
    """A list that gets a signal number on Ctrl-C or SIGTERM: the loop finishes its step, saves
    and exits. A second signal raises KeyboardInterrupt at once."""
    from tqdm import tqdm
    stop = []

    def on_signal(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(signum)
        tqdm.write("interrupt: finishing this step, then saving (Ctrl-C again to abort without saving)")
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def aborted(run):
    """A second Ctrl-C aborts at once: one line on what was kept, no traceback, exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"\naborted: this step was not saved; --resume {run.args.out} continues from the last save "
              "(ckpt-last)", file=sys.stderr)
        sys.exit(130)


def stop_now(run, bar, step):
    """After a Ctrl-C: the step is saved; say how to continue and exit 130."""
    import parallel
    bar.close()
    if run.main:
        if run.tracker is not None:
            run.tracker.close()
        print(f"interrupted: saved {run.args.out}/ckpt-last at step {step}; continue with --resume {run.args.out}")
    parallel.close(run.comm)
    sys.exit(130)


def finish(run):
    import parallel
    if run.main:
        if run.tracker is not None:
            run.tracker.close()
        mark_done(run.args.out)
        print(f"done: {run.args.out} (best eval {run.best:.3f}); analyse with `python eval.py --runs {run.args.out}`")
    parallel.close(run.comm)
