"""The engine's CUDA paths checked on a CPU: what it asks of torch.cuda (a stand-in records it and
emulates a graph's capture and replay), the first failed capture turning graphs off, the row
groups a graph keeps, the attention kernels pinned at every call site, and a host-only
simulation of a paper-like voter call counting graph captures."""
import contextlib
import math
import types

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import cudagraphs
import engine
import rollout
import seeds
from conftest import tiny_qwen3
from test_sampler import MIXED, MIXED_LIMITS, PAD, STOP, assert_same_generation, budget_for

SYNC_OPS = {"_local_scalar_dense", "nonzero", "item"}   # what reads the device: refused while capturing


class _Recorder(TorchDispatchMode):
    """Runs and records every aten op, as a capture records kernels; a host read raises, as it
    does in a real capture."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.__name__.split(".")[0] in SYNC_OPS:
            raise RuntimeError(f"operation not permitted when stream is capturing ({func.__name__})")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


class FakeGraph:
    """A captured step: its aten ops, replayed on the same tensors (static addresses), each
    output written into the tensor the capture made, so what the Python of the step read at
    capture (shapes, host numbers, which tensors) is frozen, as in a CUDA graph."""

    def __init__(self, fake):
        self.fake, self.ops = fake, []

    def replay(self):
        self.fake.replays += 1
        if not self.fake.execute:
            return
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for o, n in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                if torch.is_tensor(o) and o.data_ptr() != n.data_ptr():
                    o.copy_(n)

    def pool(self):
        return ("pool", id(self.fake))


class FakeCuda:
    """A stand-in for torch.cuda: records which device each call names and which is current,
    and emulates capture (recording) and replay (FakeGraph). `fail`: the capture raises this."""

    def __init__(self, execute=True, fail=None):
        self.execute, self.fail = execute, fail
        self.current, self.calls, self.captures, self.replays = None, [], 0, 0

    @contextlib.contextmanager
    def device(self, d):
        before, self.current = self.current, torch.device(d)
        try:
            yield
        finally:
            self.current = before

    def Stream(self, device=None):  # noqa: N802 - torch.cuda's name
        self.calls.append(("Stream", torch.device(device), self.current))
        return types.SimpleNamespace(wait_stream=lambda s: None)

    def current_stream(self, device=None):
        self.calls.append(("current_stream", torch.device(device), self.current))
        return types.SimpleNamespace(wait_stream=lambda s: None)

    def stream(self, s):
        return contextlib.nullcontext()

    def CUDAGraph(self):  # noqa: N802
        return FakeGraph(self)

    @contextlib.contextmanager
    def graph(self, g, pool=None, stream=None):
        self.calls.append(("graph", None, self.current))
        if self.fail is not None:
            try:
                raise self.fail
            finally:   # as torch.cuda.graph's exit: ending the capture raises again
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        rec = _Recorder()
        with rec:
            yield
        g.ops = rec.ops
        self.captures += 1

    def synchronize(self, device=None):
        self.calls.append(("synchronize", torch.device(device), self.current))


@pytest.fixture
def fake_cuda(monkeypatch):
    """Graphs on for a CPU model, through a fresh FakeCuda, with GRAPHS restored after."""
    def make(**kw):
        fake = FakeCuda(**kw)
        monkeypatch.setattr(cudagraphs, "cuda", fake)
        monkeypatch.setattr(cudagraphs, "usable", lambda device: not cudagraphs.GRAPHS["refused"])
        monkeypatch.setattr(cudagraphs, "on_device", lambda device: fake.device(device))
        return fake
    monkeypatch.setattr(cudagraphs, "GRAPHS", dict(cudagraphs.GRAPHS, refused=""))
    return make


def small_cuda_layout(monkeypatch):
    """Row groups of 2+ rows and widths rounded to 2 columns with 3 of headroom: CUDA's rules at
    a tiny model's scale, so a graph serves several steps."""
    monkeypatch.setitem(engine.WIDTH_BUCKET, "cpu", 2)
    monkeypatch.setitem(engine.GROUP_ROWS, "cpu", 2)
    monkeypatch.setitem(engine.HEADROOM, "cpu", 3)
    monkeypatch.setattr(engine, "ATTN_GROUPS", 4)


# ----------------------------------------------------------------------------- the device and the graphs

def test_every_cuda_call_names_the_models_device_and_runs_with_it_current(fake_cuda, monkeypatch):
    # on CUDA the model's device is cuda:N; here, the CPU stands for it: a stream or a capture
    # made without naming it would go to the current device and record nothing
    small_cuda_layout(monkeypatch)
    fake = fake_cuda()
    m = tiny_qwen3(seed=0)
    dev = next(m.parameters()).device
    engine.generate(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3,
                    kv_budget=budget_for(m, 5, MIXED, MIXED_LIMITS))
    assert fake.captures >= 2 and fake.replays > fake.captures
    assert fake.calls and all(cur == dev and (named is None or named == dev) for _, named, cur in fake.calls)


def test_on_device_makes_the_cuda_device_current(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(cudagraphs, "cuda", fake)
    with cudagraphs.on_device("cuda:1"):
        assert fake.current == torch.device("cuda:1")
    with cudagraphs.on_device("cpu"):
        assert fake.current is None


def test_a_run_on_cuda_n_makes_cuda_n_current_and_cudnn_attention_off(monkeypatch):
    import policies
    made = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.append(torch.device(d)))
    flags = {name: getattr(torch.backends.cuda, name)() for name in ("cudnn_sdp_enabled",)}
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for device in ("cuda:1", "cuda", torch.device("cuda", 2)):
            policies.cuda_settings(device)         # policies.load calls it for train.py and eval.py
        assert made == [torch.device("cuda:1"), torch.device("cuda:2")]   # plain cuda: the current one
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(flags["cudnn_sdp_enabled"])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def test_replayed_graphs_sample_what_generate_simple_does(fake_cuda, monkeypatch):
    # the stand-in replays each captured step's recorded ops on the same tensors, so a step
    # whose graph depended on anything but its buffers (a host number, a new tensor) would
    # sample wrong
    small_cuda_layout(monkeypatch)
    m = tiny_qwen3(seed=0)
    keys = [seeds.key("mixed", i) for i in range(len(MIXED))]
    for temperature, top_p in ((0, 1.0), (0.7, 0.9)):
        simple = rollout.generate_simple(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=temperature, top_p=top_p,
                                         seed=3, keys=keys)
        for rows in (2, 5):
            fake = fake_cuda()
            stats = {}
            fast = engine.generate(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=temperature, top_p=top_p, seed=3,
                                   keys=keys, kv_budget=budget_for(m, rows, MIXED, MIXED_LIMITS), stats=stats)
            assert_same_generation(fast, simple)
            assert fake.replays > 2 * fake.captures and fake.replays + fake.captures == stats["decode_steps"]


def test_the_first_failed_capture_turns_graphs_off_for_the_process_and_says_its_first_cause(fake_cuda, capsys):
    fake = fake_cuda(fail=ValueError("the op that cannot be captured"))
    m = tiny_qwen3(seed=0)
    simple = rollout.generate_simple(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3)
    for _ in range(2):   # the second call tries no capture
        out = engine.generate(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3)
        assert_same_generation(out, simple)
    assert sum(name == "graph" for name, _, _ in fake.calls) == 1
    assert cudagraphs.GRAPHS["refused"] == "ValueError: the op that cannot be captured"
    assert capsys.readouterr().err.count("no CUDA graphs for the rest of this process (ValueError") == 1
    assert cudagraphs.GRAPHS["captures"] == 0 and cudagraphs.GRAPHS["eager_steps"] > 0
    assert "graphs refused: ValueError" in cudagraphs.graphs_line()


def test_a_held_layout_covers_every_busy_row_and_is_dropped_when_it_costs_too_much(monkeypatch):
    monkeypatch.setitem(engine.HEADROOM, "cpu", 8)
    monkeypatch.setitem(engine.WIDTH_BUCKET, "cpu", 4)
    monkeypatch.setitem(engine.ATTN_CALL, "cpu", 0)
    st = engine._Rows.empty(4, discard=4, device="cpu")
    st.host.pos[:], st.host.busy[:], st.n = np.array([39, 29, 9, 4]), 1, 4        # widths 40, 30, 10, 5
    dec = engine._Decoder(ScheduleModel(), None, None, st, graphs=False)
    first = dec.layout(length=100, per_column=1)
    assert all(w >= 8 + (st.host.pos[a:b] + 1).max() for a, b, w in first)    # headroom beyond the widest row
    for _ in range(7):                                                           # rows grow into the headroom
        st.host.pos += 1
        assert dec.layout(100, 1) == first
    st.host.pos += 2                                                             # the widest row outgrows it
    second = dec.layout(100, 1)
    assert second != first and all((st.host.pos[a:b] + 1).max() <= w for a, b, w in second)
    st.host.busy[0] = 0                                                          # the widest row ends: 40% waste
    assert dec.layout(100, 1)[0][2] < second[0][2]


# ----------------------------------------------------------------------------- the attention kernels

def test_every_sdpa_call_of_generate_runs_with_the_pinned_kernels(monkeypatch):
    """On CUDA generate pins the kernels for its calls (policies.attention_kernels), whoever
    loaded the model; here forced on a CPU, where the flags are visible: every SDPA call of a
    prefill and of a decode step sees cuDNN's kernel off, and the flags come back after."""
    import policies
    import torch.nn.functional as F
    real_kernels, seen = policies.attention_kernels, []
    monkeypatch.setattr(policies, "attention_kernels", lambda device: real_kernels("cuda"))
    real_sdpa = F.scaled_dot_product_attention

    def recording(q, *a, **k):
        seen.append((q.shape[2], torch.backends.cuda.cudnn_sdp_enabled()))
        return real_sdpa(q, *a, **k)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    engine.generate(tiny_qwen3(seed=0), [[5, 6, 7], [8, 9]], 4, [1], 2, temperature=0.7)
    assert {q > 2 for q, _ in seen} == {True, False}                   # prefill calls and decode calls
    assert not any(cudnn for _, cudnn in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()                       # restored after


def test_the_kernels_are_left_alone_on_a_cpu():
    import policies
    assert isinstance(policies.attention_kernels("cpu"), contextlib.nullcontext)


# ----------------------------------------------------------------------------- a paper-like voter call

class ScheduleModel(torch.nn.Module):
    """A stand-in for a model when only the schedule matters: one layer, one KV head of one
    dimension, a few tokens; every forward writes zeros into the cache and favours token 3, which
    is no stop id, so every row runs to its own limit."""

    def __init__(self, vocab: int = 8):
        super().__init__()
        from transformers import Qwen3Config
        self.config = Qwen3Config(vocab_size=vocab, hidden_size=2, intermediate_size=2, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1, head_dim=1)
        self.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

    @property
    def dtype(self):
        return self.weight.dtype

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=True, logits_to_keep=None,
                past_key_values=None, row_groups=None, **kwargs):
        n, T = input_ids.shape
        zeros = torch.zeros(n, 1, T, 1)
        past_key_values.layers[0].update(zeros, zeros, 0)
        logits = torch.zeros(n, 1, self.config.vocab_size)
        logits[..., 3] = 1.0
        return types.SimpleNamespace(logits=logits)


def simulate_voter_call(monkeypatch, headroom: int, rows: int = 512, seed: int = 0) -> dict:
    """engine.generate's own schedule on a paper-like voter call, with CUDA's constants and the
    0.6B shape's cost of an attention call: `rows` rows, three voters to a prompt of 150-350
    tokens, completions lognormal (median 900, sigma 0.9) cut at 5,120 tokens (each row's limit,
    so it ends there), in the rows a 0.85 KV budget holds on an H200 at the 0.6B shape. The
    graphs are the stand-in's (no replay work). Returns the call's counts."""
    for name in ("GROUP_ROWS", "WIDTH_BUCKET", "STOP_EVERY", "PREFILL_CALL"):
        monkeypatch.setitem(getattr(engine, name), "cpu", getattr(engine, name)["cuda"])
    monkeypatch.setitem(engine.ATTN_CALL, "cpu", engine.ATTN_CALL["cuda"] / (8 * 128))   # per 0.6B column
    monkeypatch.setitem(engine.HEADROOM, "cpu", headroom)
    fake = FakeCuda(execute=False)
    monkeypatch.setattr(cudagraphs, "cuda", fake)
    monkeypatch.setattr(cudagraphs, "usable", lambda device: True)
    monkeypatch.setattr(cudagraphs, "GRAPHS", dict(cudagraphs.GRAPHS, refused=""))
    g = np.random.default_rng(seed)
    problems = -(-rows // 3)
    lens = g.integers(150, 351, problems)
    prompts = [[5] * int(lens[i // 3]) for i in range(rows)]
    prompts = [[5 + (i // 3) % 50] + p[1:] for i, p in enumerate(prompts)]      # three voters share a prompt
    limits = np.minimum(5120, np.maximum(1, np.round(np.exp(np.log(900) + 0.9 * g.standard_normal(rows))))).astype(int)
    need = max(len(p) + t for p, t in zip(prompts, limits))
    held = engine.rows_that_fit(int(0.85 * 137.91 * 2**30), 114_688, need)     # 0.6B, bf16: 112 KiB a token
    stats = {}
    engine.generate(ScheduleModel(), prompts, limits.tolist(), [0], 1, temperature=0, max_rows=held, stats=stats)
    return {"rows_held": held, "decode_steps": stats["decode_steps"], "captures": fake.captures,
            "steps_per_capture": stats["decode_steps"] / max(fake.captures, 1)}


def test_a_paper_like_voter_call_captures_a_graph_every_hundred_steps_or_more(monkeypatch):
    """Without headroom (each step's own cheapest groups, as before) the call captures a graph
    every few dozen steps; with HEADROOM["cuda"] a graph serves over a hundred. Run with -s for
    the counts."""
    before = simulate_voter_call(monkeypatch, headroom=0)
    after = simulate_voter_call(monkeypatch, headroom=engine.HEADROOM["cuda"])
    print(f"paper-like voter call, {before['rows_held']} rows held, {after['decode_steps']} decode steps: "
          f"{before['captures']} captures ({before['steps_per_capture']:.0f} steps each) without headroom, "
          f"{after['captures']} ({after['steps_per_capture']:.0f} steps each) with {engine.HEADROOM['cuda']} columns")
    assert before["decode_steps"] == after["decode_steps"] > 4000      # the same schedule of rows
    assert before["steps_per_capture"] < 60
    assert after["steps_per_capture"] >= 100 and after["captures"] * 3 <= before["captures"]
    assert math.isfinite(after["steps_per_capture"])
