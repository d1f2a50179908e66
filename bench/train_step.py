"""train.py with its update measured apart: the update's time, FLOP rate and peak CUDA memory.

    python bench/train_step.py --scale FOLDER --steps 1 ... (train.py's flags)
    python bench/train_step.py --keyed-grades --kl-coef 0 ...   # an update that works at KL 0

Runs train.main with the same flags; around every grpo.update it synchronises, resets CUDA's
peak-memory counter, and prints one line `update: S s, peak G GiB, F TFLOP = R TFLOP/s, X% of
peak`; at the end, one line `engine: ...` of what the decode graphs did
(cudagraphs.graphs_line). generate hands its KV cache back (torch.cuda.empty_cache) before it
returns, so that peak is the update's own: weights, adapters, AdamW states, one micro-batch's
activations and logits, no KV cache. F counts the FLOPs GRPO needs for the step's rows
(bench/update.py's `minimum_flops`: a forward and a backward over every row that runs, old
logprobs after the first mini-batch), so R is the rate of useful work; the peak is the GPU's
dense bf16 figure (PEAK_TFLOPS).

`--keyed-grades` (bench only; stripped before train.py sees the flags): an episode is graded
by the parity of a hash of its final text instead of its task's check. A random model is never
right, so at KL 0 every advantage is 0 and the update skips every row (grpo.rows_to_run); keyed
grades vary within a group, so the update does the work of a real step.
"""
import hashlib
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudagraphs  # noqa: E402
import grpo  # noqa: E402
import taskkinds  # noqa: E402
import train  # noqa: E402

real_update = grpo.update
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}   # dense bf16, the vendor's figure


def bench_module(name):
    """A bench/ script imported by path (bench/ holds names that shadow the project's modules)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(os.path.dirname(__file__), f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def useful_flops(policy, samples, hp, shuffle):
    """The FLOPs GRPO needs for this update's rows (bench/update.py's minimum_flops), the same
    mini-batches as the update draws (from a copy of its generator)."""
    g = torch.Generator()
    if shuffle is not None:
        g.set_state(shuffle.get_state())
    later = set()
    for name in policy.names:
        rows = grpo.adapter_rows(policy, samples, name, g if shuffle is not None else None)
        later |= {i for mb in grpo.optimizer_batches(rows, hp.mini_batch)[1:] for i in mb} if rows else set()
    return bench_module("update").minimum_flops(samples, later, policy.model.config, policy.lora.rank)


def rate(flops, seconds, cuda):
    """'F TFLOP = R TFLOP/s, X% of peak' (the share where the GPU's peak is known)."""
    r = flops / seconds / 1e12
    gpu = torch.cuda.get_device_name() if cuda else ""
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in gpu), None)
    return f"{flops / 1e12:.3g} TFLOP = {r:.3g} TFLOP/s" + (f", {r / peak:.0%} of {peak:g}" if peak else "")


def measured_update(policy, optimizers, schedulers, samples, hp, shuffle=None, **kwargs):
    cuda = next(policy.model.parameters()).device.type == "cuda"
    flops = useful_flops(policy, samples, hp, shuffle) if policy.isolation == "lora" else None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()   # weights, the kept decode graphs' buffers and pools
    t = time.perf_counter()
    out = real_update(policy, optimizers, schedulers, samples, hp, shuffle=shuffle, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    peak = (f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB ({held / 2**30:.2f} GiB held as it began: "
            f"weights, kept decode graphs)" if cuda else "n/a (CPU)")
    work = f", {rate(flops, seconds, cuda)}" if flops else ""
    print(f"update: {seconds:.1f} s, peak {peak}{work}", flush=True)
    return out


def keyed_score(texts, problems, task=None):
    """Bench only: 1 for a final text whose hash is odd, else 0 (module docstring)."""
    return [float(hashlib.sha256(t.encode()).digest()[0] % 2) for t in texts]


if __name__ == "__main__":
    grpo.update = measured_update
    if "--keyed-grades" in sys.argv:
        sys.argv.remove("--keyed-grades")
        taskkinds.score = keyed_score
    try:
        train.main(sys.argv[1:])
    finally:
        print(f"engine: {cudagraphs.graphs_line()}", flush=True)
