"""Train a multi-agent LLM workflow end to end with GRPO, Shared- or Isolated-Policy.

    python train.py                                   # toy world on a CPU: Voting, Shared, math
    python train.py --workflow eval_opt --task code --sharing isolated
    python train.py --scale 0.6b --data dapo_math --device cuda          # the paper's setting
    python train.py --resume runs/voting-math-shared-toy-s0              # continue a stopped run

One training step, literally below in `main`:
  1. draw this step's problems (seeded by (seed, step), so a resumed run draws the same ones);
  2. run the workflow G times on each (rollout.py + workflows.py);
  3. grade each episode's final answer (rewards.py) and copy the 0/1 reward to every call;
  4. group advantages by (problem, slot) and update each role's weights (grpo.py);
  5. log, evaluate every --eval-every steps, checkpoint every --save-every steps.
The untrained workflow is evaluated at step 0 on a fixed held-out set (pass@1 at the training
temperature); ckpt-best holds the best evaluation so far, step 0 included.

Defaults: the paper's hyper-parameters for the real scales (64 problems x 8 rollouts, AdamW
2e-5, 15 warm-up steps then cosine, LoRA r64/alpha 32, clip 0.2/0.28, dual clip 3, 500
steps, evaluation every 5), and for `--scale toy` values sized so that the default run
finishes on 2 CPU cores in under 10 minutes; `--help` shows both. The resolved configuration
is printed once and saved as RUN/config.json.

Simplifications against the paper's verl backend: one process (or torchrun data parallel, see
the README), the sampler of rollout.py instead of vLLM, LoRA by hand instead of FSDP.

Run folder (every file and field: docs/RUNFOLDER.md): config.json, metrics.jsonl (one object
per step), eval.jsonl, samples.jsonl (transcripts), ckpt-last/ and ckpt-best/ (adapters in
PEFT layout + optimizer, scheduler and RNG states), and `done` at the end. A save is
recoverable at every instant (write new, move old aside, move new in, delete old). Ctrl-C (or
SIGTERM) finishes the step, saves ckpt-last and exits 130; `--resume RUN` continues from the
newest complete checkpoint and, with the same seed, logs the same metrics as a run that never
stopped (the problems of step k and every RNG state are restored, not re-drawn).
"""
import argparse
import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

# (toy value, paper value) of every flag whose default depends on the scale (None: all of the
# test split); the length limits come from tasks.length_limits, the lr also from --isolation
SCALE_DEFAULTS = {
    "problems_per_step": (16, 64), "group_size": (8, 8), "steps": (100, 500),
    "warmup_steps": (5, 15), "lora_rank": (16, 64), "lora_alpha": (32, 32), "eval_every": (20, 5),
    "eval_problems": (512, None), "token_budget": (16384, 16384),
}
# (toy, paper scale) learning rate per kind of trainable weights. LoRA: the paper's 2e-5, and
# 1e-3 for the toy world. Full copies of the toy model collapse at LoRA's 1e-3 (43.8 -> 9.4 in 4
# steps). Measured (Voting, isolated, full, 30 steps, 256 held-out problems, evaluations at
# steps 0/10/20/30): 3e-4 50.8 -> 45.3/37.5/44.5, 1e-4 -> 61.3/61.3/66.4, 3e-5 -> 53.1/53.1/63.7,
# 1e-5 -> 52.0/51.2/63.7 (LoRA at 1e-3: 61.3/60.9/70.3), so full copies take 1e-4. 1e-6 at real
# scales is the usual full-parameter GRPO rate, not measured here.
LR = {"lora": (1e-3, 2e-5), "full": (1e-4, 1e-6)}
# flags that may change on --resume: the rest of the saved configuration wins
RESUMABLE = ("resume", "steps", "device", "quiet", "log_to", "kv_budget_gb")


def scale_default(name):
    toy, paper = SCALE_DEFAULTS[name]
    return f" (default: {toy} at --scale toy, {paper if paper is not None else 'all of the test split'} otherwise)"


def _per_task(d):
    return ", ".join(f"{v} {k}" for k, v in d.items())


def build_parser():
    """The flat flag list, in groups that --help shows under their titles."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _what_flags(ap.add_argument_group("what to train"))
    _rollout_flags(ap.add_argument_group("rollout (rollout.py)"))
    _optimisation_flags(ap.add_argument_group("optimisation (grpo.py)"))
    _logging_flags(ap.add_argument_group("evaluation and logging"))
    _run_flags(ap.add_argument_group("the run"))
    return ap


def _what_flags(g):
    import workflows  # torch-free: the registry gives the workflow choices
    g.add_argument("--workflow", default="voting", choices=sorted(workflows.WORKFLOWS),
                    help="multi-agent workflow (single = one-call control) (default: %(default)s)")
    g.add_argument("--task", default="math", choices=workflows.TASKS, help="task kind (default: %(default)s)")
    g.add_argument("--data", default=None, help="data set name (tasks.py) or a .jsonl file "
                   "(default: toy_math/toy_code at --scale toy, dapo_math/deepcoder otherwise)")
    g.add_argument("--eval-data", default=None, help="held-out data set or .jsonl file "
                   "(default: the test split of --data; a .jsonl --data has none, so pass one)")
    g.add_argument("--scale", default="toy", help="toy, 0.6b, 1.7b, 4b, or a local model folder (default: %(default)s)")
    g.add_argument("--sharing", default="shared", choices=["shared", "isolated"],
                    help="shared: one set of trainable weights for all roles; isolated: one per role (default: %(default)s)")
    g.add_argument("--isolation", default="lora", choices=["lora", "full"],
                    help="what a role's weights are: a LoRA adapter, or a full copy of the model (default: %(default)s)")


def _rollout_flags(g):
    import tasks
    import toy
    g.add_argument("--problems-per-step", type=int, default=None, help="problems per training step" + scale_default("problems_per_step"))
    g.add_argument("--group-size", type=int, default=None, help="rollouts per problem (G)" + scale_default("group_size"))
    g.add_argument("--temperature", type=float, default=0.7, help="sampling temperature, training and evaluation (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="completion limit per call (default: %d at --scale "
                   "toy, the paper's %s otherwise)" % (toy.MAX_NEW_TOKENS, _per_task(tasks.MAX_NEW_TOKENS)))
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="hard prompt limit per call: a longer prompt "
                   "keeps its end, losing the instruction and problem first, so it is a last resort (default: "
                   "%d at --scale toy, none otherwise: --max-embed-tokens bounds the long prompts)" % toy.MAX_PROMPT_TOKENS)
    g.add_argument("--max-embed-tokens", type=int, default=None, help="an earlier call's text (a solution, an "
                   "attempt) embedded in a later prompt keeps at most this many tokens, its head and tail "
                   "(default: none at --scale toy, %d otherwise)" % tasks.MAX_EMBED_TOKENS)
    g.add_argument("--kv-budget-gb", type=float, default=None, help="KV cache a generate call may hold, GiB (default: "
                   "half of the GPU memory left free after loading on CUDA, 4 on CPU; printed at start)")
    g.add_argument("--max-rows", type=int, default=None, help="most rows decoded at once (default: as many as the KV budget holds)")


def _optimisation_flags(g):
    g.add_argument("--steps", type=int, default=None, help="training steps" + scale_default("steps"))
    g.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: %g LoRA / %g full at --scale "
                   "toy, %g LoRA / %g full otherwise)" % (*LR["lora"][:1], *LR["full"][:1], LR["lora"][1], LR["full"][1]))
    g.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up, then cosine to 0" + scale_default("warmup_steps"))
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: %(default)s)")
    g.add_argument("--mini-batch", type=int, default=None, help="sequences per optimizer step (default: problems-per-step x group-size, the paper's 512)")
    g.add_argument("--token-budget", type=int, default=None, help="rows x padded length per micro-batch" + scale_default("token_budget"))
    g.add_argument("--grad-checkpointing", default="auto", choices=["auto", "on", "off"],
                    help="recompute each layer in the backward instead of keeping its activations (auto: on at real scales) (default: %(default)s)")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping per optimizer step (default: %(default)s)")
    g.add_argument("--clip-low", type=float, default=0.2, help="ratio clip below 1 (default: %(default)s)")
    g.add_argument("--clip-high", type=float, default=0.28, help="ratio clip above 1, clip-higher (default: %(default)s)")
    g.add_argument("--clip-c", type=float, default=3.0, help="dual clip for negative advantages (default: %(default)s)")
    g.add_argument("--loss-norm", default="seq", choices=["seq", "token"], help="seq: mean of per-sequence token means (paper); token: mean over all tokens (default: %(default)s)")
    g.add_argument("--adv-group", default="slot", choices=["slot", "role"], help="advantage groups: (problem, slot) as the paper, or (problem, role) (default: %(default)s)")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-base coefficient for every role, k3 estimator (default: %(default)s, as the paper)")
    g.add_argument("--kl-coef-role", action="append", default=[], metavar="ROLE=VALUE", help="per-role KL coefficient, repeatable")
    g.add_argument("--coherence-damp", action="append", default=[], metavar="ROLE=LAMBDA",
                    help="scale a role's gradient by 1 - LAMBDA max(0, cos(g, EMA of its past gradients)) at each optimizer step, repeatable")
    g.add_argument("--coherence-window", type=int, default=10, help="EMA window of --coherence-damp, optimizer steps (default: %(default)s)")
    g.add_argument("--lora-rank", type=int, default=None, help="LoRA rank" + scale_default("lora_rank"))
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha" + scale_default("lora_alpha"))


def _logging_flags(g):
    g.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (0: only at start and end)" + scale_default("eval_every"))
    g.add_argument("--eval-problems", type=int, default=None, help="held-out problems per evaluation" + scale_default("eval_problems"))
    g.add_argument("--samples-every", type=int, default=10, help="write transcripts of 2 episodes every N steps (0: never) (default: %(default)s)")
    g.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (0: only at the end) (default: %(default)s)")
    g.add_argument("--log-to", default="none", choices=["none", "wandb", "tensorboard"],
                    help="also send every metric to an experiment tracker (tracking.py) (default: %(default)s)")


def _run_flags(g):
    g.add_argument("--seed", type=int, default=0, help="seed of every random choice (default: %(default)s)")
    g.add_argument("--out", default=None, help="run folder (default: runs/WORKFLOW-TASK-SHARING-SCALE-sSEED)")
    g.add_argument("--resume", default=None, metavar="RUN", help="continue the run in this folder with its saved configuration")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="base model dtype (default: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    return resume_args(ap, args) if args.resume else resolve_args(ap, args)


def resume_args(ap, args):
    """The saved configuration, with the few flags that may change on resume; say in one line
    which other given flags are ignored."""
    path = os.path.join(args.resume, "config.json")
    if not os.path.isfile(path):
        ap.error(f"--resume {args.resume}: no config.json there, so it is not a run folder")
    with open(path) as f:
        saved = json.load(f)
    given = {a.dest: getattr(args, a.dest) for a in ap._actions
             if a.dest != "help" and getattr(args, a.dest) != a.default}
    for k in ("kl_coef_role", "coherence_damp"):  # saved as {ROLE: value}
        if k in given:
            given[k] = {r: float(v) for r, _, v in (x.partition("=") for x in given[k])}
    ignored = [f"--{k.replace('_', '-')} {v} (saved {saved.get(k)})" for k, v in given.items()
               if k not in RESUMABLE and k != "out" and saved.get(k) != v]
    if ignored:
        print(f"warning: on --resume the saved configuration wins; ignored: {', '.join(ignored)}", file=sys.stderr)
    keep = {k: v for k, v in vars(args).items() if k in RESUMABLE and (k in given or k not in saved)}
    args = argparse.Namespace(**{**saved, **keep})
    args.out = args.resume
    return args


def _pairs(ap, items, flag, roles, workflow):
    """{ROLE: float} from repeatable ROLE=VALUE flags, every role one of the workflow's."""
    out = {}
    for item in items:
        role, _, value = item.partition("=")
        try:
            out[role] = float(value)
        except ValueError:
            ap.error(f"{flag} {item!r}: expected ROLE=VALUE with a number")
        if role not in roles:
            ap.error(f"{flag} {role}: not a role of {workflow} ({', '.join(roles)})")
    return out


def resolve_args(ap, args):
    """Fill every default that depends on the scale, task or isolation; check invariants."""
    import tasks
    import workflows
    real = 1 if args.scale != "toy" else 0
    for name in SCALE_DEFAULTS:
        if getattr(args, name) is None:
            setattr(args, name, SCALE_DEFAULTS[name][real])
    args.lr = LR[args.isolation][real] if args.lr is None else args.lr
    default_new, default_prompt, default_embed = tasks.length_limits(args.scale, args.task)
    args.max_new_tokens = args.max_new_tokens or default_new
    args.max_prompt_tokens = args.max_prompt_tokens or default_prompt
    args.max_embed_tokens = args.max_embed_tokens or default_embed
    args.data = args.data or tasks.default_data(args.scale, args.task)
    args.mini_batch = args.mini_batch or args.problems_per_step * args.group_size
    roles = workflows.ROLES[args.workflow]
    args.kl_coef_role = _pairs(ap, args.kl_coef_role, "--kl-coef-role", roles, args.workflow)
    args.coherence_damp = _pairs(ap, args.coherence_damp, "--coherence-damp", roles, args.workflow)
    args.out = args.out or os.path.join("runs", f"{args.workflow}-{args.task}-{args.sharing}-"
                                        f"{os.path.basename(os.path.normpath(args.scale))}-s{args.seed}")
    check_args(ap, args)
    return args


def check_args(ap, args):
    import policies
    for name in ("problems_per_step", "group_size", "steps", "mini_batch", "max_new_tokens", "token_budget",
                 "coherence_window"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("eval_every", "samples_every", "save_every"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.temperature < 0:
        ap.error("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        ap.error("--top-p must be in (0, 1]")
    package = {"wandb": "wandb", "tensorboard": "tensorboard"}.get(args.log_to)
    if package and importlib.util.find_spec(package) is None:  # before minutes of model loading
        ap.error(f"--log-to {args.log_to} needs the {package} package: pip install {package}")
    if args.kv_budget_gb is not None and args.kv_budget_gb <= 0:
        ap.error("--kv-budget-gb must be > 0")
    if any(not 0 <= v <= 1 for v in args.coherence_damp.values()):
        ap.error("--coherence-damp LAMBDA must be in [0, 1]")
    if args.scale == "toy":
        for flag, data in (("--data", args.data), ("--eval-data", args.eval_data)):
            if data and data not in ("toy_math", "toy_code"):
                ap.error(f"{flag} {data}: the toy model and its character tokenizer only know the toy tasks "
                         f"(toy_math, toy_code); for real data pass a real model, e.g. --scale 0.6b or a model folder")
    try:
        policies.check_scale(args.scale)
    except ValueError as e:
        ap.error(str(e))
    if os.path.exists(os.path.join(args.out, "config.json")):
        ap.error(f"run folder {args.out} exists; pass --resume {args.out} to continue it or --out to start anew")


# ----------------------------------------------------------------------------- run files

def log_jsonl(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_jsonl(path, last_step):
    """Drop records after `last_step` (logged after the checkpoint a resume starts from). A run
    killed mid-append leaves a torn line that does not parse: it is dropped, and said so."""
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
    with open(path, "w") as f:
        f.writelines(keep)


def save_checkpoint(policy, optimizers, schedulers, state, folder):
    """Adapters (PEFT layout) + optimizer, scheduler and RNG states, recoverable at every
    instant: write FOLDER.tmp (state.pt last, itself via a rename), move FOLDER aside to
    FOLDER.old, move FOLDER.tmp in, delete FOLDER.old. find_checkpoint reads whichever
    complete one a kill left."""
    import torch
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save(tmp)
    torch.save({"optimizers": {k: o.state_dict() for k, o in optimizers.items()},
                "schedulers": {k: s.state_dict() for k, s in schedulers.items()}, **state},
               os.path.join(tmp, "state.pt.part"))
    os.replace(os.path.join(tmp, "state.pt.part"), os.path.join(tmp, "state.pt"))
    publish(tmp, folder)


def publish(new, folder):
    """Put the complete checkpoint `new` at `folder`: the old one aside, the new one in, the
    old one deleted. Killed at any point, `folder` or FOLDER.old still holds a checkpoint."""
    old = folder + ".old"
    if os.path.isdir(folder):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
    os.replace(new, folder)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(out, name="ckpt-last"):
    """(folder, step) of the newest complete checkpoint among NAME, NAME.tmp and NAME.old (a
    save killed midway leaves one of them), published as NAME; (None, None) if there is none."""
    import torch
    target, best = os.path.join(out, name), (None, None)
    for folder in (target, target + ".tmp", target + ".old"):  # on a tie the first wins
        if os.path.isfile(os.path.join(folder, "state.pt")):   # state.pt is written last
            step = torch.load(os.path.join(folder, "state.pt"), weights_only=False)["step"]
            if best[1] is None or step > best[1]:
                best = (folder, step)
    folder, step = best
    if folder is not None and folder != target:  # finish the save that was interrupted
        print(f"resume: {name} was left mid-save; using {os.path.basename(folder)} (step {step})")
        if os.path.isdir(target) and not os.path.isfile(os.path.join(target, "state.pt")):
            shutil.rmtree(target)                               # an incomplete copy
        if folder.endswith(".tmp"):
            publish(folder, target)
        else:                                                   # .old: nothing newer exists
            os.replace(folder, target)
    for suffix in (".tmp", ".old"):
        shutil.rmtree(target + suffix, ignore_errors=True)
    return (target, step) if folder is not None else (None, None)


# ----------------------------------------------------------------------------- set-up

@dataclass
class Run:
    """Everything one training run holds between steps."""
    args: argparse.Namespace
    policy: object
    optimizers: dict
    schedulers: dict
    gen: object                   # torch.Generator of the rollouts
    shuffle: object               # torch.Generator of the mini-batch order
    llm: object
    train_set: list
    test_set: list
    files: dict
    damp: object = None           # grpo.CoherenceDamp or None
    comm: object = None           # parallel.Comm under torchrun, else None
    tracker: object = None
    kv_budget: int = 0
    best: float = -1.0
    last_acc: float | None = None
    start: int = 0
    created: list = field(default_factory=list)   # files this process made (step-0 cleanup)

    @property
    def main(self) -> bool:
        """Only rank 0 prints, writes the run folder and saves checkpoints."""
        return self.comm is None or self.comm.main


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def load_data(args):
    """(train, test) problems, or one clear error line."""
    import tasks
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
    if not train_set or not test_set:
        raise ValueError(f"--data {args.data}: empty train or test split")
    return train_set, test_set


def make_llm(policy, args, generator, kv_budget):
    import rollout
    return rollout.make_llm(policy, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                            generator=generator, max_rows=args.max_rows, kv_budget=kv_budget,
                            max_embed_tokens=args.max_embed_tokens)


def setup(args, comm=None):
    """Model, policy, data, optimizers, generators and the run folder's files. Under torchrun
    each rank samples with its own seed (rank 0's is --seed, so one process is the same run)."""
    import torch

    import grpo
    import policies
    import rollout
    import workflows
    device = comm.device if comm else args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    rank = comm.rank if comm else 0
    try:
        train_set, test_set = load_data(args)
        model, tok = policies.load(args.scale, device, dtype, toy_task=args.task)
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        fail(str(e))
    if args.problems_per_step > len(train_set):
        fail(f"--problems-per-step {args.problems_per_step} is more than the {len(train_set)} training problems")
    if args.data == (args.eval_data or args.data) and args.data.endswith(".jsonl"):
        print(f"warning: --data {args.data} is a file, so evaluation runs on the training problems; "
              "pass --eval-data FILE for a held-out set", file=sys.stderr)
    checkpointing = args.grad_checkpointing == "on" or (args.grad_checkpointing == "auto" and args.scale != "toy")
    # seeded here, after loading: building the toy model on first use must not move the adapters' start
    torch.manual_seed(args.seed)
    policy = policies.Policy(model, tok, workflows.ROLES[args.workflow], args.sharing, args.isolation,
                             args.lora_rank, args.lora_alpha, checkpointing=checkpointing)
    optimizers, schedulers = grpo.make_optimizers(policy, args.lr, args.warmup_steps, args.steps,
                                                  weight_decay=args.weight_decay)
    gen = torch.Generator(device).manual_seed(args.seed + 1000 * rank)
    # measured after the model is loaded: on CUDA the default is a share of what is left free
    kv_budget = int(args.kv_budget_gb * 2**30) if args.kv_budget_gb else rollout.default_kv_budget(device)
    files = {k: os.path.join(args.out, f"{k}.jsonl") for k in ("metrics", "eval", "samples")}
    return Run(args, policy, optimizers, schedulers, gen, torch.Generator().manual_seed(args.seed + 1 + 1000 * rank),
               make_llm(policy, args, gen, kv_budget), train_set, test_set, files, kv_budget=kv_budget, comm=comm,
               damp=grpo.CoherenceDamp(args.coherence_damp, args.coherence_window) if args.coherence_damp else None)


def print_plan(run):
    """One line of memory: weights, trainable weights with AdamW states, the KV budget and the
    rows it holds at the length limits, and the training micro-batch; a user sees at once
    whether the run fits. The prompt length is the limit, else the longest prompt expected: an
    aggregator's three clipped solutions plus ~512 tokens of instruction and problem."""
    import rollout
    a, p = run.args, run.policy
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    weights = sum(t.numel() * t.element_size() for t in p.model.parameters())
    trainable = sum(t.numel() for n in p.names for t in p.parameters_of(n))
    cfg, size = p.model.config, next(p.model.parameters()).element_size()
    per_tok = rollout.kv_bytes_per_token(cfg, next(p.model.parameters()).dtype)
    prompt = a.max_prompt_tokens or 3 * (a.max_embed_tokens or a.max_new_tokens) + 512
    logits = a.token_budget * cfg.vocab_size * 2 * size        # the logits and their gradient
    acts = a.token_budget * cfg.num_hidden_layers * cfg.hidden_size * size
    print(f"memory: weights {gib(weights)} | trainable {trainable / 1e6:.1f}M x 16 B (fp32 + grad + AdamW) "
          f"{gib(16 * trainable)} | {rollout.kv_budget_line(run.kv_budget, per_tok, prompt, a.max_new_tokens)} "
          f"({per_tok / 1024:.0f} KiB a token) | micro-batch {a.token_budget} tokens: logits + grad {gib(logits)}, "
          f"layer inputs {gib(acts)}{' (checkpointed)' if p.checkpointing else ' + every activation'}")


def open_run_folder(run):
    """Resume from the newest complete checkpoint, or start the run folder afresh. Rank 0
    alone touches the files; every rank then loads the same checkpoint."""
    args = run.args
    ck = step = None
    if run.main:
        if not os.path.isdir(args.out):
            run.created.append(args.out)
        os.makedirs(args.out, exist_ok=True)
        if args.resume:
            ck, step = find_checkpoint(args.out)
            find_checkpoint(args.out, "ckpt-best")
            for f in run.files.values():
                truncate_jsonl(f, step if ck else -1)
            print(f"resumed {args.out} at step {step} from {os.path.basename(ck)}" if ck else
                  f"resume: {args.out} has no complete checkpoint; starting it over")
        path = os.path.join(args.out, "config.json")
        if not os.path.isfile(path):
            run.created.append(path)
        with open(path, "w") as f:
            json.dump(vars(args), f, indent=2)
        print("config: " + json.dumps(vars(args)))
    if run.comm:
        ck, step = run.comm.gather((ck, step))[0]
    if ck is not None:
        restore(run, ck, step)


def restore(run, ck, step):
    """Adapters, optimizer and scheduler states, RNG states (this rank's) and the damping EMA."""
    import torch
    run.policy.load_adapters(ck)
    st = torch.load(os.path.join(ck, "state.pt"), weights_only=False)
    for k in run.optimizers:
        run.optimizers[k].load_state_dict(st["optimizers"][k])
        run.schedulers[k].load_state_dict(st["schedulers"][k])
    world = run.comm.world if run.comm else 1
    ranks = st.get("ranks", [{"gen": st["gen"], "shuffle": st["shuffle"]}])
    if len(ranks) != world:
        fail(f"--resume: the run was saved by {len(ranks)} processes; resume it with as many (now {world})")
    mine = ranks[run.comm.rank if run.comm else 0]
    run.gen.set_state(mine["gen"])
    run.shuffle.set_state(mine["shuffle"])
    if run.damp is not None:
        run.damp.load_state_dict(st["damp"], device=run.policy.model.device)
    run.start, run.best = step, st["best"]
    accs = [r["acc"] for r in _records(run.files["eval"])]
    run.last_acc = accs[-1] if accs else None


def _records(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def checkpoint(run, step, name="ckpt-last"):
    """Rank 0 saves; the RNG states of every rank go with it (every rank must call this)."""
    mine = {"gen": run.gen.get_state(), "shuffle": run.shuffle.get_state()}
    ranks = run.comm.gather(mine) if run.comm else [mine]
    if not run.main:
        return
    state = {"step": step, "best": run.best, **ranks[0], "ranks": ranks}
    if run.damp is not None:
        state["damp"] = run.damp.state_dict()
    save_checkpoint(run.policy, run.optimizers, run.schedulers, state, os.path.join(run.args.out, name))


# ----------------------------------------------------------------------------- evaluation and logs

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
            "code_block_rate": {r: q.get("code_block_rate", 0.0) for r, q in roles.items()},
            "calls": {r: q.get("calls", 0) for r, q in roles.items()}}


def merge_evals(recs):
    """One evaluation record from every rank's share: accuracy weighted by problems, per-role
    rates weighted by calls."""
    recs = [r for r in recs if r]
    n = sum(r["n"] for r in recs)
    out = {"step": recs[0]["step"], "acc": sum(r["acc"] * r["n"] for r in recs) / n, "n": n, "calls": {}}
    for r in recs:
        for role, c in r["calls"].items():
            out["calls"][role] = out["calls"].get(role, 0) + c
    for key in ("parse_fail", "len", "code_block_rate"):
        out[key] = {role: sum((r[key].get(role) or 0.0) * r["calls"].get(role, 0) for r in recs) / c
                    for role, c in out["calls"].items() if c}
    return out


def run_eval(run, step):
    """Evaluate (each rank its share of the problems), log, and keep ckpt-best: the earliest
    step at the best accuracy, step 0 included."""
    import torch
    # a generator of its own, so evaluations never shift the training samples
    gen = torch.Generator(run.gen.device).manual_seed(10_000 + step + 1000 * (run.comm.rank if run.comm else 0))
    problems = run.comm.share(run.test_set) if run.comm else run.test_set
    rec = evaluate(make_llm(run.policy, run.args, gen, run.kv_budget), run.args, problems, step) if problems else None
    rec = merge_evals(run.comm.gather(rec)) if run.comm else rec
    if run.main:
        log_jsonl(run.files["eval"], rec)
        if run.tracker is not None:
            run.tracker.log(rec, step, prefix="eval")
    run.last_acc = rec["acc"]
    if rec["acc"] > run.best:
        run.best = rec["acc"]
        checkpoint(run, step, "ckpt-best")
    return rec["acc"]


def log_transcripts(path, step, episodes, samples):
    """Every call of a few episodes, with its reward and advantage."""
    adv = {(s.problem_id, s.rollout, s.call): s.advantage for s in samples}
    for e in episodes:
        for i, c in enumerate(e.calls):
            log_jsonl(path, {"step": step, "problem_id": e.problem_id, "episode": e.rollout, "role": c.role,
                             "slot": c.slot, "prompt": c.messages[-1]["content"], "completion": c.text,
                             "reward": e.reward, "advantage": adv.get((e.problem_id, e.rollout, i))})


def step_record(run, step, episodes, stats, times):
    """The metrics.jsonl object of one step (sums over every rank's episodes)."""
    roles = run.policy.roles
    local = [sum(e.reward for e in episodes), len(episodes), sum(len(c.completion_ids) for e in episodes for c in e.calls),
             *(sum(c.role == r for e in episodes for c in e.calls) for r in roles),
             *(sum(e.fallbacks.get(r, 0) for e in episodes) for r in roles)]
    reward, n, tokens, *rest = run.comm.sum(local) if run.comm else local
    calls, fallbacks = rest[:len(roles)], rest[len(roles):]
    for r, q in stats["roles"].items():
        q["fallback_rate"] = fallbacks[roles.index(r)] / max(1, calls[roles.index(r)])
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
    return m


def step_line(step, steps, m, last_acc):
    roles = m["roles"]
    short = {r: r[:3] for r in roles}
    fmt = lambda key, f: " ".join(f"{short[r]} {roles[r].get(key, 0):{f}}" for r in roles)  # noqa: E731
    acc = "  -  " if last_acc is None else f"{last_acc:.3f}"
    return (f"step {step:4d}/{steps} | reward {m['reward']:.3f} | eval {acc} | len {fmt('len', '.1f')} | "
            f"clip {max((q.get('clip_frac') or 0 for q in roles.values()), default=0):.3f} | "
            f"gnorm {fmt('grad_norm', '.3f')} | {m['tokens_per_s']:.0f} tok/s | {m['time']['step']:.1f}s")


def every(n, step):
    """True every n steps; n = 0 means never."""
    return bool(n) and step % n == 0


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


def first_eval(run):
    """The untrained workflow at step 0. Interrupted, it leaves no trace of the run, so the
    same command starts it again."""
    try:
        acc = run_eval(run, 0)
    except KeyboardInterrupt:
        # only this attempt wrote the logs (the run is at step 0); remove them and what it made
        for path in [*run.files.values(), os.path.join(run.args.out, "ckpt-best"), *reversed(run.created)]:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.isfile(path):
                os.remove(path)
        print("interrupted during the step-0 evaluation: nothing saved; run the same command to start again",
              file=sys.stderr)
        sys.exit(130)
    if run.main:
        print(f"step    0 | eval {acc:.3f} (untrained workflow, {len(run.test_set)} problems)")


# ----------------------------------------------------------------------------- main

def log_step(run, step, m, episodes, samples):
    """metrics.jsonl (and the tracker), transcripts, the step line: rank 0 only."""
    if not run.main:
        return
    args = run.args
    log_jsonl(run.files["metrics"], m)
    if run.tracker is not None:
        run.tracker.log(m, step)
    if every(args.samples_every, step) or (step == 1 and args.samples_every):
        log_transcripts(run.files["samples"], step, episodes[:2], samples)


def start_run(args, comm):
    """Set up, print the memory plan, open the run folder, and evaluate step 0 if fresh."""
    try:
        run = setup(args, comm)
        if run.main:
            print_plan(run)
        open_run_folder(run)
    except KeyboardInterrupt:
        print("interrupted while setting up: nothing to save", file=sys.stderr)
        sys.exit(130)
    if args.log_to != "none" and run.main:
        import tracking
        try:
            run.tracker = tracking.open_tracker(args.log_to, args.out, vars(args),
                                                resume_step=run.start if args.resume else None)
        except RuntimeError as e:
            fail(str(e))
    if run.start == 0:
        first_eval(run)
    return run


def main(argv=None):
    args = parse_args(argv)
    from tqdm import tqdm

    import grpo
    import parallel
    import rewards
    import rollout

    comm = parallel.init(args.device)
    if comm:
        comm.barrier()   # every rank has checked the run folder before rank 0 writes to it
    run = start_run(args, comm)
    say = print if args.quiet else tqdm.write
    bar = tqdm(range(run.start + 1, args.steps + 1), desc="train", disable=args.quiet or not run.main,
               initial=run.start, total=args.steps)
    with interrupts() as stop:
        for step in bar:
            t0 = time.time()
            # 1. problems of this step, the same ones whenever the run is resumed (this rank's share)
            batch = random.Random(args.seed * 1_000_003 + step).sample(run.train_set, args.problems_per_step)
            batch = comm.share(batch) if comm else batch
            # 2. rollouts: every problem G times through the workflow
            episodes = rollout.run_episodes(run.llm, args.workflow, batch, args.group_size, args.task)
            t1 = time.time()
            # 3. reward: grade each final answer, copy it to every call of the episode
            for e, r in zip(episodes, rewards.score([e.final_text for e in episodes], [e.problem for e in episodes], args.task)):
                e.reward = float(r)
            t2 = time.time()
            # 4. advantages grouped by (problem, slot), then one update per role's optimizer
            samples = grpo.samples_from_episodes(episodes, group_by=args.adv_group)
            stats = grpo.update(run.policy, run.optimizers, run.schedulers, samples, temperature=args.temperature,
                                mini_batch=args.mini_batch, clip_low=args.clip_low, clip_high=args.clip_high,
                                clip_c=args.clip_c, loss_norm=args.loss_norm, kl_coef=args.kl_coef,
                                kl_coef_role=args.kl_coef_role, max_grad_norm=args.max_grad_norm,
                                token_budget=args.token_budget, generator=run.shuffle, damp=run.damp, comm=comm)
            # 5. log, evaluate, save (a stop that reached any rank stops them all at this step)
            m = step_record(run, step, episodes, stats, (t0, t1, t2, time.time()))
            log_step(run, step, m, episodes, samples)
            if every(args.eval_every, step) or step == args.steps:
                run_eval(run, step)
            stopping = comm.any(bool(stop)) if comm else bool(stop)
            if every(args.save_every, step) or step == args.steps or stopping:
                checkpoint(run, step)
            if run.main:
                bar.set_postfix(reward=f"{m['reward']:.3f}", acc="-" if run.last_acc is None else f"{run.last_acc:.3f}")
                say(step_line(step, args.steps, m, run.last_acc))
            if stopping:
                bar.close()
                if run.main:
                    if run.tracker is not None:
                        run.tracker.close()
                    print(f"interrupted: saved {args.out}/ckpt-last at step {step}; continue with --resume {args.out}")
                parallel.close(comm)
                sys.exit(130)
    bar.close()
    finish(run)
    parallel.close(comm)


def finish(run):
    if not run.main:
        return
    if run.tracker is not None:
        run.tracker.close()
    open(os.path.join(run.args.out, "done"), "w").close()
    print(f"done: {run.args.out} (best eval {run.best:.3f}); analyse with `python eval.py --runs {run.args.out}`")


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record  # names a failed rank under torchrun
    record(main)()
