"""Experiment tracking: the numbers of metrics.jsonl and eval.jsonl, mirrored to W&B or TensorBoard.

    tracker = tracking.open_tracker("wandb" | "tensorboard" | "none", run_folder, config)
    tracker.log(metrics_record, step)                 # reward, roles/generator/grad_norm, ...
    tracker.log(eval_record, step, prefix="eval")     # eval/acc, eval/len/aggregator, ...
    tracker.close()

The run folder's JSONL files stay the record of truth; a tracker only mirrors them. A record is
flattened with `/` ({"roles": {"generator": {"grad_norm": g}}} -> `roles/generator/grad_norm`),
only numbers are kept (bools as 0/1; text, lists and None are dropped), and the record's own
`step` is the x axis, not a value.

What goes where:
- `none`: nothing (the default; no tracking package is imported).
- `wandb`: one W&B run per run folder, project `marl-workflows` (or $WANDB_PROJECT), named after
  the folder, with the run's config attached. Its id is kept in RUN/wandb_id, so a `--resume`
  of the folder continues the same W&B run. W&B's local files go to RUN/wandb/ (or $WANDB_DIR).
  $WANDB_MODE is respected: `WANDB_MODE=offline` writes RUN/wandb/offline-run-*/ without network,
  to upload later with `wandb sync RUN/wandb/offline-run-*`. View at wandb.ai, or any self-hosted
  W&B server ($WANDB_BASE_URL).
- `tensorboard`: event files in RUN/tb/ (torch.utils.tensorboard), the config as text (tab TEXT)
  and as hparams (tab HPARAMS, to compare the runs of a sweep against eval/acc). View with
  `tensorboard --logdir runs` (every run folder under runs/ is one run in the UI).

The library is imported only when asked for; a missing one is one RuntimeError line that says
what to pip install.
"""
import json
import os

KINDS = ("none", "wandb", "tensorboard")
PROJECT = "marl-workflows"


def flatten(record: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1.5, "c": True, "d": "text"}} -> {"a/b": 1.5, "a/c": 1}; numbers only."""
    out = {}
    for key, value in record.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flatten(value, name))
        elif isinstance(value, bool):  # before int: bool is an int subclass
            out[name] = int(value)
        elif isinstance(value, (int, float)):
            out[name] = value
    return out


def _need(kind: str, package: str):
    return RuntimeError(f"--log-to {kind} needs the {package} package: pip install {package}")


def _open_wandb(folder: str, config: dict):
    try:
        import wandb
    except ImportError:
        raise _need("wandb", "wandb") from None
    id_file = os.path.join(folder, "wandb_id")
    run_id = open(id_file).read().strip() if os.path.isfile(id_file) else None  # resumed: continue it
    wandb_dir = os.environ.get("WANDB_DIR") or folder
    os.makedirs(wandb_dir, exist_ok=True)
    # mode is left to $WANDB_MODE (online by default, offline or disabled when set)
    try:
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=os.path.basename(os.path.normpath(folder)),
                         id=run_id, resume="allow", dir=wandb_dir, config=config)
    except Exception as e:   # no API key, no network, a bad project: W&B's own error types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise RuntimeError(f"--log-to wandb: W&B did not start ({first}); log in (`wandb login` or WANDB_API_KEY), "
                           "or set WANDB_MODE=offline to log locally") from None
    with open(id_file, "w") as f:
        f.write(run.id + "\n")
    return run


def _open_tensorboard(folder: str, config: dict, purge_step):
    try:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams
    except ImportError:
        raise _need("tensorboard", "tensorboard") from None
    writer = SummaryWriter(os.path.join(folder, "tb"), purge_step=purge_step)
    writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)  # markdown code block
    # hparams take numbers, strings and bools: lists and dicts go in as their JSON text
    hp = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in config.items()}
    for summary in hparams(hp, {"eval/acc": None}):  # experiment, session start, session end
        writer.file_writer.add_summary(summary)
    return writer


class Tracker:
    """`log` flattens a record and hands its numbers to the backend; after `close` every
    number is on disk (and, for online W&B, sent)."""

    def __init__(self, kind: str, run=None):
        self.kind, self.run = kind, run

    def log(self, record: dict, step: int, prefix: str = ""):
        scalars = flatten({k: v for k, v in record.items() if k != "step"}, prefix)
        if self.kind == "wandb":
            self.run.log(scalars, step=step)
        elif self.kind == "tensorboard":
            for name, value in scalars.items():
                self.run.add_scalar(name, value, step)

    def close(self):
        if self.kind == "wandb":
            import wandb
            self.run.finish()
            wandb.teardown()  # finish() can return before the local run file is written out
        elif self.kind == "tensorboard":
            self.run.close()


def open_tracker(kind: str, folder: str, config: dict, resume_step: int | None = None) -> Tracker:
    """A tracker for the run in `folder` with its resolved `config` (vars(args)).

    `resume_step`: on --resume, the step of the checkpoint the run continues from (0 when it had
    none and starts over). TensorBoard then hides what the stopped run logged after it, since
    those steps are logged again; W&B keeps its rows and drops steps logged a second time (it
    takes steps only in increasing order), which a resume that reproduces the run makes equal."""
    if kind not in KINDS:
        raise ValueError(f"--log-to {kind!r}: expected one of {', '.join(KINDS)}")
    os.makedirs(folder, exist_ok=True)
    if kind == "wandb":
        return Tracker(kind, _open_wandb(folder, config))
    if kind == "tensorboard":
        purge = None if resume_step is None else resume_step + 1 if resume_step else 0
        return Tracker(kind, _open_tensorboard(folder, config, purge))
    return Tracker(kind)
