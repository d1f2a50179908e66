"""Which SDPA kernel each attention call site runs, and what each kernel would cost there.

    python bench/sdpa.py --device cuda --config 0.6b --json sdpa.json   # on a GPU (about a minute)
    python bench/sdpa.py --device cpu --config tiny                      # the same sections on a CPU

The three call sites: decode (engine.decode_attention, a one-token query with the query heads
folded), prefill (engine._prefill, through transformers' SDPA function with a 4-D mask) and
training (grpo.batch_logprobs' forward and backward, transformers' SDPA with the padding mask).
1. record: F.scaled_dot_product_attention is wrapped while one small engine.generate call and
   one training forward and backward run, the kernels pinned as in a run
   (policies.attention_kernels); for every call the wrapper asks torch._fused_sdp_choice which
   backend PyTorch picks for those very arguments under the pin.
2. time: on the largest recorded call of each site, every backend forced in turn
   (torch.nn.attention.sdpa_kernel), and "run" (the run's settings pick): the first call on each of
   --shapes new shapes (what a kernel that builds a plan per shape pays: this project's shapes
   change every call) and the median of --repeats calls on one shape; "n/a" where the backend
   refuses the arguments.
Times are wall time, synchronised on CUDA. Random weights: neither choice nor time depends on them.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import engine  # noqa: E402
import grpo  # noqa: E402
import policies  # noqa: E402
import policies  # noqa: E402

from generate import build_model  # noqa: E402  (bench/generate.py: a random Qwen3 on the device)

BACKENDS = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "efficient",
            SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.MATH: "math"}
NAMES = {int(b): n for b, n in BACKENDS.items()}
real_sdpa = F.scaled_dot_product_attention
site = ["other"]       # the call site running now (set around each part)
calls = defaultdict(list)  # site -> [(backend name, args, kwargs)]


def recording_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    """F.scaled_dot_product_attention, noting the backend PyTorch picks for these arguments."""
    try:
        choice = NAMES.get(int(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                        enable_gqa=kw.get("enable_gqa", False))), "other")
    except (RuntimeError, TypeError) as e:   # an older signature, or no fused kernel at all
        choice = f"? ({type(e).__name__})"
    calls[site[0]].append((choice, (q, k, v), dict(attn_mask=attn_mask, is_causal=is_causal, scale=scale, **kw)))
    return real_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)


def in_site(name, fn):
    def wrapped(*a, **k):
        before, site[0] = site[0], name
        try:
            return fn(*a, **k)
        finally:
            site[0] = before
    return wrapped


def record(model, prompts: int, prompt_len: int, new: int):
    """One generate call (prefill and decode) and one training forward and backward."""
    engine._Decoder.forward = in_site("decode", engine._Decoder.forward)
    engine._prefill = in_site("prefill", engine._prefill)
    F.scaled_dot_product_attention = recording_sdpa
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, V, (prompt_len - i % 8,), generator=g).tolist() for i in range(prompts)]
    out = engine.generate(model, ids, new, stop_ids=[V - 1], pad_id=0, temperature=0.7, cuda_graphs=False)
    completions = [out.tokens[i][out.mask[i]].tolist() for i in range(prompts)]
    model.requires_grad_(True)
    site[0] = "training"
    # pinned as grpo.update's forward and backward are (under Policy.using)
    with torch.enable_grad(), policies.attention_kernels(next(model.parameters()).device):
        lp, _, _ = grpo.batch_logprobs(model, ids, completions, 0.7)
        lp.sum().backward()
    site[0] = "other"
    model.requires_grad_(False).zero_grad(set_to_none=True)
    F.scaled_dot_product_attention = real_sdpa


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t) * 1e3


def time_backends(args_, kwargs, training: bool, shapes: int, repeats: int) -> dict:
    """{backend: (mean ms of a first call on a new shape, median ms on one shape) or None}; the
    "run" entry forces nothing (the run's settings pick). Each entry gets shapes no other entry used,
    so a plan a kernel cached for an earlier entry's shape is not counted as free."""
    q0, k0, v0 = args_
    device = q0.device
    out = {}
    for i, (backend, name) in enumerate([(None, "run"), *BACKENDS.items()]):
        def one(width_cut: int = 0):
            q, k, v = (t.detach().clone() for t in (q0, k0, v0))
            m = kwargs.get("attn_mask")
            if width_cut:    # a new shape: the keys width_cut columns shorter
                k, v = k[..., :-width_cut, :], v[..., :-width_cut, :]
                m = None if m is None else m[..., :-width_cut]
            if training:
                q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
            kw = {**kwargs, "attn_mask": m}

            def run():
                with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                    o = real_sdpa(q, k, v, **kw)
                    if training:
                        o.sum().backward()
            return run
        try:
            timed(one(), device)                                      # the kernel's own warm-up
            first = [timed(one(i * shapes + c), device) for c in range(1, shapes + 1)]
            run = one()
            steady = [timed(run, device) for _ in range(repeats)]
            out[name] = (statistics.mean(first), statistics.median(steady))
        except Exception:  # noqa: BLE001 - the backend refuses these arguments (RuntimeError, NotImplementedError)
            out[name] = None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device")
    ap.add_argument("--config", default="0.6b", help="model shape of bench/shapes.py (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=16, help="rows of the recorded generate call")
    ap.add_argument("--prompt-len", type=int, default=512, help="longest prompt of the recorded call")
    ap.add_argument("--new", type=int, default=64, help="new tokens per row in the recorded call")
    ap.add_argument("--shapes", type=int, default=5, help="new shapes timed per backend (first calls)")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per backend on one shape")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    model = build_model(args.config, args.device)
    if args.device.startswith("cuda"):
        policies.cuda_settings(args.device)   # what train.py and eval.py set: the pick the runs see
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version() if args.device != 'cpu' else '-'}, "
          f"config {args.config}, {model.dtype}", flush=True)
    record(model, args.prompts, args.prompt_len, args.new)
    result = {}
    for name in ("decode", "prefill", "training"):
        seen = calls.get(name, [])
        if not seen:
            result[name] = {"chosen": "no call"}
            continue
        choice = Counter(c for c, _, _ in seen)
        _, a, kw = max(seen, key=lambda c: c[1][1].shape[-2] * c[1][0].shape[0])   # the widest call
        times = time_backends(a, kw, name == "training", args.shapes, args.repeats)
        result[name] = {"chosen": dict(choice), "q": list(a[0].shape), "k": list(a[1].shape),
                        "mask": None if kw.get("attn_mask") is None else list(kw["attn_mask"].shape),
                        "ms_first_new_shape": {b: t and round(t[0], 3) for b, t in times.items()},
                        "ms_steady": {b: t and round(t[1], 3) for b, t in times.items()}}
        cells = "  ".join(f"{b} {'n/a' if t is None else f'{t[0]:.2f}/{t[1]:.3f}'}" for b, t in times.items())
        print(f"{name:9s} chosen {dict(choice)}; q {tuple(a[0].shape)} k {tuple(a[1].shape)}; "
              f"ms first-new-shape/steady: {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
