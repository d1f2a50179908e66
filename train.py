"""Train a multi-agent LLM workflow end to end with GRPO, Shared- or Isolated-Policy.

    python train.py                                   # toy world on a CPU: Voting, Shared, math
    python train.py --workflow eval_opt --task code --sharing isolated
    python train.py --scale 0.6b --data dapo_math --device cuda          # the paper's setting
    python train.py --resume runs/voting-math-shared-toy-s0              # continue a stopped run

One training step, literally below in `main`:
  1. draw this step's problems (seeded by (seed, step), so a resumed run draws the same ones);
  2. run the workflow G times on each (rollout.py + workflows.py);
  3. grade each episode's final answer (its task kind's reward, taskkinds.py) and pay the
     0/1 reward to every call (or, with --credit own, a solution call its own text's grade);
  4. group advantages by (problem, slot) and update each adapter (grpo.py), with the
     role-level gradient dynamics measured on the way (dynamics.py);
  5. log, evaluate every --eval-every steps, checkpoint every --save-every steps.
The untrained workflow is evaluated at step 0 on a fixed held-out set (pass@1 at the training
temperature); ckpt-best holds the best evaluation so far, step 0 included.

Defaults: the paper's hyper-parameters for the real scales (64 problems x 8 rollouts, AdamW
2e-5, 15 warm-up steps then cosine, LoRA r64/alpha 32, clip 0.2/0.28, dual clip 3, 500
steps, evaluation every 5), and for `--scale toy` values sized so that the default run
finishes on 2 CPU cores in minutes; `--help` shows both. The flags live in flags.py, the run
folder (logs, checkpoints, resume) in runfolder.py. The resolved configuration is printed
once and saved as RUN/config.json.

Simplifications against the paper's verl backend: one process (or torchrun data parallel, see
parallel.py), the sampler of rollout.py instead of vLLM, LoRA by hand instead of FSDP.

Ctrl-C (or SIGTERM) finishes the step, saves ckpt-last and exits 130; `--resume RUN`
continues from the last checkpoint whose save finished and, with the same seed, logs the
same metrics as a run that never stopped.
"""
import functools
import random
import sys
import time
from dataclasses import dataclass, field

import flags
import runfolder
import seeds


@dataclass
class Run:
    """Everything one training run holds between steps."""
    args: object                  # the resolved flags (flags.parse_args)
    policy: object
    optimizers: dict
    schedulers: dict
    llm: object
    train_set: list
    test_set: list
    files: dict
    hyper: object = None          # grpo.Hyper of the update
    params: dict = field(default_factory=dict)    # the workflow's keyword arguments (flags.workflow_params)
    damp: object = None           # damping.CoherenceDamp or None
    comm: object = None           # parallel.Comm under torchrun, else None
    tracker: object = None
    kv_budget: int = 0
    update_plan: str = ""         # the update's line of the memory plan (gradient checkpointing, why)
    best: float = -1.0
    last_acc: float | None = None
    start: int = 0
    created: list = field(default_factory=list)   # files this process made (step-0 cleanup)

    @property
    def main(self) -> bool:
        """Only rank 0 prints, writes the run folder and saves checkpoints."""
        return self.comm is None or self.comm.main



# ----------------------------------------------------------------------------- set-up

def llm_from_flags(policy, args, kv_budget):
    """The workflows' llm: --sampler fast (engine.generate in the KV budget) or simple."""
    import engine
    import rollout
    sampler = rollout.generate_simple if args.sampler == "simple" else functools.partial(
        engine.generate, kv_budget=kv_budget, max_rows=args.max_rows, cuda_graphs=args.cuda_graphs == "on",
        host=True)   # each call's outputs copied to the host once, before make_llm reads them row by row
    return rollout.make_llm(policy, sampler=sampler, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                            seed=args.seed, max_embed_tokens=args.max_embed_tokens)


def setup(args, comm=None):
    """Model, policy, data, optimizers, generators and the run folder's files."""
    import torch

    import damping
    import engine
    import grpo
    import policies
    import tasks
    import workflows
    device = comm.device if comm else flags.device_or_default(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        train_set, test_set = tasks.train_and_test(args.data, args.eval_data, args.task, args.eval_problems, args.seed)
        model, tok = policies.load(args.scale, device, dtype, toy_task=args.task, quiet=args.quiet,
                                   toy_check=args.toy_check or 0, toy_seed=args.toy_seed or 0)
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        runfolder.fail(str(e))
    if args.dtype is None and not args.resume:   # saved resolved: a resume on another device keeps it
        args.dtype = str(model.dtype).removeprefix("torch.")
    if args.problems_per_step > len(train_set):
        runfolder.fail(f"--problems-per-step {args.problems_per_step} is more than the {len(train_set)} training problems")
    checkpointing, plan = args.grad_checkpointing == "on", f"gradient checkpointing {args.grad_checkpointing}"
    if args.grad_checkpointing == "auto":
        checkpointing, plan = policies.checkpointing_plan(model, args.token_budget)
    # seeded here, after loading: building the toy model on first use must not move the adapters' start
    torch.manual_seed(args.seed)
    policy = policies.Policy(model, tok, workflows.ROLES[args.workflow], args.sharing, args.isolation,
                             args.lora_rank, args.lora_alpha, checkpointing=checkpointing)
    optimizers, schedulers = grpo.make_optimizers(policy, args.lr, args.warmup_steps, args.steps,
                                                  weight_decay=args.weight_decay, lr_role=dict(args.lr_role or {}))
    # measured after the model is loaded: on CUDA the default is a share of what is left free
    kv_budget = int(args.kv_budget_gb * 2**30) if args.kv_budget_gb else engine.default_kv_budget(device)
    damp = None
    if args.coherence_damp:
        damp = (damping.PlaceboDamp(args.coherence_damp, args.coherence_window, args.seed, comm=comm)
                if args.damp_placebo else damping.CoherenceDamp(args.coherence_damp, args.coherence_window, comm=comm))
    return Run(args, policy, optimizers, schedulers, llm_from_flags(policy, args, kv_budget), train_set, test_set,
               runfolder.files(args.out), hyper=flags.hyper(args), params=flags.workflow_params(args), damp=damp,
               comm=comm, kv_budget=kv_budget, update_plan=f"update: {plan}")


def start_run(args, comm):
    """Set up, print the memory plan, open the run folder, and evaluate step 0 if fresh."""
    import engine
    try:
        run = setup(args, comm)
        if run.main:
            print(engine.memory_plan(run.policy, run.kv_budget, args))
            print(run.update_plan)
        runfolder.open_run(run)
    except KeyboardInterrupt:
        print("interrupted while setting up: nothing to save", file=sys.stderr)
        sys.exit(130)
    if args.log_to != "none" and run.main:
        import tracking
        try:
            run.tracker = tracking.open_tracker(args.log_to, args.out, vars(args),
                                                resume_step=run.start if args.resume else None)
        except RuntimeError as e:
            if not args.resume:   # a fresh run leaves nothing, so the same command can run again
                runfolder.remove_fresh(run)
            runfolder.fail(str(e))
    if run.start == 0:
        with runfolder.broken(run):
            first_eval(run)
    return run


# ----------------------------------------------------------------------------- evaluation

EVAL_STEPS = 4   # an evaluation batch: this many training steps' episodes


def run_eval(run, step):
    """Evaluate (each rank its share of the problems), log, and keep ckpt-best: the earliest
    step at the best accuracy, step 0 included."""
    import eval as ev
    import parallel
    problems = run.comm.share(run.test_set) if run.comm else run.test_set
    a = run.args
    # its own stream of draws, ("eval", step), apart from training's, so the batch size moves no
    # draw; EVAL_STEPS training steps' episodes at once: the sampler keeps within its KV budget
    # whatever the batch, and a long answer then runs beside others instead of holding a small
    # batch's last stage to itself
    rec = parallel.together(run.comm, lambda: ev.eval_record(
        run.llm, a.workflow, problems, a.task, step, batch_size=EVAL_STEPS * a.problems_per_step * a.group_size,
        progress=not a.quiet, **run.params) if problems else None)
    rec = ev.merge_records(run.comm.gather(rec)) if run.comm else rec
    if run.main:
        runfolder.log_jsonl(run.files["eval"], rec)
        if run.tracker is not None:
            run.tracker.log(rec, step, prefix="eval")
    run.last_acc = rec["acc"]
    if rec["acc"] > run.best:
        run.best = rec["acc"]
        runfolder.checkpoint(run, step, "ckpt-best")
    return rec["acc"]


def first_eval(run):
    """The untrained workflow at step 0. Interrupted, it leaves no trace of the run, so the
    same command starts it again."""
    try:
        acc = run_eval(run, 0)
    except KeyboardInterrupt:
        if run.main:   # rank 0's folder: the other ranks would race it for the same files
            runfolder.remove_fresh(run)
        print("interrupted during the step-0 evaluation: nothing saved; run the same command to start again",
              file=sys.stderr)
        sys.exit(130)
    if run.main:
        print(f"step    0 | eval {acc:.3f} (untrained workflow, {len(run.test_set)} problems)")


# ----------------------------------------------------------------------------- the loop

def grade(episodes, task: str, credit: str) -> None:
    """Each episode's reward, its final answer's grade in [0, 1], paid to every call of the
    episode (--credit own: a solution role's call is paid its own text's grade instead)."""
    import taskkinds
    import workflows
    score = functools.partial(taskkinds.score, task=task)
    for e, r in zip(episodes, score([e.final_text for e in episodes], [e.problem for e in episodes])):
        e.reward = float(r)
    workflows.pay(episodes, credit, score)


def every(n, step):
    """True every n steps; n = 0 means never."""
    return bool(n) and step % n == 0


def main(argv=None):
    args = flags.parse_args(argv, __doc__)
    import torch
    from tqdm import tqdm

    import dynamics
    import grpo
    import parallel
    import rollout

    comm = parallel.init(args.device)
    if comm:
        comm.barrier()   # every rank has checked the run folder before rank 0 writes to it
    run = start_run(args, comm)
    say = print if args.quiet else tqdm.write
    bar = tqdm(range(run.start + 1, args.steps + 1), desc="train", disable=args.quiet or not run.main,
               initial=run.start, total=args.steps)
    with runfolder.interrupts() as stop, runfolder.aborted(run), runfolder.broken(run):
        for step in bar:
            t0 = time.time()
            # 1. problems of this step, the same ones whenever the run is resumed (this rank's share)
            batch = random.Random(seeds.derive(args.seed, "problems", step)).sample(run.train_set, args.problems_per_step)
            batch = comm.share(batch) if comm else batch
            # 2. rollouts: every problem G times through the workflow, with draws keyed by the step
            #    (a fork's refusal, here or in 3, on any rank stops every rank: parallel.together)
            episodes = parallel.together(comm, rollout.run_episodes, run.llm, args.workflow, batch, args.group_size,
                                         args.task, ("train", step), **run.params)
            t1 = time.time()
            # 3. reward: grade each final answer, pay it to every call of the episode
            parallel.together(comm, grade, episodes, args.task, args.credit)
            t2 = time.time()
            # 4. advantages grouped by (problem, slot), then one update per adapter's optimizer
            samples = grpo.samples_from_episodes(episodes, group_by=args.adv_group)
            all_samples = parallel.every_rank_rows(comm, samples) if comm else samples   # every rank's rows
            shuffle = torch.Generator().manual_seed(seeds.derive(args.seed, "shuffle", step))   # every rank's
            dyn = dynamics.RoleDynamics(run.policy, comm=comm, damp=run.damp)   # reads the update, changes nothing
            grpo.update(run.policy, run.optimizers, run.schedulers, all_samples, run.hyper, shuffle=shuffle,
                        reduce=comm.reduce_grads if comm else None, probe=dyn, intervention=run.damp)
            # 5. log, evaluate, save (a stop that reached any rank stops them all at this step)
            m = runfolder.step_record(run, step, episodes, dyn.summary(run.hyper), (t0, t1, t2, time.time()))
            runfolder.log_step(run, step, m, episodes, samples)
            if every(args.eval_every, step) or step == args.steps:
                run_eval(run, step)
            stopping = comm.any(bool(stop)) if comm else bool(stop)
            if every(args.save_every, step) or step == args.steps or stopping:
                runfolder.checkpoint(run, step)
            if run.main:
                bar.set_postfix(reward=f"{m['reward']:.3f}", acc="-" if run.last_acc is None else f"{run.last_acc:.3f}")
                say(runfolder.step_line(step, args.steps, m, run.last_acc))
            if stopping:
                runfolder.stop_now(run, bar, step)
    bar.close()
    runfolder.finish(run)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record  # names a failed rank under torchrun
    record(main)()
