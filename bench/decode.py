"""The decode step of engine.generate: its time, its kernel-launching ops and its host syncs,
in this checkout or another one, so a change is measured against the code before it in one run.

    python bench/decode.py --section mixed --compare /path/to/older/checkout    # CPU, ~10 CPU-minutes (prefills)
    python bench/decode.py --section ops --compare /path/to/older/checkout      # 0.6B shape, LoRA r64
    python bench/decode.py --section paper --device cuda                        # 120 rows, W = 512 / 2,560 / 5,120
    python bench/decode.py --section compile                                    # torch.compile(fullgraph=True)

Sections (random weights: neither speed nor counts depend on them):
- mixed: the 0.6B attention shape (16 query heads, 8 KV heads, head_dim 128, hidden 1024, MLP
  3072) with 2 layers and a 512-token vocabulary; 32 rows with prompts spread evenly from 100
  to 3,000 tokens, all in flight; the CPU time of each one-token decode forward (the step's
  model call, with what the sampler does around it to build its inputs), median of the
  --steps forwards of one greedy generate call.
- ops: per decode step, at a shape (--config, default the 0.6B one) with a LoRA r64 adapter on
  every linear layer through policies' hooks (bf16, as on a GPU): the aten ops that launch a
  kernel (every op a TorchDispatchMode sees that is not a view) and the host syncs (calls of
  Tensor.item, tolist, cpu, numpy, __bool__, __int__, __float__; `.cpu().numpy()` counted
  once). Per step = the difference between two generate calls that differ only in their
  length, divided by the difference in steps: prefill and set-up cancel, sampling and the
  stop check stay in.
- paper: the paper's regime at a shape (default 0.6B, LoRA r64, bf16 on CUDA): --rows rows of
  one prompt of W - 64 tokens (one prefill, the copies share it), so the step attends about W
  columns; ms per step by the same difference of two calls (graph captures cancel too), plus
  the ops and syncs of `ops` on a small copy of the workload when on a CPU.
- compile: torch.compile(fullgraph=True) of the decode step's forward (a graph break raises),
  on a tiny model, one generate call with one step shape; the tokens must equal the eager run.

--repo PATH runs a section on another checkout's engine.py (rollout.py in checkouts from
before the engine had its own file) and policies.py (this file stays the one that measures);
--compare PATH runs the section here and there, each in its own
process, and prints both and their ratio. Set OMP_NUM_THREADS=1 on a shared CPU: the times
are process CPU time on a CPU device, wall time (synchronised) on CUDA.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def import_checkout(repo: str):
    """(the checkout's engine module, its policies module): engine.py, or rollout.py in a checkout
    from before the engine had a file of its own."""
    import importlib
    sys.path.insert(0, os.path.abspath(repo))
    sys.path.insert(1, os.path.join(HERE, "bench"))
    import policies
    eng = importlib.import_module("engine" if os.path.isfile(os.path.join(repo, "engine.py")) else "rollout")
    assert os.path.dirname(os.path.abspath(eng.__file__)) == os.path.abspath(repo), eng.__file__
    return eng, policies


def build(config: dict, device: str, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(**config, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                      max_position_embeddings=40960)
    if torch.device(device).type == "cuda" and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))     # cuda:N current, as policies.use_device makes it in a run
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype).eval().requires_grad_(False)


def decode_forward(eng):
    """(owner, name) of the decode step's forward in this checkout's engine."""
    return (eng._Decoder, "forward") if hasattr(eng, "_Decoder") else (eng, "_decode")


def wrap(owner, name, before, after):
    real = getattr(owner, name)

    def wrapped(*a, **k):
        before()
        try:
            return real(*a, **k)
        finally:
            after()
    setattr(owner, name, wrapped)
    return lambda: setattr(owner, name, real)


# ----------------------------------------------------------------------------- sections

def mixed(args, eng, policies):
    import torch
    from shapes import CONFIGS
    torch.set_grad_enabled(False)
    model = build({**CONFIGS["0.6b"], "num_hidden_layers": 2, "vocab_size": 512}, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    lens = torch.linspace(100, 3000, 32).round().long().tolist()
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]
    times, t0 = [], [0.0]
    undo = wrap(*decode_forward(eng), lambda: t0.__setitem__(0, time.process_time()),
                lambda: times.append(time.process_time() - t0[0]))
    eng.generate(model, prompts, args.steps + 1, [511], 0, temperature=0)
    undo()
    return {"forward_ms": 1e3 * statistics.median(times), "steps": len(times)}


INSIDE = [False]   # True while the decode step's forward runs (see ops)


def count_ops_and_syncs(fn):
    """(ops that launch a kernel, of them inside the decode forward, host syncs) while fn runs."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    counts = {"ops": 0, "forward": 0, "syncs": 0, "last": None}

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), k=None):
            if not func.is_view:
                counts["ops"] += 1
                counts["forward"] += INSIDE[0]
            return func(*a, **(k or {}))
    reals = {n: getattr(torch.Tensor, n) for n in SYNCS}

    def patched(name):
        def f(self, *a, **k):
            if not (name == "numpy" and counts["last"] == "cpu"):   # .cpu().numpy() is one sync
                counts["syncs"] += 1
            counts["last"] = name
            return reals[name](self, *a, **k)
        return f
    for n in SYNCS:
        setattr(torch.Tensor, n, patched(n))
    try:
        with Ops():
            fn()
    finally:
        for n, f in reals.items():
            setattr(torch.Tensor, n, f)
    return counts["ops"], counts["forward"], counts["syncs"]


def as_on_cuda(eng):
    """Pages, their attention and the stop check as on CUDA (counts then match a GPU's)."""
    for name in ("PAGE", "ATTEND", "STOP_EVERY"):
        if isinstance(getattr(eng, name, None), dict):
            getattr(eng, name)["cpu"] = getattr(eng, name)["cuda"]


def lora_model(eng, policies, config: dict, device: str, dtype):
    """A random model of `config` with a LoRA r64 adapter (random B) active through the hooks."""
    import torch
    model = build(config, device, dtype)
    policy = policies.Policy(model, None, ("generator",), "shared", rank=64, alpha=32)
    with torch.no_grad():
        for p in policy.parameters_of("shared"):
            p.normal_(0, 0.01)
    policy.lora.active = "shared"
    return model


def per_step(eng, model, prompts, short: int, long: int, measure):
    """measure(fn) of a generate call of `long` tokens minus one of `short`, per decode step."""
    def run(n):
        stats = {}
        return lambda: eng.generate(model, prompts, n, [-1], 0, temperature=0.7, seed=1, stats=stats), stats
    (fs, ss), (fl, sl) = run(short), run(long)
    fs()                                     # warm-up: lazy set-ups (the adapters' bf16 copies) happen here
    ss.clear()
    a, b = measure(fs), measure(fl)
    steps = sl["decode_steps"] - ss["decode_steps"]
    return [(y - x) / steps for x, y in zip(a, b)]


def ops(args, eng, policies):
    import torch
    from shapes import CONFIGS
    torch.set_grad_enabled(False)
    model = lora_model(eng, policies, CONFIGS[args.config], "cpu", torch.bfloat16)
    as_on_cuda(eng)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(4)]
    undo = wrap(*decode_forward(eng), lambda: INSIDE.__setitem__(0, True), lambda: INSIDE.__setitem__(0, False))
    n_ops, n_forward, n_syncs = per_step(eng, model, prompts, 4, 12, count_ops_and_syncs)
    undo()
    return {"ops_per_step": n_ops, "forward_ops_per_step": n_forward, "syncs_per_step": n_syncs}


def paper(args, eng, policies):
    import torch
    from shapes import CONFIGS
    torch.set_grad_enabled(False)
    cuda = args.device.startswith("cuda")
    model = lora_model(eng, policies, CONFIGS[args.config], args.device, torch.bfloat16 if cuda else torch.float32)

    def clock(fn):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter() if cuda else time.process_time()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return [(time.perf_counter() if cuda else time.process_time()) - t]
    out = {}
    for W in args.widths:
        prompt = torch.randint(3, 500, (max(8, W - 64),), generator=torch.Generator().manual_seed(W)).tolist()
        ms = per_step(eng, model, [prompt] * args.rows, 8, 8 + args.steps, clock)[0] * 1e3
        out[f"W={W}"] = {"ms_per_step": ms}
        print(f"  W={W}: {ms:.2f} ms/step ({args.rows} rows)", flush=True)
    small = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(4)]
    as_on_cuda(eng)   # counting under a dispatch mode is slow: on a small copy of the workload
    out["ops_per_step"], _, out["syncs_per_step"] = per_step(eng, model, small, 4, 8, count_ops_and_syncs)
    return out


def compile_check(args, eng, policies):
    import torch
    sys.path.insert(0, os.path.join(HERE, "tests"))
    from conftest import tiny_qwen3
    m = tiny_qwen3(seed=0)
    prompts, n = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19]], 6
    eager = eng.generate(m, prompts, n, [63], 0, temperature=0)
    real, compiled = eng._Decoder.forward, {}

    def forward(self, rows):
        if id(self) not in compiled:
            compiled[id(self)] = torch.compile(lambda r: real(self, r), fullgraph=True, dynamic=False)
        return compiled[id(self)](rows)
    eng._Decoder.forward = forward
    t = time.time()
    out = eng.generate(m, prompts, n, [63], 0, temperature=0)
    eng._Decoder.forward = real
    same = bool(torch.equal(out.tokens, eager.tokens))
    print(f"  compiled with fullgraph=True (no graph break) in {time.time() - t:.0f} s; tokens equal eager: {same}")
    return {"fullgraph": True, "same_tokens": same}


SECTIONS = {"mixed": mixed, "ops": ops, "paper": paper, "compile": compile_check}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", required=True, choices=sorted(SECTIONS), help="what to measure")
    ap.add_argument("--repo", default=HERE, help="checkout whose engine and policies.py run (default: this one)")
    ap.add_argument("--compare", default=None, help="another checkout: run the section there too and print the ratio")
    ap.add_argument("--device", default="cpu", help="device of the paper section")
    ap.add_argument("--config", default="0.6b", help="shape of the ops and paper sections (bench/generate.py's CONFIGS)")
    ap.add_argument("--rows", type=int, default=120, help="paper: rows in flight")
    ap.add_argument("--widths", type=int, nargs="+", default=[512, 2560, 5120], help="paper: attended widths W")
    ap.add_argument("--steps", type=int, default=16, help="decode steps measured")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()
    if args.compare:
        res, rest = {}, sys.argv[1:]
        i = rest.index("--compare")
        rest = rest[:i] + rest[i + 2:]
        for name, repo in (("before", args.compare), ("after", HERE)):
            cmd = [sys.executable, __file__, "--repo", repo, *rest, "--json", "/dev/stdout"]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            res[name] = json.loads(out.strip().splitlines()[-1])
            print(f"{name:6s} {os.path.abspath(repo)}: {res[name]}", flush=True)
        for k, v in res["before"].items():
            if isinstance(v, (int, float)) and res["after"].get(k):
                print(f"  {k}: {v:.4g} -> {res['after'][k]:.4g} ({v / res['after'][k]:.2f}x)")
        return
    eng, policies = import_checkout(args.repo)
    res = SECTIONS[args.section](args, eng, policies)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(res) + "\n")
    else:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
