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


def _storage(t) -> int:
    return t.untyped_storage().data_ptr()


def _written(func, args, kwargs) -> list:
    """The tensors an aten op writes in place (its schema's mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = kwargs.get(a.name, args[i] if i < len(args) else None)
            out += [t for t in tree_flatten(v)[0] if torch.is_tensor(t)]
    return out


class _Recorder(TorchDispatchMode):
    """Records every aten op of a piece being captured, as a capture records kernels; a host read
    raises, as it does in a real capture. It runs each op too (the next op's arguments are its
    outputs), so `undo` then leaves what a real capture leaves, which runs nothing: every tensor
    that was there before the piece holds what it held (the writes undone), and what the piece
    made holds garbage (NaN where it is floating point), which is what an eager hole after the
    piece reads during a capture."""

    def __init__(self):
        super().__init__()
        self.ops, self.made, self.saved = [], set(), []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__.split(".")[0] in SYNC_OPS:
            raise RuntimeError(f"operation not permitted when stream is capturing ({func.__name__})")
        for t in _written(func, args, kwargs):
            if _storage(t) not in self.made and not any(t is s for s, _ in self.saved):
                self.saved.append((t, t.clone()))
        out = func(*args, **kwargs)
        given = {_storage(t) for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
        self.made |= {_storage(o) for o in tree_flatten(out)[0] if torch.is_tensor(o) and _storage(o) not in given}
        self.ops.append((func, args, kwargs, out))
        return out

    def undo(self) -> None:
        for t, before in reversed(self.saved):
            t.copy_(before)
        for _, _, _, out in self.ops:
            for o in tree_flatten(out)[0]:
                if torch.is_tensor(o) and o.is_floating_point() and _storage(o) in self.made:
                    o.fill_(float("nan"))


class FakeGraph:
    """A captured piece of a step: its aten ops, replayed on the same tensors (static addresses),
    each output written into the tensor the capture made, so what the Python of the step read at
    capture (shapes, host numbers, which tensors) is frozen, as in a CUDA graph; and, as in one,
    the capture itself leaves nothing done (_Recorder.undo)."""

    def __init__(self, fake):
        self.fake, self.ops, self.rec = fake, [], None

    def capture_begin(self, pool=None):
        self.fake.calls.append(("graph", None, self.fake.current))
        if self.fake.fail is not None:
            raise self.fake.fail
        self.fake.pieces += 1
        self.rec = _Recorder()
        self.rec.__enter__()

    def capture_end(self):
        if self.rec is None:   # as torch's: ending a capture that failed raises again
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.rec.__exit__(None, None, None)
        self.rec.undo()
        self.ops, self.rec = self.rec.ops, None

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
    and emulates capture (recording) and replay (FakeGraph), counting pieces captured and
    replayed. `fail`: every capture raises this."""

    def __init__(self, execute=True, fail=None):
        self.execute, self.fail = execute, fail
        self.current, self.calls, self.pieces, self.replays = None, [], 0, 0

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

    def synchronize(self, device=None):
        self.calls.append(("synchronize", torch.device(device), self.current))

    def Event(self):  # noqa: N802
        fake, name = self, len([c for c in self.calls if c[0] == "Event"])
        self.calls.append(("Event", name, self.current))
        return types.SimpleNamespace(record=lambda: fake.calls.append(("record", name, fake.current)),
                                     synchronize=lambda: fake.calls.append(("wait", name, fake.current)))


@pytest.fixture
def fake_cuda(monkeypatch):
    """Graphs on for a CPU model, through a fresh FakeCuda, with GRAPHS restored after."""
    def make(**kw):
        fake = FakeCuda(**kw)
        monkeypatch.setattr(cudagraphs, "cuda", fake)
        monkeypatch.setattr(cudagraphs, "usable", lambda device: not cudagraphs.GRAPHS["refused"])
        monkeypatch.setattr(cudagraphs, "on_device", lambda device: fake.device(device))
        return fake
    fresh_graphs(monkeypatch)
    return make


def fresh_graphs(monkeypatch):
    """GRAPHS at zero and no kept graphs, restored after the test."""
    monkeypatch.setattr(cudagraphs, "GRAPHS", {k: type(v)() for k, v in cudagraphs.GRAPHS.items()})
    monkeypatch.setattr(engine, "_KEPT", {})


def small_cuda_layout(monkeypatch):
    """Pages of 3 tokens: rows cross page boundaries between replays, as on CUDA at length."""
    monkeypatch.setitem(engine.PAGE, "cpu", 3)


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
    g = cudagraphs.GRAPHS
    assert g["captures"] >= 2 and g["replays"] > g["captures"] and fake.pieces > g["captures"]
    assert fake.calls and all(cur == dev and (named is None or named == dev) for _, named, cur in fake.calls)


def test_the_stand_ins_capture_runs_nothing_as_a_real_one(fake_cuda):
    # what lets the tests here catch a step that counts on its capture's own execution: a write
    # is undone, and what the piece made is garbage for the eager hole that reads it next; a
    # replay does both
    fake = fake_cuda()
    graph, buf = fake.CUDAGraph(), torch.zeros(3)
    graph.capture_begin()
    made = buf + 1
    buf.add_(1)
    graph.capture_end()
    assert torch.equal(buf, torch.zeros(3)) and made.isnan().all()
    graph.replay()
    assert torch.equal(buf, torch.ones(3)) and torch.equal(made, torch.ones(3))


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
    # the stand-in replays each captured piece's recorded ops on the same tensors, and the holes
    # (each layer's paged attention) between them, so a step whose graph depended on anything but
    # its buffers (a host number, a new tensor, an earlier call's cache) would sample wrong. The
    # graphs are kept across calls: the later calls capture nothing new
    small_cuda_layout(monkeypatch)
    m = tiny_qwen3(seed=0)
    keys = [seeds.key("mixed", i) for i in range(len(MIXED))]
    fake_cuda()
    for temperature, top_p in ((0, 1.0), (0.7, 0.9)):
        simple = rollout.generate_simple(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=temperature, top_p=top_p,
                                         seed=3, keys=keys)
        for rows in (2, 1, None):
            stats, before = {}, dict(cudagraphs.GRAPHS)
            fast = engine.generate(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=temperature, top_p=top_p, seed=3,
                                   keys=keys, stats=stats,
                                   kv_budget=None if rows is None else budget_for(m, rows, MIXED, MIXED_LIMITS))
            assert_same_generation(fast, simple)
            g = {k: cudagraphs.GRAPHS[k] - before[k] for k in ("captures", "replays", "eager_steps")}
            assert g["eager_steps"] == 0 and g["captures"] + g["replays"] == stats["decode_steps"]
    slots = next(iter(engine._KEPT.values()))
    assert cudagraphs.GRAPHS["captures"] == len(slots.graphs.graphs) <= 5           # once a row bucket: 1 .. 16
    assert cudagraphs.GRAPHS["replays"] > 10 * cudagraphs.GRAPHS["captures"]


def test_a_steps_numbers_go_up_through_two_host_buffers_each_rewritten_after_its_last_copy(fake_cuda, monkeypatch):
    # from pageable memory a non_blocking copy may wait for the device's queue; from a pinned
    # buffer it does not, but the buffer must not change before its copy has run
    fake = fake_cuda()
    dst = torch.zeros(6, dtype=torch.long)
    up = engine._Upload(dst, buffered=True, pin=False)   # the CUDA path, unpinned on a CPU
    for k in range(4):
        up(np.arange(k, k + 3 + k % 2))
        assert dst[:3 + k % 2].tolist() == list(range(k, k + 3 + k % 2))
        assert up.bufs[k % 2][:3 + k % 2].tolist() == list(range(k, k + 3 + k % 2))
    log = [(c[0], c[1]) for c in fake.calls if c[0] in ("record", "wait")]
    assert log == [("record", 0), ("record", 1), ("wait", 0), ("record", 2), ("wait", 1), ("record", 3)]
    # a whole generation through it samples what generate_simple does, one upload a decode step
    real = engine._Upload
    monkeypatch.setattr(engine, "_Upload", lambda d, buffered: real(d, True, pin=False))
    m = tiny_qwen3(seed=0)
    keys = [seeds.key("mixed", i) for i in range(len(MIXED))]
    simple = rollout.generate_simple(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3, keys=keys)
    stats, before = {}, len(fake.calls)
    fast = engine.generate(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3, keys=keys, stats=stats,
                           kv_budget=budget_for(m, 2, MIXED, MIXED_LIMITS))
    assert_same_generation(fast, simple)
    assert sum(c[0] == "record" for c in fake.calls[before:]) == stats["decode_steps"]


def test_the_holes_of_every_row_bucket_keep_views_of_one_set_of_buffers(fake_cuda, monkeypatch):
    # a graph keeps what its holes read and return for its life; were they each bucket's own
    # tensors, a process would hold 12 KiB a row, layer and bucket (5.5 GiB a set of weights at
    # 512 rows of the 0.6B shape), which the memory plan does not count
    small_cuda_layout(monkeypatch)
    fake_cuda()
    m = tiny_qwen3(seed=0)
    engine.generate(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3)
    slots = next(iter(engine._KEPT.values()))
    buffers = {b.untyped_storage().data_ptr() for layer in slots.holes for b in layer}
    kept = []
    for pieces in slots.graphs.graphs.values():
        for fn, out in pieces.holes:
            kept += [out] + [c.cell_contents for c in fn.__closure__ if torch.is_tensor(c.cell_contents)]
    assert len(slots.graphs.graphs) >= 2 and len(kept) >= 4 * m.config.num_hidden_layers
    assert {t.untyped_storage().data_ptr() for t in kept} <= buffers
    per_row = sum(b[0].numel() * b.element_size() for layer in slots.holes for b in layer)
    assert per_row == engine.hole_bytes_per_row(m.config, m.dtype)


def test_graphs_are_kept_for_each_adapter_and_never_replay_another_ones(fake_cuda, monkeypatch):
    """A graph bakes in the adapter active at capture (policies.LoRA's hooks): two adapters
    alternating in one process sample what generate_simple does under each, and each captures
    its row buckets once."""
    import policies
    small_cuda_layout(monkeypatch)
    m = tiny_qwen3(seed=0)
    pol = policies.Policy(m, None, ("generator", "aggregator"), "isolated", rank=4, alpha=8)
    torch.manual_seed(1)
    with torch.no_grad():
        for name in pol.names:
            for p in pol.parameters_of(name):
                p.normal_(0, 0.3)
    fake_cuda()
    keys = [seeds.key("adapter", i) for i in range(len(MIXED))]
    for _ in range(2):
        for name in pol.names:
            with pol.using(name) as model:
                simple = rollout.generate_simple(model, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3,
                                                 keys=keys)
                assert_same_generation(engine.generate(model, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7,
                                                       seed=3, keys=keys), simple)
    assert len(engine._KEPT) == 2
    assert cudagraphs.GRAPHS["captures"] == sum(len(s.graphs.graphs) for s in engine._KEPT.values())


def test_a_failed_capture_is_tried_once_more_then_graphs_are_off_and_said_with_its_first_cause(fake_cuda, capsys):
    fake = fake_cuda(fail=ValueError("the op that cannot be captured"))
    m = tiny_qwen3(seed=0)
    simple = rollout.generate_simple(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3)
    assert cudagraphs.graphs_status() == ""
    for _ in range(2):   # the second call tries no capture
        out = engine.generate(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3)
        assert_same_generation(out, simple)
    assert sum(name == "graph" for name, _, _ in fake.calls) == 2          # the capture, and one retry
    assert cudagraphs.GRAPHS["refused"] == "ValueError: the op that cannot be captured"
    assert cudagraphs.GRAPHS["failures"] == 2
    assert capsys.readouterr().err.count("no CUDA graphs for the rest of this process (ValueError") == 1
    assert cudagraphs.GRAPHS["captures"] == 0 and cudagraphs.GRAPHS["eager_steps"] > 0
    assert "graphs refused: ValueError" in cudagraphs.graphs_line()
    assert cudagraphs.graphs_status() == "off (ValueError: the op that cannot be captured)"   # train.py's step line


def test_a_capture_that_fails_once_is_retried_and_kept(fake_cuda):
    fake = fake_cuda()
    real, tries = FakeGraph.capture_begin, []

    def flaky(self, pool=None):
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("a transient failure")
        return real(self, pool)
    FakeGraph.capture_begin = flaky
    try:
        m = tiny_qwen3(seed=0)
        out = engine.generate(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3)
    finally:
        FakeGraph.capture_begin = real
    assert_same_generation(out, rollout.generate_simple(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3))
    g = cudagraphs.GRAPHS
    assert g["failures"] == 1 and not g["refused"] and g["captures"] >= 1 and g["replays"] > 0
    assert cudagraphs.graphs_status() == "1 failed captures" and fake.pieces > 0


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
    assert seen and all(q > 1 for q, _ in seen)                          # prefill calls (decode attends by pages)
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
                past_key_values=None, **kwargs):
        n, T = input_ids.shape
        zeros = torch.zeros(n, 1, T, 1)
        past_key_values.layers[0].update(zeros, zeros, 0)
        logits = torch.zeros(n, 1, self.config.vocab_size)
        logits[..., 3] = 1.0
        return types.SimpleNamespace(logits=logits)


def simulate_voter_call(monkeypatch, rows: int = 512, seed: int = 0, calls: int = 2) -> dict:
    """engine.generate's own schedule on a paper-like voter call, with CUDA's constants: `rows`
    rows, three voters to a prompt of 150-350 tokens, completions lognormal (median 900, sigma
    0.9) cut at 5,120 tokens (each row's limit, so it ends there), in the pages a 0.85 KV budget
    holds on an H200 at the 0.6B shape (112 KiB a token), `calls` times in one process. The
    graphs are the stand-in's (no replay work). Returns the calls' counts."""
    for name in ("PAGE", "ATTEND", "STOP_EVERY", "PREFILL_CALL"):
        monkeypatch.setitem(getattr(engine, name), "cpu", getattr(engine, name)["cuda"])
    fake = FakeCuda(execute=False)
    monkeypatch.setattr(cudagraphs, "cuda", fake)
    monkeypatch.setattr(cudagraphs, "usable", lambda device: True)
    fresh_graphs(monkeypatch)
    g = np.random.default_rng(seed)
    problems = -(-rows // 3)
    lens = g.integers(150, 351, problems)
    prompts = [[5] * int(lens[i // 3]) for i in range(rows)]
    prompts = [[5 + (i // 3) % 50] + p[1:] for i, p in enumerate(prompts)]      # three voters share a prompt
    limits = np.minimum(5120, np.maximum(1, np.round(np.exp(np.log(900) + 0.9 * g.standard_normal(rows))))).astype(int)
    model = ScheduleModel()
    tokens = int(0.85 * 137.91 * 2**30) // 114_688                               # what the H200's budget holds
    budget = tokens * engine.kv_bytes_per_token(model.config, model.dtype)      # the same tokens of this model
    stats = {}
    for _ in range(calls):
        engine.generate(model, prompts, limits.tolist(), [0], 1, temperature=0, kv_budget=budget, stats=stats)
    buckets = sum(len(slots.graphs.graphs) for slots in engine._KEPT.values())
    G = cudagraphs.GRAPHS
    return {"rows": stats["rows"], "decode_steps": stats["decode_steps"], "captures": G["captures"],
            "buckets": buckets, "attended": stats["attended_columns"] / stats["own_columns"],
            "steps_per_capture": stats["decode_steps"] / max(G["captures"], 1)}


def test_a_paper_like_voter_call_attends_its_rows_own_widths_and_captures_a_bucket_once(monkeypatch):
    """Paged attention: the pages a step attends (each row's own columns rounded up to a page)
    are within 1.1x the rows' own widths (the row groups of dense rows attended 1.56x); the
    budget's pages hold every row at once; two calls in one process capture each row bucket
    once. Run with -s for the counts."""
    sim = simulate_voter_call(monkeypatch)
    print(f"paper-like voter call, two calls: {sim['rows']} rows at once, {sim['decode_steps']} decode steps, "
          f"attended {sim['attended']:.3f}x the rows' own widths, {sim['captures']} captures of "
          f"{sim['buckets']} row buckets ({sim['steps_per_capture']:.0f} steps each)")
    assert sim["decode_steps"] > 8000 and sim["rows"] == 512
    assert 1.0 <= sim["attended"] <= 1.1
    assert sim["captures"] == sim["buckets"] <= 70           # 1, 2, 4, 8, 16, ..., 512: once each
