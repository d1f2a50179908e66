"""train.py with its update measured apart: the update's time and its peak CUDA memory.

    python bench/train_step.py --scale FOLDER --steps 1 ... (train.py's flags)

Runs train.main with the same flags; around every grpo.update it synchronises, resets CUDA's
peak-memory counter, and prints one line `update: S s, peak G GiB`; at the end, one line
`engine: ...` of what the decode graphs did (cudagraphs.graphs_line). generate hands its KV
cache back (torch.cuda.empty_cache) before it returns, so that peak is the update's own:
weights, adapters, AdamW states, one micro-batch's activations and logits, no KV cache.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudagraphs  # noqa: E402
import grpo  # noqa: E402
import train  # noqa: E402

real_update = grpo.update


def measured_update(policy, *args, **kwargs):
    cuda = next(policy.model.parameters()).device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    out = real_update(policy, *args, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else "n/a (CPU)"
    print(f"update: {time.perf_counter() - t:.1f} s, peak {peak}", flush=True)
    return out


if __name__ == "__main__":
    grpo.update = measured_update
    try:
        train.main(sys.argv[1:])
    finally:
        print(f"engine: {cudagraphs.graphs_line()}", flush=True)
