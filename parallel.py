"""Data parallelism over problems with torch.distributed: what train.py needs to run as N
processes under torchrun, and nothing when it runs as one.

    torchrun --nproc-per-node 2 train.py ...         # 2 GPUs (NCCL) or 2 CPU processes (gloo)

Choices:
- `init()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK). With WORLD_SIZE 1 or
  unset it returns None and train.py runs exactly as a plain `python train.py`. Otherwise it
  starts the default process group: NCCL when CUDA is there (one GPU per local rank), gloo on
  CPUs.
- The problems of a step are split across ranks in contiguous shares (`share`); all G
  rollouts of a problem stay on its rank, so advantage groups never cross ranks.
- Every rank holds every row of the step (`every_rank_rows`): its own Samples, and for the
  other ranks' rows a stand-in with what the update reads of a row it does not compute (role,
  slot, completion length, reward, advantage) and `here=False`. So grpo.update shuffles and
  cuts the same global mini-batches on every rank, divides by the global mini-batch, and
  runs the forward and backward of its own rows only: N ranks take the same optimizer steps
  as one process holding every sample.
- Gradients are summed over ranks once per optimizer step by grpo.update itself, through the
  `Comm.reduce_grads` train.py hands it; the diagnostics and the damping sum the per-slot
  parts they read themselves (dynamics.SlotParts), only when they are on.
- Scalars and small records (counts, evaluation results, the rows' shapes) go through
  `sum` / `gather` (all_gather_object), which every rank must call in the same order.
- A stop (Ctrl-C or SIGTERM to the ranks) stops every rank at the same step; they leave
  together (`close`) once rank 0 has saved. Sent to torchrun itself (a Ctrl-C in its
  terminal: the ranks run in sessions of their own), a signal is passed on to the ranks, which
  torchrun kills 30 s later, so a longer step is not saved: stop a job's ranks
  (`pkill -INT -P TORCHRUN_PID`), or count on the periodic saves.
- A fork's refusal (taskkinds.Refused), raised where a rank's own problems are rolled out and
  graded, is raised on every rank (`together`), and the ranks leave together once rank 0 has
  removed a fresh run's folder (runfolder.broken).
- Failure (any other exception): a rank that raises exits non-zero; its peers' next collective
  fails (gloo: the connection closes) or torchrun stops them (SIGTERM, then SIGKILL after its
  shutdown timeout), so the job never hangs. train.main is wrapped in torch's `record`, so
  torchrun's summary names the rank that failed and its traceback.
"""
import datetime
import os

import torch
import torch.distributed as dist

import grpo
import taskkinds

TIMEOUT = datetime.timedelta(minutes=60)  # the longest one rank may wait for the others (a rollout)


class Comm:
    """The process group of one training job, seen from one rank."""

    def __init__(self, rank: int, world: int, device: str):
        self.rank, self.world, self.device = rank, world, device
        # small tensors travel on the collective's own device: CUDA for NCCL, CPU for gloo
        self.dev = device if dist.get_backend() == "nccl" else "cpu"

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, items: list) -> list:
        """This rank's contiguous share of `items` (shares differ in size by at most one)."""
        n = len(items)
        return items[self.rank * n // self.world:(self.rank + 1) * n // self.world]

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over ranks, in place."""
        dist.all_reduce(t)
        return t

    def reduce_grads(self, params) -> None:
        """Sum the parameters' .grad over the ranks, in place: one collective for the flat vector."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.all_reduce_(torch.cat([g.reshape(-1).float() for g in grads]))    # (N,) fp32
        k = 0
        for p, g in zip(params, grads):
            p.grad = flat[k:k + g.numel()].view_as(p).to(p.dtype)
            k += g.numel()

    def sum(self, values):
        """Sum a float or a list of floats over ranks."""
        t = torch.tensor(values if isinstance(values, list) else [values], dtype=torch.float64, device=self.dev)
        self.all_reduce_(t)
        return t.tolist() if isinstance(values, list) else float(t[0])

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any (e.g. a Ctrl-C that reached one rank)."""
        return self.sum(float(bool(flag))) > 0

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier()


def every_rank_rows(comm: Comm, samples: list) -> list:
    """The step's rows of every rank, in rank order: this rank's Samples as they are, the
    others' as stand-ins (here=False; no prompt, zeros for the completion ids, which only
    count tokens). Every rank gets the same list but for which rows are its own."""
    shapes = comm.gather([(s.role, s.slot, s.problem_id, len(s.completion_ids), s.finished, s.reward,
                           s.advantage, s.rollout, s.call) for s in samples])
    out = []
    for rank, rows in enumerate(shapes):
        if rank == comm.rank:
            out += samples
            continue
        out += [grpo.Sample(role, slot, pid, [], [0] * n, [], fin, reward, adv, rollout, call, here=False)
                for role, slot, pid, n, fin, reward, adv, rollout, call in rows]
    return out


def together(comm: Comm | None, fn, /, *args, **kwargs):
    """fn(*args, **kwargs), with a fork's refusal (taskkinds.Refused: a reward out of [0, 1], a
    workflow that breaks its contract) raised on every rank when any rank raises it. A refusal
    depends on a rank's own problems; raised on one rank only, it would leave the others waiting
    in the next collective, and a fresh run's folder behind. One all_gather a call; the refusal
    raised is marked `every_rank`, so runfolder.broken may wait for the others before leaving."""
    if comm is None:
        return fn(*args, **kwargs)
    try:
        out, why = fn(*args, **kwargs), None
    except taskkinds.Refused as e:
        out, why = None, str(e)
    refused = [(rank, w) for rank, w in enumerate(comm.gather(why)) if w is not None]
    if refused:
        rank, w = refused[0]
        e = taskkinds.Refused(w if rank == comm.rank else f"rank {rank}: {w}")
        e.every_rank = True
        raise e
    return out


def init(device: str | None = None) -> Comm | None:
    """The job's Comm under torchrun (WORLD_SIZE > 1), else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if cuda:
        local = rank_device(local, torch.cuda.device_count())
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
    return Comm(rank, world, f"cuda:{local}" if cuda else "cpu")


def rank_device(local: int, visible: int) -> int:
    """The CUDA index of local rank `local` among `visible` devices: its own where every rank sees
    every GPU (torchrun's usual case), 0 where each rank sees only its own (a scheduler's
    CUDA_VISIBLE_DEVICES per task); anything else is a launch that does not fit the machine."""
    if visible == 1:
        return 0
    if local < visible:
        return local
    raise RuntimeError(f"local rank {local} on a machine that shows this rank {visible} CUDA devices: start at most "
                       f"{visible} ranks a node (torchrun --nproc-per-node)")


def close(comm: Comm | None) -> None:
    """Leave the job together: a rank that exited while rank 0 still saved its last checkpoint
    would make torchrun stop rank 0 in the middle of the save (it stops every rank once one
    exits non-zero, as 130 after a Ctrl-C is)."""
    if comm is not None and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
