"""A worker for tests/test_parallel.py: one GRPO update of a tiny policy on fixed samples,
as one process (all samples) or as a torchrun rank (its share), for each CASE in turn
(SHARING, or SHARING-plain: no probe and no intervention), written to OUT/CASE/rank{R}.pt.
One launch runs every case, since starting the processes costs more than the updates.

    python tests/dp_worker.py OUT CASE [CASE ...]          # one process, every sample
    torchrun --nproc-per-node 2 tests/dp_worker.py OUT CASE [CASE ...]
    torchrun --nproc-per-node 2 tests/dp_worker.py OUT fail MODEL   # train.py; rank 1 raises
    torchrun --nproc-per-node 2 tests/dp_worker.py OUT stop MODEL   # train.py; both ranks get SIGINT
    torchrun --nproc-per-node 2 tests/dp_worker.py OUT refuse MODEL  # train.py; rank 1 refuses

The ranks hold unequal numbers of calls per role; one process holds rank 0's samples, then
rank 1's, which is the global order the ranks shuffle and cut their mini-batches from.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import damping  # noqa: E402
import dynamics  # noqa: E402
import grpo  # noqa: E402
import parallel  # noqa: E402
import policies  # noqa: E402
import seeds  # noqa: E402
from conftest import tiny_qwen3  # noqa: E402

# (generator rows, aggregator rows) held by each rank
SHARES = [(7, 1), (2, 3)]


def samples_of(rank):
    g = torch.Generator().manual_seed(100 + rank)
    n_gen, n_agg = SHARES[rank]
    out = []
    for k in range(n_gen + n_agg):
        role, slot = ("generator", f"generator{k % 3}") if k < n_gen else ("aggregator", "aggregator")
        prompt = torch.randint(3, 60, (2 + k % 4,), generator=g).tolist()
        completion = torch.randint(3, 60, (1 + (k * 3) % 5,), generator=g).tolist()
        adv = 0.0 if k % 4 == 3 else float(torch.randn(1, generator=g))   # some rows skip
        out.append(grpo.Sample(role, slot, f"p{rank}-{k // 3}", prompt, completion, [], True, 1.0, adv))
    return out


def train_args(out, model) -> list:
    """A 3-step toy `single` run of train.py, small enough to start under torchrun in seconds."""
    return ["--scale", model, "--data", "toy_math", "--workflow", "single", "--steps", "3", "--problems-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "4", "--eval-problems", "2", "--lora-rank", "2", "--device", "cpu",
            "--quiet", "--out", out]


def fail_in_train(out, model):
    """train.py under torchrun, with rank 1 raising in its first update while rank 0 goes on
    into the next collective."""
    import train
    from torch.distributed.elastic.multiprocessing.errors import record
    real = grpo.update

    def update(*a, **k):
        if os.environ["RANK"] == "1":
            raise RuntimeError("rank 1 failed on purpose")
        return real(*a, **k)
    grpo.update = update
    record(train.main)(train_args(out, model))


def stop_in_train(out, model):
    """train.py under torchrun, every rank sent SIGINT in its first update (a stop sent to the
    ranks), rank 0's save slowed by 3 s: rank 1 must not leave before rank 0 has saved, or
    torchrun stops rank 0 in the middle of its save."""
    import signal
    import time

    import runfolder
    import train
    from torch.distributed.elastic.multiprocessing.errors import record
    real_update, real_save = grpo.update, runfolder.save_checkpoint

    def update(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        return real_update(*a, **k)

    def save(*a, **k):
        time.sleep(3)
        return real_save(*a, **k)
    grpo.update, runfolder.save_checkpoint = update, save
    record(train.main)(train_args(out, model))


def refuse_in_train(out, model):
    """train.py under torchrun, rank 1's first training rollout refused (a fork's workflow
    breaking its contract on rank 1's problems only) while rank 0's goes on."""
    import rollout
    import taskkinds
    import train
    from torch.distributed.elastic.multiprocessing.errors import record
    real = rollout.run_episodes

    def run_episodes(llm, workflow, problems, group_size, task, stream, **kw):
        if os.environ["RANK"] == "1" and stream[0] == "train":
            raise taskkinds.Refused("refused on purpose")
        return real(llm, workflow, problems, group_size, task, stream, **kw)
    rollout.run_episodes = run_episodes
    record(train.main)(train_args(out, model))


def update_once(comm, out, case):
    sharing, plain = case.split("-")[0], case.endswith("-plain")   # plain: the method alone
    torch.manual_seed(0)
    pol = policies.Policy(tiny_qwen3(seed=0), None, ("generator", "aggregator"), sharing, rank=4, alpha=8)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # B != 0, so gradients reach A as well
        for name in pol.names:
            for p in pol.parameters_of(name):
                p.normal_(0, 0.1, generator=g)
    samples = samples_of(comm.rank) if comm else samples_of(0) + samples_of(1)
    opts, scheds = grpo.make_optimizers(pol, lr=1e-2, warmup_steps=0, total_steps=10)
    applied = []   # the gradient of every optimizer step, as it is applied
    for name, o in opts.items():
        def step(*a, _real=o.step, _name=name, **k):
            applied.append((_name, dynamics.flat_grad(pol.parameters_of(_name)).clone()))
            return _real(*a, **k)
        o.step = step
    damp = None if plain else damping.CoherenceDamp({"generator": 0.5}, window=2, comm=comm)
    hp = grpo.Hyper(temperature=0.7, mini_batch=4, token_budget=24)
    rows = parallel.every_rank_rows(comm, samples) if comm else samples
    dyn = None if plain else dynamics.RoleDynamics(pol, comm=comm, damp=damp)
    # the shuffle train.py passes: one generator per step, seeded alike on every rank
    shuffle = torch.Generator().manual_seed(seeds.derive(0, "shuffle", 1))
    grpo.update(pol, opts, scheds, rows, hp, shuffle=shuffle, reduce=comm.reduce_grads if comm else None,
                probe=dyn, intervention=damp)
    stats = [] if plain else [dyn.summary(hp)]
    os.makedirs(os.path.join(out, case), exist_ok=True)
    torch.save({"params": {n: [p.detach().clone() for p in pol.parameters_of(n)] for n in pol.names},
                "stats": stats, "applied": applied}, os.path.join(out, case, f"rank{comm.rank if comm else 0}.pt"))


def main(out, cases):
    in_train = {"fail": fail_in_train, "stop": stop_in_train, "refuse": refuse_in_train}
    if cases[0] in in_train:
        return in_train[cases[0]](out, cases[1])
    comm = parallel.init("cpu")
    for case in cases:
        update_once(comm, out, case)
    parallel.close(comm)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
