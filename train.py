"""Train a multi-agent LLM workflow end to end with GRPO, Shared- or Isolated-Policy.

    python train.py                                   # toy world on a CPU: Voting, Shared, math
    python train.py --workflow eval_opt --task code --sharing isolated
    python train.py --scale 0.6b --data dapo_math --device cuda          # the paper's setting
    python train.py --resume runs/voting-math-shared-toy-s0              # continue a stopped run

One training step, literally below in `main`: draw problems, run the workflow G times on each
(rollout.py + workflows.py), grade each episode's final answer (rewards.py) and copy the 0/1
reward to every call, group advantages by (problem, slot), update each role's weights
(grpo.py), log. The untrained workflow is evaluated at step 0 and every --eval-every steps on a
fixed held-out set (pass@1 at the training temperature).

Defaults: the paper's hyper-parameters for the real scales (64 problems x 8 rollouts, AdamW
2e-5, 15 warm-up steps then cosine, LoRA r64/alpha 32, clip 0.2/0.28, dual clip 3, 500
steps, evaluation every 5), and for `--scale toy` values sized so that the default run
finishes on 2 CPU cores in under 10 minutes; `--help` shows both. The resolved configuration
is printed once and saved as RUN/config.json.

Run folder: config.json, metrics.jsonl (one object per step), eval.jsonl, samples.jsonl
(transcripts), ckpt-last/ and ckpt-best/ (adapters in PEFT layout + optimizer, scheduler and
RNG states, written atomically), and `done` at the end. Ctrl-C saves ckpt-last and exits;
`--resume RUN` continues from it and, with the same seed, logs the same metrics as a run that
never stopped (the problems of step k and every RNG state are restored, not re-drawn).
"""
import argparse
import json
import os
import random
import shutil
import signal
import sys
import time

# (toy value, paper value) of every flag whose default depends on the scale (None: all of the
# test split); the length limits come from tasks.length_limits
SCALE_DEFAULTS = {
    "problems_per_step": (16, 64), "group_size": (8, 8), "steps": (100, 500), "lr": (1e-3, 2e-5),
    "warmup_steps": (5, 15), "lora_rank": (16, 64), "lora_alpha": (32, 32), "eval_every": (20, 5),
    "eval_problems": (512, None), "token_budget": (16384, 16384),
}


def scale_default(name):
    toy, paper = SCALE_DEFAULTS[name]
    return f" (default: {toy} at --scale toy, {paper if paper is not None else 'per task'} otherwise)"


def _per_task(d):
    return ", ".join(f"{v} {k}" for k, v in d.items())


def parse_args(argv=None):
    import tasks
    import toy
    import workflows  # torch-free: the registry gives the workflow choices and role names
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # --- what to train
    ap.add_argument("--workflow", default="voting", choices=sorted(workflows.WORKFLOWS),
                    help="multi-agent workflow (single = one-call control) (default: %(default)s)")
    ap.add_argument("--task", default="math", choices=workflows.TASKS, help="task kind (default: %(default)s)")
    ap.add_argument("--data", default=None, help="data set name (tasks.py) or a .jsonl file "
                    "(default: toy_math/toy_code at --scale toy, dapo_math/deepcoder otherwise)")
    ap.add_argument("--eval-data", default=None, help="held-out data set or .jsonl file "
                    "(default: the test split of --data; a .jsonl --data has none, so pass one)")
    ap.add_argument("--scale", default="toy", help="toy, 0.6b, 1.7b, 4b, or a local model folder (default: %(default)s)")
    ap.add_argument("--sharing", default="shared", choices=["shared", "isolated"],
                    help="shared: one set of trainable weights for all roles; isolated: one per role (default: %(default)s)")
    ap.add_argument("--isolation", default="lora", choices=["lora", "full"],
                    help="what a role's weights are: a LoRA adapter, or a full copy of the model (default: %(default)s)")
    # --- rollout
    ap.add_argument("--problems-per-step", type=int, default=None, help="problems per training step" + scale_default("problems_per_step"))
    ap.add_argument("--group-size", type=int, default=None, help="rollouts per problem (G)" + scale_default("group_size"))
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature, training and evaluation (default: %(default)s)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="completion limit per call (default: %d at --scale toy, the paper's %s otherwise)" % (toy.MAX_NEW_TOKENS, _per_task(tasks.MAX_NEW_TOKENS)))
    ap.add_argument("--max-prompt-tokens", type=int, default=None, help="prompt limit per call, longer prompts keep their end (default: %d at --scale toy, none otherwise)" % toy.MAX_PROMPT_TOKENS)
    ap.add_argument("--max-rows", type=int, default=None, help="rows per generate call (memory cap; default: a whole stage at once)")
    # --- optimisation (grpo.py)
    ap.add_argument("--steps", type=int, default=None, help="training steps" + scale_default("steps"))
    ap.add_argument("--lr", type=float, default=None, help="AdamW learning rate" + scale_default("lr"))
    ap.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up, then cosine to 0" + scale_default("warmup_steps"))
    ap.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: %(default)s)")
    ap.add_argument("--mini-batch", type=int, default=None, help="sequences per optimizer step (default: problems-per-step x group-size, the paper's 512)")
    ap.add_argument("--token-budget", type=int, default=None, help="rows x padded length per micro-batch" + scale_default("token_budget"))
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping per optimizer step (default: %(default)s)")
    ap.add_argument("--clip-low", type=float, default=0.2, help="ratio clip below 1 (default: %(default)s)")
    ap.add_argument("--clip-high", type=float, default=0.28, help="ratio clip above 1, clip-higher (default: %(default)s)")
    ap.add_argument("--clip-c", type=float, default=3.0, help="dual clip for negative advantages (default: %(default)s)")
    ap.add_argument("--loss-norm", default="seq", choices=["seq", "token"], help="seq: mean of per-sequence token means (paper); token: mean over all tokens (default: %(default)s)")
    ap.add_argument("--adv-group", default="slot", choices=["slot", "role"], help="advantage groups: (problem, slot) as the paper, or (problem, role) (default: %(default)s)")
    ap.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-base coefficient for every role, k3 estimator (default: %(default)s, as the paper)")
    ap.add_argument("--kl-coef-role", action="append", default=[], metavar="ROLE=VALUE", help="per-role KL coefficient, repeatable")
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA rank" + scale_default("lora_rank"))
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha" + scale_default("lora_alpha"))
    # --- evaluation and logging
    ap.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (0: only at start and end)" + scale_default("eval_every"))
    ap.add_argument("--eval-problems", type=int, default=None, help="held-out problems per evaluation" + scale_default("eval_problems") + "; all of the test split otherwise")
    ap.add_argument("--samples-every", type=int, default=10, help="write transcripts of 2 episodes every N steps (default: %(default)s)")
    ap.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps, and at the end (default: %(default)s)")
    # --- run
    ap.add_argument("--seed", type=int, default=0, help="seed of every random choice (default: %(default)s)")
    ap.add_argument("--out", default=None, help="run folder (default: runs/WORKFLOW-TASK-SHARING-SCALE-sSEED)")
    ap.add_argument("--resume", default=None, metavar="RUN", help="continue the run in this folder with its saved configuration")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="base model dtype (default: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)

    if args.resume:  # the saved configuration wins, except where to run and how long
        path = os.path.join(args.resume, "config.json")
        if not os.path.isfile(path):
            ap.error(f"--resume {args.resume}: no config.json there, so it is not a run folder")
        saved = json.load(open(path))
        keep = {"resume": args.resume, "device": args.device, "quiet": args.quiet,
                "steps": args.steps or saved["steps"]}
        args = argparse.Namespace(**{**saved, **keep})
        args.out = args.resume
        return args

    real = 1 if args.scale != "toy" else 0
    for name in SCALE_DEFAULTS:
        if getattr(args, name) is None:
            setattr(args, name, SCALE_DEFAULTS[name][real])
    default_new, default_prompt = tasks.length_limits(args.scale, args.task)
    args.max_new_tokens = args.max_new_tokens or default_new
    args.max_prompt_tokens = args.max_prompt_tokens or default_prompt
    args.data = args.data or tasks.default_data(args.scale, args.task)
    if args.mini_batch is None:
        args.mini_batch = args.problems_per_step * args.group_size
    kl_role = {}
    for item in args.kl_coef_role:
        role, _, value = item.partition("=")
        try:
            kl_role[role] = float(value)
        except ValueError:
            ap.error(f"--kl-coef-role {item!r}: expected ROLE=VALUE with a number")
    for role in set(kl_role) - set(workflows.ROLES[args.workflow]):
        ap.error(f"--kl-coef-role {role}: not a role of {args.workflow} ({', '.join(workflows.ROLES[args.workflow])})")
    args.kl_coef_role = kl_role
    args.out = args.out or os.path.join("runs", f"{args.workflow}-{args.task}-{args.sharing}-"
                                        f"{os.path.basename(os.path.normpath(args.scale))}-s{args.seed}")
    for name in ("problems_per_step", "group_size", "steps", "mini_batch", "max_new_tokens", "token_budget"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.temperature and args.temperature != 0:
        ap.error("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        ap.error("--top-p must be in (0, 1]")
    import policies
    try:
        policies.check_scale(args.scale)
    except ValueError as e:
        ap.error(str(e))
    if os.path.exists(os.path.join(args.out, "config.json")):
        ap.error(f"run folder {args.out} exists; pass --resume {args.out} to continue it or --out to start anew")
    return args


# ----------------------------------------------------------------------------- helpers

def log_jsonl(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_jsonl(path, last_step):
    """Drop records after `last_step` (logged after the checkpoint a resume starts from)."""
    if os.path.isfile(path):
        keep = [line for line in open(path) if line.strip() and json.loads(line).get("step", 0) <= last_step]
        with open(path, "w") as f:
            f.writelines(keep)


def save_checkpoint(policy, optimizers, schedulers, state, folder):
    """Adapters (PEFT layout) + optimizer, scheduler and RNG states; atomic via rename."""
    import torch
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save(tmp)
    torch.save({"optimizers": {k: o.state_dict() for k, o in optimizers.items()},
                "schedulers": {k: s.state_dict() for k, s in schedulers.items()}, **state},
               os.path.join(tmp, "state.pt"))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def evaluate(llm, args, problems, step):
    """pass@1 of the workflow on the held-out problems, with per-role parse and length stats."""
    import eval as ev
    # as many episodes at once as a training step runs, so evaluation fits where training fits
    res = ev.evaluate(llm, args.workflow, problems, args.task, samples=1,
                      batch_size=args.problems_per_step * args.group_size, progress=not args.quiet)
    roles = res["quality"]["roles"]
    return {"step": step, "acc": res["pass@k"][1], "n": res["problems"],
            "parse_fail": {r: q.get("fallbacks_per_call", 0.0) for r, q in roles.items()},
            "len": {r: q.get("len_tokens", q.get("len_chars")) for r, q in roles.items()},
            "code_block_rate": {r: q.get("code_block_rate", 0.0) for r, q in roles.items()}}


def log_transcripts(path, step, episodes, samples):
    """Every call of a few episodes, with its reward and advantage."""
    adv = {(s.problem_id, s.rollout, s.call): s.advantage for s in samples}
    for e in episodes:
        for i, c in enumerate(e.calls):
            log_jsonl(path, {"step": step, "problem_id": e.problem_id, "episode": e.rollout, "role": c.role,
                             "slot": c.slot, "prompt": c.messages[-1]["content"], "completion": c.text,
                             "reward": e.reward, "advantage": adv.get((e.problem_id, e.rollout, i))})


def step_line(step, steps, m, last_acc):
    roles = m["roles"]
    short = {r: r[:3] for r in roles}
    fmt = lambda key, f: " ".join(f"{short[r]} {roles[r].get(key, 0):{f}}" for r in roles)
    acc = "  -  " if last_acc is None else f"{last_acc:.3f}"
    return (f"step {step:4d}/{steps} | reward {m['reward']:.3f} | eval {acc} | len {fmt('len', '.1f')} | "
            f"clip {max((q.get('clip_frac', 0) for q in roles.values()), default=0):.3f} | "
            f"gnorm {fmt('grad_norm', '.3f')} | {m['tokens_per_s']:.0f} tok/s | {m['time']['step']:.1f}s")


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    import grpo
    import policies
    import rewards
    import rollout
    import tasks
    import workflows

    # --- set up: model, roles, data, optimizers
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    torch.manual_seed(args.seed)
    try:
        kind = tasks.task_kind(args.data)
        if kind != args.task:
            raise ValueError(f"--data {args.data} is a {kind} data set but --task is {args.task}")
        train_set = tasks.load_task(args.data, "train", seed=args.seed)
        eval_data = args.eval_data or args.data
        if tasks.task_kind(eval_data) != args.task:
            raise ValueError(f"--eval-data {eval_data} is not a {args.task} data set")
        test_set = tasks.load_task(eval_data, "test")
        if args.eval_problems and args.eval_problems < len(test_set):  # a fixed subset: seed 0
            test_set = tasks.load_task(eval_data, "test", n=args.eval_problems, seed=0)
        model, tok = policies.load(args.scale, device, dtype, toy_task=args.task)
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        fail(str(e))
    if not train_set or not test_set:
        fail(f"--data {args.data}: empty train or test split")
    if args.data == (args.eval_data or args.data) and args.data.endswith(".jsonl"):
        print(f"warning: --data {args.data} is a file, so evaluation runs on the training problems; "
              "pass --eval-data FILE for a held-out set", file=sys.stderr)
    if args.problems_per_step > len(train_set):
        fail(f"--problems-per-step {args.problems_per_step} is more than the {len(train_set)} training problems")
    roles = workflows.ROLES[args.workflow]
    policy = policies.Policy(model, tok, roles, args.sharing, args.isolation, args.lora_rank, args.lora_alpha)
    optimizers, schedulers = grpo.make_optimizers(policy, args.lr, args.warmup_steps, args.steps,
                                                  weight_decay=args.weight_decay)
    gen = torch.Generator(device).manual_seed(args.seed)           # rollout sampling
    shuffle = torch.Generator().manual_seed(args.seed + 1)           # mini-batch shuffling
    llm = rollout.make_llm(policy, temperature=args.temperature, top_p=args.top_p,
                           max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                           generator=gen, max_rows=args.max_rows)

    os.makedirs(args.out, exist_ok=True)
    files = {k: os.path.join(args.out, f"{k}.jsonl") for k in ("metrics", "eval", "samples")}
    start, best, last_acc = 0, -1.0, None
    if args.resume and os.path.isdir(os.path.join(args.out, "ckpt-last")):
        ck = os.path.join(args.out, "ckpt-last")
        policy.load_adapters(ck)
        st = torch.load(os.path.join(ck, "state.pt"), weights_only=False)
        for k in optimizers:
            optimizers[k].load_state_dict(st["optimizers"][k])
            schedulers[k].load_state_dict(st["schedulers"][k])
        gen.set_state(st["gen"])
        shuffle.set_state(st["shuffle"])
        start, best = st["step"], st["best"]
        for f in files.values():
            truncate_jsonl(f, start)
        if os.path.isfile(files["eval"]):  # the step lines show the last evaluation until the next
            accs = [json.loads(line)["acc"] for line in open(files["eval"]) if line.strip()]
            last_acc = accs[-1] if accs else None
        print(f"resumed {args.out} at step {start}")
    elif args.resume:  # stopped before its first checkpoint: start over in the same folder
        for f in files.values():
            truncate_jsonl(f, -1)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(vars(args), f, indent=2)
    print("config: " + json.dumps(vars(args)))

    def checkpoint(step, name="ckpt-last"):
        save_checkpoint(policy, optimizers, schedulers,
                        {"step": step, "best": best, "gen": gen.get_state(), "shuffle": shuffle.get_state()},
                        os.path.join(args.out, name))

    def run_eval(step):
        # a generator of its own, so evaluations never shift the training samples
        eval_llm = rollout.make_llm(policy, temperature=args.temperature, top_p=args.top_p,
                                    max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                                    generator=torch.Generator(device).manual_seed(10_000 + step),
                                    max_rows=args.max_rows)
        rec = evaluate(eval_llm, args, test_set, step)
        log_jsonl(files["eval"], rec)
        return rec["acc"]

    if start == 0:
        last_acc = run_eval(0)
        print(f"step    0 | eval {last_acc:.3f} (untrained workflow, {len(test_set)} problems)")
    # Ctrl-C: finish the step in progress, save, exit (a second Ctrl-C stops at once)
    stop = []

    def on_sigint(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(signum)
        tqdm.write("interrupt: finishing this step, then saving (Ctrl-C again to abort without saving)")
    signal.signal(signal.SIGINT, on_sigint)

    bar = tqdm(range(start + 1, args.steps + 1), desc="train", disable=args.quiet, initial=start, total=args.steps)
    for step in bar:
        t0 = time.time()
        # 1. problems of this step: drawn from a generator seeded by (seed, step) so a resumed
        #    run sees the same ones
        batch = random.Random(args.seed * 1_000_003 + step).sample(train_set, args.problems_per_step)
        # 2. rollouts: every problem G times through the workflow
        episodes = rollout.run_episodes(llm, args.workflow, batch, args.group_size, args.task)
        t1 = time.time()
        # 3. reward: grade each final answer, copy it to every call of the episode
        for e, r in zip(episodes, rewards.score([e.final_text for e in episodes], [e.problem for e in episodes], args.task)):
            e.reward = float(r)
        t2 = time.time()
        # 4. advantages grouped by (problem, slot), then one update per role's optimizer
        samples = grpo.samples_from_episodes(episodes, group_by=args.adv_group)
        stats = grpo.update(policy, optimizers, schedulers, samples, temperature=args.temperature,
                            mini_batch=args.mini_batch, clip_low=args.clip_low, clip_high=args.clip_high,
                            clip_c=args.clip_c, loss_norm=args.loss_norm, kl_coef=args.kl_coef,
                            kl_coef_role=args.kl_coef_role, max_grad_norm=args.max_grad_norm,
                            token_budget=args.token_budget, generator=shuffle)
        t3 = time.time()
        # 5. log
        n_tokens = sum(len(c.completion_ids) for e in episodes for c in e.calls)
        calls_per_role = {r: sum(c.role == r for e in episodes for c in e.calls) for r in roles}
        for r, q in stats["roles"].items():
            q["fallback_rate"] = sum(e.fallbacks.get(r, 0) for e in episodes) / max(1, calls_per_role.get(r, 0))
        m = {"step": step, "reward": sum(e.reward for e in episodes) / len(episodes),
             "lr": schedulers[policy.names[0]].get_last_lr()[0], **stats,
             "time": {"rollout": t1 - t0, "score": t2 - t1, "update": t3 - t2, "step": time.time() - t0},
             "tokens_per_s": n_tokens / max(t1 - t0, 1e-9)}
        log_jsonl(files["metrics"], m)
        if step % args.samples_every == 0 or step == 1:
            log_transcripts(files["samples"], step, episodes[:2], samples)
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            last_acc = run_eval(step)
            if last_acc > best:
                best = last_acc
                checkpoint(step, "ckpt-best")
        if step % args.save_every == 0 or step == args.steps:
            checkpoint(step)
        bar.set_postfix(reward=f"{m['reward']:.3f}", acc="-" if last_acc is None else f"{last_acc:.3f}")
        (print if args.quiet else tqdm.write)(step_line(step, args.steps, m, last_acc))
        if stop:
            checkpoint(step)
            bar.close()
            print(f"interrupted: saved {args.out}/ckpt-last at step {step}; continue with --resume {args.out}")
            sys.exit(130)
    bar.close()
    open(os.path.join(args.out, "done"), "w").close()
    print(f"done: {args.out} (best eval {best:.3f}); analyse with `python eval.py --runs {args.out}`")


if __name__ == "__main__":
    main()
