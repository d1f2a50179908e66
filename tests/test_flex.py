"""ATTEND "flex" (engine.flex_paged_attention) on a CPU: FlexAttention run eagerly over the pools
with the block mask a CUDA run compiles, against paged_attention, row_attention and a per-row
softmax; what a fused kernel reads of that mask (only the pages it lists) emulated by hand;
generate with it against generate_simple; the compiled function traced by dynamo whole, once a
row count; and the fall back to "pages" when flex is missing or its compile fails."""
import warnings

import pytest
import torch

import engine
import rollout
import seeds
from conftest import tiny_qwen3
from test_cudagraphs import fake_cuda, small_cuda_layout  # noqa: F401 - fake_cuda: a fixture
from test_sampler import MIXED, MIXED_LIMITS, PAD, PROMPTS, STOP, Step, assert_same_generation, budget_for

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(autouse=True)
def fresh_flex(monkeypatch):
    """FLEX at zero and nothing compiled, restored after the test."""
    monkeypatch.setattr(engine, "FLEX", {k: type(v)() for k, v in engine.FLEX.items()})
    monkeypatch.setattr(engine, "_FLEX_COMPILED", {"rows": set()})


class FlexStep:
    """A flex step's numbers as _Writes.decode makes them: (N, P) tables, (N,) widths and their
    flex_tables over a pool of pool_pages pages of `page` tokens."""

    def __init__(self, tables, widths, N, pool_pages, page):
        P = max(map(len, tables))
        self.table = torch.zeros(N, P, dtype=torch.long)
        for r, t in enumerate(tables):
            self.table[r, :len(t)] = torch.tensor(t, dtype=torch.long)
        self.width = torch.zeros(N, dtype=torch.long)
        self.width[:len(widths)] = torch.tensor(widths)
        self.flex = engine.flex_tables(self.table, self.width, pool_pages, page)


def listed_blocks_attention(q, pool_k, pool_v, mask, scaling):
    """What a fused kernel computes from a BlockMask (eager FlexAttention ignores its lists): row b
    visits only its listed pages, the partial ones (kv_indices) through mask_mod and any full ones
    (full_kv_indices) whole, each once; a row that visits nothing gets zeros."""
    N, Hq, _, D = q.shape
    Hkv, _, page, _ = pool_k.shape
    K, V = pool_k.reshape(Hkv, -1, D), pool_v.reshape(Hkv, -1, D)
    out = torch.zeros_like(q)
    for b in range(N):
        cols = []
        for num, idx, masked in ((mask.kv_num_blocks, mask.kv_indices, True),
                                 (mask.full_kv_num_blocks, mask.full_kv_indices, False)):
            for p in ([] if num is None else idx[b, 0, 0, :int(num[b, 0, 0])].tolist()):
                kv = torch.arange(p * page, (p + 1) * page)
                keep = mask.mask_mod(torch.tensor(b), 0, 0, kv) if masked else torch.ones(page, dtype=torch.bool)
                cols += kv[keep].tolist()
        assert len(cols) == len(set(cols)), f"row {b} visits a column twice"
        if cols:
            k, v = K[:, cols].repeat_interleave(Hq // Hkv, 0), V[:, cols].repeat_interleave(Hq // Hkv, 0)
            out[b] = torch.softmax(q[b] @ k.transpose(1, 2) * scaling, -1) @ v
    return out


def test_flex_attention_equals_paged_and_row_attention_and_each_rows_own_softmax():
    """Rows of 23, 11, 9, 7, 4, 2 and 1 columns in pages of 3 scattered through a pool (two rows
    share a page), a free row, 4 query heads a KV head, padded to flex_rows' 16 rows: eager flex,
    the kernel's reading of its block mask, paged_attention and row_attention all give each row's
    softmax over its own columns, and the free and padded rows zeros."""
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, D, page, width = 8, 2, 16, 3, [23, 11, 9, 7, 4, 2, 1, 0]
    n, W, scaling = len(width), max(width), D ** -0.5
    q, k, v = (torch.randn(n, h, t, D, generator=g) for h, t in ((Hq, 1), (Hkv, W), (Hkv, W)))
    k[1, :, :3], v[1, :, :3] = k[0, :, :3], v[0, :, :3]          # rows 0 and 1 share their first page
    pool_k, pool_v = torch.randn(Hkv, 40, page, D, generator=g), torch.randn(Hkv, 40, page, D, generator=g)
    free = iter(torch.randperm(39, generator=g).add(1).tolist())
    tables, pages, rows, valid = [[] for _ in width], [], [], []
    for r, w in enumerate(width):
        for j in range(-(-w // page)):
            p = tables[0][0] if (r, j) == (1, 0) else next(free)
            cols = slice(j * page, min(w, (j + 1) * page))
            pool_k[:, p, :cols.stop - cols.start], pool_v[:, p, :cols.stop - cols.start] = k[r, :, cols], v[r, :, cols]
            tables[r].append(p), pages.append(p), rows.append(r), valid.append(cols.stop - cols.start)
    own = torch.arange(W) < torch.tensor(width)[:, None]                                   # (n, W)
    ref = torch.stack([torch.softmax(q[r].view(Hkv, -1, D) @ k[r, :, own[r]].transpose(1, 2) * scaling, -1)
                       @ v[r, :, own[r]] for r in range(n - 1)]).reshape(n - 1, 1, Hq, D)   # (n-1, 1, Hq, D)
    N = engine.flex_rows(n)
    assert N == 16
    step = FlexStep(tables, width, N, 40, page)
    flex = engine.flex_paged_attention(q, pool_k, pool_v, step, scaling)                   # (n, 1, Hq, D)
    mask = engine.flex_block_mask(step.flex, page)
    padded = torch.cat([q, torch.randn(N - n, Hq, 1, D, generator=g)])
    kernel = listed_blocks_attention(padded, pool_k, pool_v, mask, scaling).transpose(1, 2)   # (N, 1, Hq, D)
    paged = engine.paged_attention(q, pool_k, pool_v, Step(n, pages, rows, valid, page), scaling)
    columns = torch.arange(step.table.shape[1] * page) < torch.tensor(width)[:, None]        # (n, P x PAGE)
    by_rows = engine.row_attention(q[:-1], pool_k, pool_v,
                                   engine._RowTables(step.table[:n - 1], columns[:-1, None, None]), scaling)
    for out in (flex[:-1], kernel[:n - 1], paged[:-1], by_rows):
        assert float((out - ref).abs().max()) < 1e-5
    assert flex.shape == (n, 1, Hq, D) and bool((flex[-1] == 0).all()) and bool((kernel[n - 1:] == 0).all())
    assert engine.FLEX["refused"] == ""


def generate_with_flex(m, prompts, limits, stop, budget_rows, **kw):
    stats = {}
    out = engine.generate(m, prompts, limits, stop, PAD, stats=stats,
                          kv_budget=None if budget_rows is None else budget_for(m, budget_rows, prompts, limits), **kw)
    assert stats["own_columns"] <= stats["attended_columns"]
    return out, stats


def test_flex_generation_samples_what_generate_simple_does(monkeypatch):
    # keyed sampling with refills (a budget of 3 of the longest rows) in pages of 3, then rows
    # preempted when the pages run out (resumed from their prompt and tokens): eager flex on a
    # CPU, with the mask a CUDA run compiles
    monkeypatch.setitem(engine.ATTEND, "cpu", "flex")
    monkeypatch.setitem(engine.PAGE, "cpu", 3)
    m = tiny_qwen3(seed=0)
    keys = [seeds.key("mixed", i) for i in range(len(MIXED))]
    simple = rollout.generate_simple(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, top_p=0.9, seed=3, keys=keys)
    fast, stats = generate_with_flex(m, MIXED, MIXED_LIMITS, STOP, 3, temperature=0.7, top_p=0.9, seed=3, keys=keys)
    assert_same_generation(fast, simple)
    assert 3 <= stats["rows"] < len(MIXED)
    prompts = [[5 + i, 6 + i, 7][:2 + i % 2] for i in range(4)] + [PROMPTS[0]]
    limits = [10 - 2 * i for i in range(len(prompts))]
    keys = [seeds.key("preempt", i) for i in range(len(prompts))]
    simple = rollout.generate_simple(m, prompts, limits, [64], PAD, temperature=0.7, seed=5, keys=keys)
    fast, stats = generate_with_flex(m, prompts, limits, [64], 1, temperature=0.7, seed=5, keys=keys)
    assert_same_generation(fast, simple, atol=5e-5)     # a resumed row's prefill: another summation order
    assert stats["preempted"] > 0 and stats["rows"] > 1 and engine.FLEX["refused"] == ""


def test_flex_generation_of_rows_that_fit_one_page_each(monkeypatch):
    # CUDA's pages of 64 with rows shorter than a page: flex's tables are still 2 pages wide, and
    # _Writes.meta holds them (it once held 4 numbers a row's page, too few for 16 rows x 3)
    monkeypatch.setitem(engine.ATTEND, "cpu", "flex")
    monkeypatch.setitem(engine.PAGE, "cpu", 64)
    m = tiny_qwen3(seed=0)
    prompts, keys = [[5 + i % 7, 6, 7] for i in range(20)], [seeds.key("short", i) for i in range(20)]
    simple = rollout.generate_simple(m, prompts, 4, STOP, PAD, temperature=0.7, seed=2, keys=keys)
    fast = engine.generate(m, prompts, 4, STOP, PAD, temperature=0.7, seed=2, keys=keys, max_rows=5)
    assert_same_generation(fast, simple)


def test_flex_between_replayed_graph_pieces_samples_what_generate_simple_does(fake_cuda, monkeypatch):
    # as on CUDA: each layer's flex attention runs in a hole between captured pieces, reading the
    # tables the step before it copied out (a replay that read the capture's would sample wrong)
    import cudagraphs
    small_cuda_layout(monkeypatch)
    monkeypatch.setitem(engine.ATTEND, "cpu", "flex")
    fake_cuda()
    m = tiny_qwen3(seed=0)
    keys = [seeds.key("mixed", i) for i in range(len(MIXED))]
    simple = rollout.generate_simple(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3, keys=keys)
    fast, stats = generate_with_flex(m, MIXED, MIXED_LIMITS, STOP, None, temperature=0.7, seed=3, keys=keys)
    assert_same_generation(fast, simple)
    g = cudagraphs.GRAPHS
    assert g["eager_steps"] == 0 and g["replays"] > g["captures"] > 0 and engine.FLEX["refused"] == ""


def test_the_compiled_function_is_traced_whole_and_once_a_row_count_across_pools_and_steps(monkeypatch):
    """torch.compile as on CUDA (fullgraph, static but for the pools' pages and the tables'
    width) with dynamo's plain eager backend: the block mask is built inside the graph, and one
    row count compiles once however the pool (sized to each call) and the tables (wider as
    rows grow) change."""
    from torch._dynamo.testing import CompileCounter
    monkeypatch.setitem(engine.ATTEND, "cpu", "flex")
    monkeypatch.setitem(engine.FLEX_COMPILE, "cpu", True)
    counter, real = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counter, **kw))
    torch._dynamo.reset()
    m = tiny_qwen3(seed=0)
    for prompt, limit in ((MIXED[0], 30), (MIXED[-2], 9)):       # pools of 6 and 7 pages of 8, tables 2 to 6 wide
        simple = rollout.generate_simple(m, [prompt], [limit], STOP, PAD, temperature=0.7, seed=3)
        fast, stats = generate_with_flex(m, [prompt], [limit], STOP, None, temperature=0.7, seed=3)
        assert_same_generation(fast, simple)
    assert counter.frame_count == 1 and engine.FLEX["compiles"] == 1 and engine.FLEX["refused"] == ""
    torch._dynamo.reset()


def test_flex_missing_falls_back_to_pages_for_the_process_and_says_why(monkeypatch, capsys):
    monkeypatch.setitem(engine.ATTEND, "cpu", "flex")
    monkeypatch.setitem(engine.FLEX_COMPILE, "cpu", True)           # the CUDA path, on this CPU
    monkeypatch.setattr(engine, "flex_attention", None)
    monkeypatch.setattr(engine, "FLEX_MISSING", "cannot import name 'flex_attention'")
    used = []
    monkeypatch.setitem(engine.ATTENTION_FUNCTIONS, "pages",
                        lambda *a, _f=engine.paged_attention: used.append(1) or _f(*a))
    m = tiny_qwen3(seed=0)
    simple = rollout.generate_simple(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3)
    for _ in range(2):
        assert_same_generation(generate_with_flex(m, MIXED, MIXED_LIMITS, STOP, None, temperature=0.7, seed=3)[0],
                               simple)
    assert used and engine.FLEX["refused"] == "ImportError: cannot import name 'flex_attention'"
    assert engine.flex_status() == "pages (flex refused: ImportError: cannot import name 'flex_attention')"
    assert capsys.readouterr().err.count("no flex attention for the rest of this process (ImportError") == 1


def compile_flex_as(monkeypatch, run):
    """torch.compile of flex_decode made `run(flex_decode, q, *args)`: a stand-in for the compiled
    kernel that can fail at a row count. Eager FlexAttention compiles a function of its own: left
    alone."""
    real = torch.compile

    def compiled(fn, **kw):
        return real(fn, **kw) if fn is not engine.flex_decode else lambda *a: run(fn, *a)
    monkeypatch.setattr(torch, "compile", compiled)


def test_a_compile_that_fails_at_a_new_row_count_finishes_the_call_by_rows_then_pages(monkeypatch, capsys):
    """The probe's row count compiles, the next one fails inside a step: that step attends by
    row_attention over the flex tables, every later call with "pages", and the step line says so."""
    import runfolder
    monkeypatch.setitem(engine.ATTEND, "cpu", "flex")
    monkeypatch.setitem(engine.FLEX_COMPILE, "cpu", True)

    def run(fn, q, *a):
        if q.shape[0] > 1:
            raise RuntimeError("triton compile failed\nat line 2")
        return fn(q, *a)
    compile_flex_as(monkeypatch, run)
    m = tiny_qwen3(seed=0)
    keys = [seeds.key("mixed", i) for i in range(len(MIXED))]
    simple = rollout.generate_simple(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, top_p=0.9, seed=3, keys=keys)
    for _ in range(2):
        fast, _ = generate_with_flex(m, MIXED, MIXED_LIMITS, STOP, 2, temperature=0.7, top_p=0.9, seed=3, keys=keys)
        assert_same_generation(fast, simple)
    assert engine.FLEX["refused"] == "RuntimeError: triton compile failed" and engine.FLEX["compiles"] == 1
    assert capsys.readouterr().err.count("no flex attention for the rest of this process") == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        line = runfolder.step_line(1, 2, {"reward": 0.5, "roles": {}, "tokens_per_s": 10.0, "time": {"step": 1.0},
                                          "attend_status": engine.flex_status()}, None)
    assert line.endswith("| attend pages (flex refused: RuntimeError: triton compile failed)")


def test_the_warm_up_compiles_every_row_count_of_a_call_before_it(monkeypatch):
    """What a bench runs before timing flex: each of flex_rows' row counts up to the call's, once;
    a failure leaves the call to "pages"."""
    monkeypatch.setitem(engine.ATTEND, "cpu", "flex")
    monkeypatch.setitem(engine.FLEX_COMPILE, "cpu", True)
    seen = []

    def run(fn, q, *a):
        seen.append(q.shape[0])
        if q.shape[0] > 16:
            raise RuntimeError("out of resources")
        return fn(q, *a)
    compile_flex_as(monkeypatch, run)
    m = tiny_qwen3(seed=0)
    assert engine.flex_warm_up(m, 9) == "flex" and seen == [1, 4, 16] and engine.FLEX["compiles"] == 3
    assert engine.flex_warm_up(m, 40) == "pages" and seen == [1, 4, 16, 64]
    assert engine.FLEX["refused"] == "RuntimeError: out of resources"
