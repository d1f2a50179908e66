"""The engine: rollout.generate_simple's contract, fast, within a KV-cache budget.

    out = engine.generate(model, prompts, max_new_tokens, stop_ids, pad_id, temperature=0.7,
                          seed=0, keys=row_keys, kv_budget=2 * 2**30)   # a rollout.Generation

`generate_simple` (rollout.py) holds every row of a call for as many steps as the longest and
attends every row over the widest one. `generate` keeps what it samples and changes how:
- the cache in pages: each layer's K/V is one pool of fixed-size pages (PAGE tokens), sized to
  the call (at most `kv_budget` bytes, at most what every row needs at once), page 0 a trash page
  that only discarded writes touch. A row owns a list of pages (its block table, kept on the
  host): its prompt's pages when it is admitted, one more each time it crosses a page boundary,
  all returned the step the host learns it ended. So a row holds about its own length, not the
  call's longest prompt + max_new_tokens, and a finished row's memory is free at once.
- continuous batching: up to S row slots (one per prompt, capped by `max_rows`); a waiting
  prompt is admitted once a slot is free and the free pages hold its prompt and leave a page
  for each row in flight, so the rows in flight are bounded by the tokens they hold, not by
  their limits. When a step's rows need more pages than are free, kept prompts are let go, then
  the latest admitted row is preempted (`_preempt`): its pages are freed and it waits first in
  the queue with the tokens it has sampled; readmitted, it prefills its prompt and those tokens
  and goes on at its own positions with its own keys, so its samples do not change. Newcomers are admitted once
  REFILL_AT (1/16) of the rows in flight could be, together in one prefill (in chunks of alike
  lengths, so a short prompt is not padded to the longest: `_prefill_chunks`): a prefill of a few
  rows costs about a decode step (on a GPU both read every weight once), so refilling one row at
  a time would add a forward to most steps. Once nothing waits, the busy rows are packed into a
  smaller row bucket as soon as they fit (moving a row moves its counters and block table, never
  its K/V).
- prefix sharing: identical prompts (Voting's voters) are prefilled once; a copy shares the
  prompt's full pages (counted references, never written again: decode writes only past the
  prompt) and copies its last, partial page, and reuses its first logits. Each row still draws
  its own first token. A prompt's pages and logits are kept while copies of it wait.
- paged attention, plain PyTorch (`paged_attention`, ATTEND["cuda"]): a decode step attends
  page by page: the pages of every row in flight are gathered from the pools (an index_select
  for K and one for V a layer), each attended by its row's query (the query heads of a KV head
  folded, so no K/V is copied per head), and the pages of a row joined by their log-sum-exp (as
  flash-decoding joins its splits). Every row attends its own columns rounded up to a page;
  nothing is padded to another row. On a CPU (`row_attention`) each row's pages are gathered
  side by side, as wide as the step's widest row, for one SDPA call: fewer, larger ops. This
  replaces the dense cache rows (each sized for the call's longest row), the row groups cut by
  width with their HEADROOM columns to grow into, and the relayout that moved K/V between rows.
  Its price against a fused paged kernel: the gathered pages are written once and read again,
  about 3x the K/V bytes a step attends.
- flex attention (`flex_paged_attention`, ATTEND "flex", for a run or a bench to choose): the
  pools passed whole to FlexAttention, each row's pages named by a block mask
  (`flex_block_mask`), so the fused kernel torch.compile makes of it reads each attended byte
  once, a KV head once for all its query heads. On CUDA it is compiled once a process for each
  row count (`flex_rows`: powers of 4), the pool's size and the tables' width left dynamic, and
  launched between the graph's pieces as "pages" is. It is not the CUDA default until
  bench/gpu.sh has timed it on a GPU. A failure (no FlexAttention in the torch, a compile error)
  falls back to "pages" for the process, said in the step line (`flex_status`); on a CPU it runs
  eagerly (the same mask over the whole pool) for the tests.
- no host sync in a decode step: the device keeps its own counters and advances them after
  each sample; the host keeps a copy that decides the schedule (which pages each step attends,
  where each row writes: built on the host, copied in one transfer from pinned host memory,
  _Upload, which a pageable copy's staging could make wait for the device), and learns
  which rows hit a stop id from a copy made without blocking and read once every STOP_EVERY
  steps (a row that stopped runs on, its tokens discarded, for up to 2 x STOP_EVERY steps). On a
  CPU the device is the host, so a read waits for nothing: there it reads every step.
- graphs captured once per process: a decode step's inputs are buffers written in place, the
  rows run come in buckets (1, 2, 4, 8, multiples of 8), and the one part whose shapes change
  every step, each layer's paged attention, runs eagerly between captured pieces
  (cudagraphs.hole); so on CUDA a step of n rows is captured once for the process and the
  weights it reads (an adapter), with the buffers it reads (_Slots, kept across calls, up to
  KEEP_WEIGHTS sets of weights), and replayed (cudagraphs.py: the model's device current, a
  failed capture retried once, then graphs off for the process, said in the step line).
  Elsewhere the step runs eagerly. What is kept lives through the update: each set's graph
  memory pool, its (S, V) fp32 logits and its hole buffers (what each layer's attention reads
  and returns, one set for all row buckets: _Slots.stage).
- attention kernels: on CUDA the SDPA kernels are pinned for the prefill (policies.attention_kernels
  here, and policies.cuda_settings for the whole run): flash where no mask is passed, never
  cuDNN's, which PyTorch 2.9+ tries first on H100/H200 and which builds a plan for every new
  shape. A prefill on CUDA is right-padded and causal with no mask (half the P x P work, no K/V
  copy per head), each row's logits read at its own last position (_last_logits); on a CPU it is
  left-padded with a mask, and nothing is pinned.

Invariants, each a test in tests/test_sampler.py (the engine's spec) unless named:
1. the same samples as generate_simple: tokens, mask (stop token included) and finished flags
   equal, logprobs equal to float rounding, for greedy and keyed sampling, whatever the budget,
   the refills, the preemptions, the page size, the attention and the model, in fp32 (in bf16 on
   a GPU a row's logits round with its row bucket's kernels and a preempted row's re-prefill, so
   a draw at the boundary of two tokens can differ)
   (`test_sampling_equals_generate_simple_...`, `test_pages_of_any_size_sample_what_generate_simple_does`,
   `test_rows_preempted_...`, `test_generate_equals_generate_simple_greedy_...`,
   tests/test_flex.py's `test_flex_generation_...`);
2. at most `kv_budget` bytes of cache are held (`test_kv_memory_held_never_exceeds_the_budget`),
   and a call holds pages for about its rows' own tokens (`test_a_long_prompt_among_short_ones_...`);
3. no host read inside a decode step, the stop check read once every STOP_EVERY["cuda"] steps
   (`test_no_host_sync_inside_a_decode_step_...`), and no K/V copy per query head on any
   transformers version (`test_no_repeat_kv_in_a_decode_step_...`);
4. on CUDA, graphs replay what eager steps sample, each adapter's own, every CUDA call names the
   model's device and runs with it current, a failed capture is retried once, and a paper-like
   voter call attends within 1.1x its rows' own widths and, called twice, captures each row
   bucket once (tests/test_cudagraphs.py, with a stand-in for torch.cuda on a CPU);
5. "flex" attends what paged_attention and row_attention do, eagerly and as a fused kernel reads
   its block mask (only the pages listed); its compiled function is traced whole, once a row
   count across pool sizes and steps; and where it is missing or fails to compile, the call
   samples the same with "pages" and flex_status says why (tests/test_flex.py).

The KV budget's helpers (bytes per token, rows that fit, the default budget) sit here too,
with `memory_plan`, the line a run prints to say what its memory holds beside the cache.
Run `python bench/generate.py` for its speed against model.generate and generate_simple.
"""
import contextlib
import math
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

try:   # ATTEND "flex"; a torch without FlexAttention decodes with "pages" (FLEX["refused"] says why)
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    FLEX_MISSING = ""
except ImportError as e:
    BlockMask = flex_attention = None
    FLEX_MISSING = str(e)

import cudagraphs
import packed
import policies
import seeds
from rollout import Generation, cache_kwarg, check_limits, left_pad, new_cache, row_keys, sample_next

CPU_KV_BUDGET = 4 * 2**30  # bytes of KV cache a generate call may hold on CPU by default
KV_FRACTION = 0.85         # share of free CUDA memory (after loading) for the KV cache by default:
                           # the cache lives only inside a generate call and is handed back
                           # (torch.cuda.empty_cache) when it returns, so the update gets it all;
                           # the rest holds what lives beside the cache (AdamW states, logits)
PREFILL_TOKENS = 32768     # padded prompt tokens per prefill forward (bounds its activations)
# bytes a decode step's sampling holds at once per row and vocabulary entry on CUDA
# (rollout.sample_next, fp32 there: rollout.SAMPLE_DTYPE): the fp32 logits buffer and their
# log-softmax (4 + 4), the scaled logits and their softmax (4 + 4); top-p's sort adds 12 more
SAMPLE_BYTES = 16
REFILL_AT = 1 / 16         # admit newcomers once this share of the rows could be (see _refill)
# decode steps between the host's reads of which rows stopped: on CUDA a read waits for the
# device, so it reads a copy made 4 steps before; on a CPU it costs nothing, so every step
STOP_EVERY = {"cuda": 4, "cpu": 1}
ATTN_GROUPS = 32           # at most this many runs _cheapest partitions of prompts in a prefill
# Tokens a page holds. Smaller pages waste less (a row holds at most one page it does not fill,
# and attends its own columns rounded up to a page) and gather more pieces. CUDA: 64 (7 MiB at
# the 0.6B shape; a row of 1,000 columns attends 3% more than its own). CPU: 8, so a 20-token
# prompt with a few new tokens holds about what it has (tests/test_sampler.py measures it).
PAGE = {"cuda": 64, "cpu": 8}
# How a decode step attends the rows' pages. "pages": page by page, each row exactly its own
# columns (paged_attention); its many small products suit a GPU, where launches are in a graph and
# the K/V read is the cost. "rows": each row's pages gathered into one row as wide as the step's
# widest, then one SDPA call (row_attention): on a CPU, where each op's overhead counts, about
# half the time of "pages" at the small shape of bench/generate.py (it attends the padding).
# "flex": FlexAttention over the pools themselves (flex_paged_attention), each row's pages named
# by a block mask, so a fused kernel reads each attended K/V byte once; compiled where
# FLEX_COMPILE. CUDA keeps "pages" until bench/gpu.sh has timed "flex" on a GPU (a bench or a
# run sets ATTEND["cuda"] = "flex"; bench/generate.py --attend); if flex fails there it falls back
# to "pages" for the process, said in the step line (flex_status).
ATTEND = {"cuda": "pages", "cpu": "rows"}
# Whether ATTEND "flex" runs torch.compile's fused kernel (made once a process) or FlexAttention
# eagerly, which ignores the block mask's page lists and masks every column of the pools (a CPU's
# tests: the same function and mask, the whole pool attended).
FLEX_COMPILE = {"cuda": True, "cpu": False}
# generate calls' weights whose decode graphs (and the buffers they read) are kept: one a role's
# adapter under --sharing isolated; the oldest go first
KEEP_WEIGHTS = 8
# What one more prefill forward costs, as padded prompt tokens: prompts are prefilled longest
# first in the chunks that cost least (_prefill_chunks), so short prompts are not padded to the
# longest. CPU: chosen from bench/generate.py's equal work on the small shape, where 16, 64 and
# 256 did alike (1.19-1.21x model.generate against 1.12x for one chunk). CUDA: stated, not
# measured: a forward's launches (~2-5 ms at 28 layers) against ~2 us a 0.6B prompt token.
PREFILL_CALL = {"cpu": 64, "cuda": 2048}
# Prefill: on CUDA prompts are right-padded and run the causal kernel with no mask (flash: half
# of the P x P attention, and no K/V copy per head on transformers 5.17), each row's logits read
# at its own last position; on a CPU left-padded with an explicit mask, as the reference is
# (_prefill: the CPU's samples stay as they were).
PREFILL_CAUSAL = {"cuda": True, "cpu": False}


def _kind(device) -> str:
    return "cuda" if torch.device(device).type == "cuda" else "cpu"


# ----------------------------------------------------------------------------- KV budget

def _kv_heads_and_dim(config) -> tuple[int, int]:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads, head_dim


def kv_bytes_per_token(config, dtype) -> int:
    """Bytes of KV cache one token costs: K and V, every layer, every kv head."""
    heads, head_dim = _kv_heads_and_dim(config)
    return 2 * config.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def hole_bytes_per_row(config, dtype) -> int:
    """Bytes of the decode graphs' hole buffers (_Slots.stage) a row slot holds: each layer's q
    and attention output (Hq heads each), k and v (Hkv each)."""
    heads, head_dim = _kv_heads_and_dim(config)
    size = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * (config.num_attention_heads + heads) * head_dim * size


def rows_that_fit(kv_budget: int, bytes_per_token: int, length: int, page: int = 1) -> int:
    """Rows of `length` tokens (prompt + max_new_tokens, in whole pages of `page` tokens) that
    `kv_budget` bytes hold, the trash page aside: the rows in flight at once when every row runs
    to its limit (shorter rows, more of them)."""
    pages = int(kv_budget) // (bytes_per_token * page) - (page > 1)
    return max(0, pages) // int(-(-length // page))


def pages_for(tokens, page: int):
    """Pages that hold `tokens` (an int or an array)."""
    return -(-tokens // page)


def default_kv_budget(device, fraction: float = KV_FRACTION) -> int:
    """Bytes a generate call may hold: `fraction` of the free memory of a CUDA device (measure
    it after the model is loaded), CPU_KV_BUDGET elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return CPU_KV_BUDGET


def kv_budget_line(kv_budget: int, bytes_per_token: int, prompt_tokens: int, new_tokens: int,
                   page: int = PAGE["cuda"]) -> str:
    """The line a script prints once: what the budget holds in pages, and the rows in flight when
    every row runs to the length limits (rows hold only their own tokens: shorter ones, more)."""
    n = rows_that_fit(kv_budget, bytes_per_token, prompt_tokens + new_tokens, page)
    pages = int(kv_budget) // (bytes_per_token * page)
    return (f"KV budget {kv_budget / 2**30:.2f} GiB in {pages:,} pages of {page} tokens holds {n} rows of "
            f"{prompt_tokens}+{new_tokens} tokens")


def _row_count(prompts: int, need: int, bytes_per_token: int, kv_budget, max_rows) -> int:
    """Rows in flight the budget guarantees: one per prompt, capped by max_rows and by the rows of
    the call's longest need (prompt + max_new_tokens, `need` tokens) it holds; more run at once
    where rows are shorter. A budget below one row of the longest need is refused."""
    held = prompts if max_rows is None else max(1, min(prompts, max_rows))
    if kv_budget is not None:
        fit = rows_that_fit(kv_budget, bytes_per_token, need)
        if fit < 1:
            raise ValueError(f"kv_budget {int(kv_budget):,} B is smaller than one row's need: {need} tokens "
                             f"(prompt + max_new_tokens) x {bytes_per_token:,} B per token = "
                             f"{need * bytes_per_token:,} B")
        held = min(held, fit)
    return held


def beside_cache(free: int, share: str, kv_budget: int, trainable: int, rows: int, vocab: int, sets: int,
                 hole_bytes: int = 0) -> str:
    """The plan's CUDA part: the memory free after loading, the KV budget's share of it, and what
    must fit beside the cache while it lives: the AdamW states (16 B a trainable weight), what
    sampling holds (SAMPLE_BYTES a row and vocabulary entry) and what each of `sets` sets of
    weights' decode graphs keeps (_Slots): (rows, V) fp32 logits and `hole_bytes` a row of hole
    buffers (hole_bytes_per_row)."""
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    sampling, kept = rows * vocab * SAMPLE_BYTES, sets * rows * (vocab * 4 + hole_bytes)
    return (f" | free after loading {gib(free)}: KV {share}, beside it AdamW {gib(16 * trainable)} + "
            f"sampling {gib(sampling)} + kept decode logits and hole buffers {gib(kept)} = "
            f"{gib(kv_budget + 16 * trainable + sampling + kept)}")


def memory_plan(policy, kv_budget: int, args) -> str:
    """One line of memory: weights, trainable weights with AdamW states, the KV budget in pages and
    the rows it holds at the length limits, and the training micro-batch; a user sees at once
    whether the run fits (the micro-batch's activations as policies.activation_bytes counts them,
    or its layer inputs when checkpointed; its head as the update computes it). On CUDA it also gives the numbers behind the default budget: the free
    memory after loading, KV_FRACTION of it for the cache, and what the rest must hold
    while the cache lives (beside_cache: the AdamW states, made at the first update, what
    sampling holds, and the logits and hole buffers kept with each set of weights' decode graphs).
    The cache lives only inside a generate call, so the update has all the free memory. The
    prompt length is the limit, else the longest prompt expected: an aggregator's three clipped
    solutions plus ~512 tokens of instruction and problem (a solution is a completion, so it is
    never longer than max_new_tokens, whatever --max-embed-tokens allows)."""
    a, p = args, policy
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    weights = sum(t.numel() * t.element_size() for t in p.model.parameters())
    trainable = sum(t.numel() for n in p.names for t in p.parameters_of(n))
    cfg, size = p.model.config, next(p.model.parameters()).element_size()
    per_tok = kv_bytes_per_token(cfg, next(p.model.parameters()).dtype)
    prompt = a.max_prompt_tokens or 3 * min(a.max_embed_tokens or a.max_new_tokens, a.max_new_tokens) + 512
    if packed.used(p.model):   # the packed update's head: fp32 chunks of logits, never (tokens, V)
        head = f"head in chunks of {gib(packed.CHUNK_ELEMS * 4)}"
    else:                      # the plain update's: the logits and their gradient
        head = f"logits + grad {gib(a.token_budget * cfg.vocab_size * 2 * size)}"
    device, dtype = next(p.model.parameters()).device, next(p.model.parameters()).dtype
    acts = (a.token_budget * cfg.num_hidden_layers * cfg.hidden_size * size if p.checkpointing
            else policies.activation_bytes(cfg, a.token_budget, size, repeated_kv=not packed.gqa_kernel(device, dtype)))
    page = PAGE[_kind(device)]
    rows = rows_that_fit(kv_budget, per_tok, prompt + a.max_new_tokens, page)
    why = ""
    if device.type == "cuda":
        share = "--kv-budget-gb" if a.kv_budget_gb else f"{KV_FRACTION:g} of it"
        sets = min(KEEP_WEIGHTS, len(p.names)) if getattr(a, "cuda_graphs", "on") == "on" else 0
        why = beside_cache(torch.cuda.mem_get_info(device)[0], share, kv_budget, trainable, rows, cfg.vocab_size, sets,
                           hole_bytes_per_row(cfg, next(p.model.parameters()).dtype))
    return (f"memory: weights {gib(weights)} | trainable {trainable / 1e6:.1f}M x 16 B (fp32 + grad + AdamW) "
            f"{gib(16 * trainable)} | {kv_budget_line(kv_budget, per_tok, prompt, a.max_new_tokens, page)} "
            f"({per_tok / 1024:.0f} KiB a token){why} | micro-batch {a.token_budget} tokens: {head}, "
            f"{'layer inputs (checkpointed)' if p.checkpointing else 'activations'} {gib(acts)}")


# ----------------------------------------------------------------------------- paged attention

ATTENTION = "marl_pages"  # the name decode_attention has in transformers' AttentionInterface


BMM_OUT_DTYPE = {"cuda": None}   # whether torch.bmm takes out_dtype here (None: not tried yet)


def bmm32(a, b):
    """a @ b for (X, Y, m, k) and (X, Y, k, n) with fp32 results (X, Y, m, n): half-precision
    inputs multiplied with one rounding, the fp32 accumulator's, by torch.bmm's out_dtype on CUDA
    (torch 2.8 and later; else widened first), and widened on a CPU (a no-op for fp32). A
    product in bf16 would round every attention score to 8 bits before the softmax, which the
    trainer's attention does not."""
    X, Y = a.shape[:2]
    a3, b3 = a.reshape(X * Y, *a.shape[2:]), b.reshape(X * Y, *b.shape[2:])   # b3: a view where b is (X, Y) major
    out = None
    if a.is_cuda and a.dtype != torch.float32 and BMM_OUT_DTYPE["cuda"] is not False:
        try:
            out, BMM_OUT_DTYPE["cuda"] = torch.bmm(a3, b3, out_dtype=torch.float32), True
        except (RuntimeError, TypeError):
            BMM_OUT_DTYPE["cuda"] = False
    if out is None:
        out = torch.bmm(a3.float(), b3.float())
    return out.view(X, Y, *out.shape[1:])


def paged_attention(query, pool_k, pool_v, step, scaling: float):
    """One-token queries (n, Hq, 1, D) over their rows' pages: step.pages (C,) pages of the pools
    (Hkv, pages, PAGE, D), page c attended by row step.rows[c] over its first step.valid[c]
    columns (step.mask (C, 1, 1, PAGE)). Each page is attended on its own (its max and sum kept),
    then a row's pages are joined: out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c, M the
    row's largest m_c: the softmax over the row's columns, whatever their pages. The g = Hq / Hkv
    query heads of a KV head are folded into the query axis (query head h uses KV head h // g, as
    repeat_kv pairs them), so no K/V is copied per head, and the gathered pages are multiplied as
    they lie (KV head, page): no copy of them either. Scores and each page's output are fp32
    products (bmm32), as in the trainer's attention. A pad page (CUDA's page buckets) belongs to
    row n, dropped. Returns (n, 1, Hq, D)."""
    n, Hq, _, D = query.shape
    Hkv = pool_k.shape[0]
    g = Hq // Hkv
    q = query.reshape(n, Hkv, g, D)[step.rows_q].transpose(0, 1)     # (Hkv, C, g, D): each page's row
    k, v = pool_k.index_select(1, step.pages), pool_v.index_select(1, step.pages)   # (Hkv, C, PAGE, D) gathered
    s = bmm32(q, k.transpose(-1, -2)) * scaling                      # (Hkv, C, g, PAGE) fp32, as gathered: no copy
    s = s.masked_fill(~step.mask[:, 0], float("-inf"))               # every page has a valid column
    m = s.amax(-1)                                                   # (Hkv, C, g)
    p = torch.exp(s - m[..., None])                                  # (Hkv, C, g, PAGE)
    o = bmm32(p.to(v.dtype), v).transpose(0, 1)                      # (C, Hkv, g, D)
    m, l = m.transpose(0, 1), p.sum(-1).transpose(0, 1)              # (C, Hkv, g)
    rows = step.rows[:, None, None].expand_as(m)                     # (C, Hkv, g)
    M = m.new_full((n + 1, Hkv, g), float("-inf")).scatter_reduce(0, rows, m, "amax")   # (n+1, Hkv, g)
    w = torch.exp(m - M[step.rows])                                  # (C, Hkv, g) each page's weight
    den = m.new_zeros((n + 1, Hkv, g)).index_add_(0, step.rows, l * w)
    num = o.new_zeros((n + 1, Hkv, g, D)).index_add_(0, step.rows, o * w[..., None])
    # a row with no page (a free slot in the row bucket) has den 0: it gets 0, not NaN
    out = num[:n] / den[:n, ..., None].clamp(min=torch.finfo(den.dtype).tiny)   # (n, Hkv, g, D)
    return out.to(query.dtype).reshape(n, 1, Hq, D)


def row_attention(query, pool_k, pool_v, step, scaling: float):
    """One-token queries (n, Hq, 1, D) over their rows' pages gathered into rows: step.table
    (n, P) each row's pages (the trash page past its own), step.row_mask (n, 1, 1, P x PAGE) its
    own columns; one SDPA call with the query heads of a KV head folded into the query axis (no
    K/V copy per head). Returns (n, 1, Hq, D)."""
    n, Hq, _, D = query.shape
    Hkv, page = pool_k.shape[0], pool_k.shape[2]
    W = step.table.shape[1] * page

    def rows(pool):   # (n, Hkv, P x PAGE, D): a row's pages side by side, each head's (W, D) contiguous
        return pool.index_select(1, step.table.reshape(-1)).view(Hkv, n, W, D).transpose(0, 1)
    out = F.scaled_dot_product_attention(query.reshape(n, Hkv, Hq // Hkv, D), rows(pool_k), rows(pool_v),
                                         attn_mask=step.row_mask, scale=scaling)      # (n, Hkv, g, D)
    return out.reshape(n, 1, Hq, D)


# ----------------------------------------------------------------------------- flex attention

FLEX_Q_BLOCK = 128   # the block mask's query tile, which holds the one query: the decoding kernel
                     # needs a multiple of its 16-row tile (a tile of 1 leaves it no config)
# What ATTEND "flex" did in this process: its compiles (one a padded row count, each timed with
# its first run) and the first failure, which turned it off ("" if none)
FLEX = {"compiles": 0, "compile_s": 0.0, "refused": ""}
_FLEX_COMPILED = {"rows": set()}   # "fn": the compiled flex_decode; "rows": the row counts it has run


def flex_rows(n: int) -> int:
    """Rows a flex call runs for n: the next power of 4. The compiled kernel is specialised to its
    row count (the decoding kernel, which reads a KV head once for all its query heads, needs it
    static), so powers of 4 keep the compiles to 6 up to 1,024 rows; a padded row lists no page,
    and the kernel skips it."""
    N = 1
    while N < n:
        N *= 4
    return N


def flex_tables(table, width, pool_pages: int, page: int) -> tuple:
    """What a decode step's block mask reads, made once a step (_Writes.decode), not once a layer:
    row b attends the first width[b] columns of its pages table[b] (N, P) (the trash page past its
    own). Returns (table (N, P), count (N,) pages it attends, last (N,) its last page, valid (N,)
    the columns written there, own (N, pool_pages) the pages it holds)."""
    N, P = table.shape
    count = pages_for(width, page)                                      # (N,)
    k = (count - 1).clamp(min=0)                                        # (N,) the last page's index
    last = table.gather(1, k[:, None])[:, 0]                            # (N,)
    valid = width - k * page                                            # (N,)
    listed = torch.arange(P, device=table.device) < count[:, None]     # (N, P)
    own = torch.zeros(N, pool_pages, dtype=torch.bool, device=table.device).scatter_(1, table, listed)
    return table, count, last, valid, own


def flex_block_mask(tables: tuple, page: int):
    """The BlockMask of a decode step over the pools seen as one sequence of pool_pages x PAGE
    columns, from flex_tables. A fused kernel visits only the pages a row lists, each through
    mask_mod; FlexAttention run eagerly reads no list and applies mask_mod to every column of the
    pools, so mask_mod alone says the whole mask (a page the row holds; in its last page, the
    columns written) and eager and compiled attend the same columns. No page is listed as full
    (read with no mask): the decoding kernel then splits the pool, not a row's pages, among its
    KV splits, and a step of a few long rows would run on a few of the GPU's cores."""
    table, count, last, valid, own = tables

    def mask_mod(b, h, q, kv):
        p = kv // page
        return own[b, p] & ((p != last[b]) | (kv % page < valid[b]))
    return BlockMask.from_kv_blocks(count.to(torch.int32)[:, None, None], table.to(torch.int32)[:, None, None],
                                    BLOCK_SIZE=(FLEX_Q_BLOCK, page), mask_mod=mask_mod,
                                    seq_lengths=(1, own.shape[1] * page), compute_q_blocks=False)


def flex_decode(query, pool_k, pool_v, tables: tuple, scaling: float):
    """FlexAttention of one-token queries (N, Hq, 1, D) over the pools (Hkv, pages, PAGE, D) seen
    as one sequence (KV batch 1, broadcast to the N rows; enable_gqa pairs query head h with KV
    head h // g, as repeat_kv does, with no copy), each row over its own columns
    (flex_block_mask of the step's flex_tables). What torch.compile fuses: it takes only tensors.
    Returns (N, Hq, 1, D)."""
    Hkv, pages, page, D = pool_k.shape
    k, v = pool_k.view(1, Hkv, pages * page, D), pool_v.view(1, Hkv, pages * page, D)
    return flex_attention(query, k, v, block_mask=flex_block_mask(tables, page), scale=scaling, enable_gqa=True)


def flex_paged_attention(query, pool_k, pool_v, step, scaling: float):
    """One-token queries (n, Hq, 1, D) over their rows' pages by FlexAttention (flex_decode):
    step.table (N, P) each row's pages (the trash page past its own), step.width (N,) its
    columns and step.flex their flex_tables, N = flex_rows(n), the rows past n with none. Where
    FLEX_COMPILE, the compiled function; if it fails (a new row count's compile), flex is off for
    the process (_refuse_flex) and this step attends with row_attention over the same tables.
    Returns (n, 1, Hq, D)."""
    n, N = query.shape[0], step.width.shape[0]
    kind = _kind(query.device)
    if not FLEX["refused"]:
        q = F.pad(query, (0, 0, 0, 0, 0, 0, 0, N - n))                    # (N, Hq, 1, D)
        if not FLEX_COMPILE[kind]:
            return flex_decode(q, pool_k, pool_v, step.flex, scaling)[:n].transpose(1, 2)
        try:
            return _flex_compiled(q, pool_k, pool_v, step.flex, scaling)[:n].transpose(1, 2)
        except Exception as e:  # noqa: BLE001 - any failure: "pages" from the next call on
            _refuse_flex(e)
    W = step.table.shape[1] * pool_k.shape[2]
    own = torch.arange(W, device=query.device) < step.width[:n, None].clamp(min=1)   # (n, W) a free row: 1 column
    return row_attention(query, pool_k, pool_v, _RowTables(step.table[:n], own[:, None, None]), scaling)


@dataclass
class _RowTables:
    """What row_attention reads: (n, P) each row's pages, (n, 1, 1, P x PAGE) its columns."""
    table: torch.Tensor
    row_mask: torch.Tensor


def _flex_compiled(q, pool_k, pool_v, tables: tuple, scaling: float):
    """flex_decode compiled, made at its first call in the process: fullgraph (a graph break would
    run FlexAttention eagerly, over every column of the pools) and static but for the pools' page
    count and the tables' width, marked dynamic at each call (they change with every generate
    call and step), so each row count of flex_rows compiles once; dynamo's recompile limit is
    raised to hold them all. A new row count's first run is counted in FLEX with its time."""
    if "fn" not in _FLEX_COMPILED:
        if flex_attention is None:
            raise RuntimeError(f"no FlexAttention in torch {torch.__version__} ({FLEX_MISSING})")
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 32)
        _FLEX_COMPILED["fn"] = torch.compile(flex_decode, fullgraph=True, dynamic=False)
    for t in (pool_k, pool_v, tables[0], tables[-1]):   # the pools' pages; the tables' (N, P) and (N, pages)
        torch._dynamo.maybe_mark_dynamic(t, 1)
    if q.shape[0] in _FLEX_COMPILED["rows"]:
        return _FLEX_COMPILED["fn"](q, pool_k, pool_v, tables, scaling)
    t0 = time.perf_counter()
    out = _FLEX_COMPILED["fn"](q, pool_k, pool_v, tables, scaling)
    FLEX["compiles"] += 1
    FLEX["compile_s"] += time.perf_counter() - t0
    _FLEX_COMPILED["rows"].add(q.shape[0])
    return out


def _refuse_flex(e: BaseException) -> None:
    """Flex off for the process, its first cause kept in FLEX["refused"] and said once on stderr
    and, through flex_status, in train.py's step line and metrics.jsonl."""
    cause = cudagraphs.first_cause(e)
    FLEX["refused"] = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]}"
    print(f"engine: no flex attention for the rest of this process ({FLEX['refused']}); decoding with "
          "\"pages\"", file=sys.stderr)


def flex_status() -> str:
    """'' unless ATTEND "flex" failed in this process; then what a run's step line and
    metrics.jsonl say: decoding with "pages", and why."""
    return f"pages (flex refused: {FLEX['refused']})" if FLEX["refused"] else ""


def _attend_mode(model, dev) -> str:
    """How this call's decode steps attend: ATTEND[kind], but "pages" once flex has failed in the
    process. The first "flex" call where FLEX_COMPILE runs the compiled function once on a
    small input of the model's shapes (_flex_probe), outside any graph capture: its first
    compile, and a failure there (no FlexAttention in this torch, a compile error) is refused
    before any step."""
    kind = _kind(dev)
    if ATTEND[kind] != "flex":
        return ATTEND[kind]
    if not FLEX["refused"] and flex_attention is None:
        _refuse_flex(ImportError(FLEX_MISSING))
    if not FLEX["refused"] and FLEX_COMPILE[kind] and not _FLEX_COMPILED["rows"]:
        try:
            with cudagraphs.on_device(dev):
                _flex_probe(model, dev)
        except Exception as e:  # noqa: BLE001 - any failure: decode with "pages"
            _refuse_flex(e)
    return "pages" if FLEX["refused"] else "flex"


def _flex_probe(model, dev, rows: int = 1) -> None:
    """The compiled flex_decode on `rows` rows of one page each in a pool of 3 pages, with the
    model's heads, head size and dtype (tables 2 pages wide: a size-1 dimension would compile
    apart)."""
    Hq, (Hkv, D) = model.config.num_attention_heads, _kv_heads_and_dim(model.config)
    pool = lambda: torch.zeros(Hkv, 3, PAGE[_kind(dev)], D, dtype=model.dtype, device=dev)  # noqa: E731
    table = torch.tensor([[1, 0]], device=dev).expand(rows, 2).contiguous()     # (rows, 2)
    width = torch.ones(rows, dtype=torch.long, device=dev)                      # (rows,)
    _flex_compiled(torch.zeros(rows, Hq, 1, D, dtype=model.dtype, device=dev), pool(), pool(),
                   flex_tables(table, width, 3, PAGE[_kind(dev)]), D ** -0.5)


def flex_warm_up(model, rows: int) -> str:
    """Where ATTEND is "flex" and compiled (FLEX_COMPILE), compile it for every row count of
    flex_rows a call of up to `rows` rows runs, before that call (a bench's timing), so no compile
    falls inside it (FLEX counts them and their time). Returns the attention such a call uses:
    "pages" if flex failed."""
    dev = next(model.parameters()).device
    N = 1
    while _attend_mode(model, dev) == "flex" and FLEX_COMPILE[_kind(dev)] and N <= flex_rows(rows):
        if N not in _FLEX_COMPILED["rows"]:
            try:
                with cudagraphs.on_device(dev):
                    _flex_probe(model, dev, N)
            except Exception as e:  # noqa: BLE001 - any failure: decode with "pages"
                _refuse_flex(e)
        N *= 4
    return _attend_mode(model, dev)


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, paged=None,
                     **kwargs):
    """transformers' attention function while `generate` runs (registered as ATTENTION). A decode
    step (`paged`, the _Slots passed through the model's forward) writes the step's K/V into the
    pool of its call and attends the rows' pages (_Slots.attend); with graphs, in a
    cudagraphs.hole: the one part of a decode step whose shapes change every step, so it runs
    eagerly between the pieces of a captured step, reading and writing _Slots' hole buffers
    (`stage`). A prefill goes to transformers' SDPA function as it is. Returns
    ((n, 1, Hq, D), None), the attention functions' contract."""
    if paged is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    i = module.layer_idx
    if paged.graphs is None:
        return paged.attend(i, query, key, value, scaling), None
    # a hole keeps what it reads and returns for its graph's life: views of _Slots' buffers, so the
    # graphs of every row bucket share them (their own tensors would hold 12 KiB a row, layer and bucket at 0.6B)
    q, k, v, out = paged.stage(i, query, key, value)
    return cudagraphs.hole(lambda: out.copy_(paged.attend(i, q, k, v, scaling))), None


AttentionInterface.register(ATTENTION, decode_attention)
ATTENTION_FUNCTIONS = {"pages": paged_attention, "rows": row_attention, "flex": flex_paged_attention}   # by ATTEND


@contextlib.contextmanager
def _row_attention(model):
    """Every attention layer of `model` calls decode_attention for the duration: the layers look
    their function up by the config's name at each forward."""
    cfg = model.config
    before, cfg._attn_implementation = cfg._attn_implementation, ATTENTION
    try:
        yield
    finally:
        cfg._attn_implementation = before


def _prefill_mask(mask):
    """(U, 1, P, P) bool from a left-padded (U, P) mask: position i attends the prompt's own
    positions j <= i. A pad position has none; it attends every column instead, since a row
    with nothing to attend comes out NaN (its output is never used)."""
    P = mask.shape[1]
    m = torch.ones(P, P, dtype=torch.bool, device=mask.device).tril() & mask.bool()[:, None, :]  # (U, P, P)
    return (m | ~m.any(-1, keepdim=True))[:, None]


# ----------------------------------------------------------------------------- the page pool

class _Writes:
    """Where the forward in progress puts its K/V and what a decode step attends, read by every
    layer: a model's forward cannot hand its cache arguments, so generate sets this before each
    forward (`prefill`, `decode`) and the layers (and paged_attention) read it. A decode step's
    numbers come from `meta`, one device buffer the host fills before the step (one transfer):
    [page, offset] of each row's write, then the attended pages, their rows and their valid
    columns; `decode` makes the views every layer reads, eagerly, before the step runs."""

    def __init__(self, heads: int, page: int, pages: int, capacity: int, rows: int, device):
        self.heads, self.page, self.pool_pages = heads, page, pages
        # the larger of "pages"' 3 numbers a page (capacity pages) and "flex"'s P + 1 a row (N < 4 x rows,
        # P at least 2: capacity counts every row at 2 pages or more)
        self.meta = torch.zeros(2 * rows + 4 * (rows + capacity), dtype=torch.long, device=device)
        self.send = _Upload(self.meta, torch.device(device).type == "cuda")   # the step's numbers into meta
        self.head = torch.arange(heads, device=device)
        self.columns = torch.arange(page, device=device)
        self.is_prefill, self.mode = False, "pages"   # mode: how decode steps attend (_attend_mode)
        self.at = self.pages = self.rows = self.rows_q = self.mask = None
        self.table = self.row_mask = None   # "rows": (n, P) pages, (n, 1, 1, P x PAGE) columns; "flex": (N, P) pages
        self.width = self.flex = None       # "flex": (N,) columns each row attends; the step's flex_tables

    def slots(self, page, offset):
        """Flat indices (..., H) into a layer's (H * pages * PAGE, D) view: head, page, offset."""
        return (self.head * self.pool_pages + page[..., None]) * self.page + offset[..., None]

    def prefill(self, src, page, offset) -> None:
        """Newcomer k (a row of the prefill batch, src[k]) writes its P positions to `page`,
        `offset` (N, P) (pads to the trash page)."""
        self.is_prefill, self.src = True, src
        self.at = self.slots(page, offset)                              # (N, P, H)

    def decode(self, n: int, C: int) -> None:
        """Views of meta for a step of n rows attending C pages (for "flex": tables C pages wide,
        copied out of meta, so the compiled function sees tensors of their own), and what every
        layer shares."""
        m = self.meta
        self.is_prefill = False
        self.at = self.slots(m[:n], m[n:2 * n]).reshape(-1)            # (n * H,) each row's write, per head
        if self.mode == "flex":
            N = flex_rows(n)
            self.width, self.table = m[2 * n:2 * n + N].clone(), m[2 * n + N:2 * n + N + N * C].view(N, C).clone()
            self.flex = flex_tables(self.table, self.width, self.pool_pages, self.page)   # once a step, not a layer
            return
        self.pages, self.rows = m[2 * n:2 * n + C], m[2 * n + C:2 * n + 2 * C]      # (C,), (C,) rows in [0, n]
        self.rows_q = self.rows.clamp(max=n - 1)                        # a pad page (row n) reads any query
        self.mask = (self.columns < m[2 * n + 2 * C:2 * n + 3 * C, None])[:, None, None]   # (C, 1, 1, PAGE)


class _PagedLayer(DynamicLayer):
    """One layer's K and V pools, (H, pages, PAGE, D) each, written in place: head-major, so a
    row's gathered pages are, for each head, its columns in order and contiguous (what SDPA reads
    fastest; row_attention views them without a copy)."""

    def __init__(self, keys, values, writes: _Writes):
        super().__init__()
        self.keys, self.values, self.writes = keys, values, writes
        self.is_initialized = True

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0   # positions are always passed; nothing reads a length from the cache

    def update(self, key_states, value_states, *args, **kwargs):
        w, D = self.writes, key_states.shape[-1]
        if w.is_prefill:   # (U, H, P, D): newcomer k's positions to its pages; attention over the prompt itself
            for pool, new in ((self.keys, key_states), (self.values, value_states)):
                pool.view(-1, D).index_copy_(0, w.at.reshape(-1), new[w.src].transpose(1, 2).reshape(-1, D))
            return key_states, value_states
        return key_states, value_states   # a decode step's: written by decode_attention (_Slots.attend)

    def write(self, key_states, value_states) -> None:
        """(n, H, 1, D): each row's token at its own page and offset."""
        at, D = self.writes.at, key_states.shape[-1]
        self.keys.view(-1, D).index_copy_(0, at, key_states.reshape(-1, D))
        self.values.view(-1, D).index_copy_(0, at, value_states.reshape(-1, D))


def _page_cache(model, pages: int, page: int, writes: _Writes):
    """A cache of `pages` pages of `page` tokens per layer, zero-filled: a page's columns past its
    row's are masked, but a row's fresh page holds what its last owner wrote, and every column
    must hold a finite number (0 x NaN = NaN)."""
    cfg, dev = model.config, next(model.parameters()).device
    heads, head_dim = _kv_heads_and_dim(cfg)
    cache = new_cache(model)
    if any(type(layer) is not DynamicLayer for layer in getattr(cache, "layers", [])):
        raise NotImplementedError("generate supports full-attention models only (no sliding-window layers)")
    shape = (heads, pages, page, head_dim)
    cache.layers = [_PagedLayer(torch.zeros(shape, dtype=model.dtype, device=dev),
                                torch.zeros(shape, dtype=model.dtype, device=dev), writes)
                    for _ in range(cfg.num_hidden_layers)]
    return cache


def cache_bytes(cache) -> int:
    """Bytes of the tensors the cache's layers hold (measured from their storage)."""
    storages = {}
    for layer in cache.layers:
        for t in vars(layer).values():
            if torch.is_tensor(t):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _to(array, device):
    """A host array on the device. From pageable memory the copy may wait for the device (see
    _Upload): used for refills and for "rows"' per-step tables (a fallback), not "pages"' or
    "flex"' per-step numbers."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


class _Upload:
    """The copy into `dst` that every decode step makes (its numbers, writes.meta), made without
    the host waiting for the device. From pageable memory a "non_blocking" copy is staged by the
    driver, which may wait for the device's queue to drain, so the host would plan each step only
    once the last one had run. With `buffered` (CUDA), the array goes into one of two pinned host
    buffers in turn and is copied from there, an event recorded after the copy; a buffer is
    rewritten only after its last copy's event (two steps back: long done). Else one plain copy."""

    def __init__(self, dst, buffered: bool, pin: bool | None = None):
        pin = buffered if pin is None else pin   # a CPU test runs the buffered path unpinned
        self.dst, self.turn, self.copied = dst, 0, [None, None]
        self.bufs = [torch.empty(dst.shape, dtype=dst.dtype, pin_memory=pin) for _ in range(2)] if buffered else None

    def __call__(self, array) -> None:
        n = len(array)
        if self.bufs is None:
            self.dst[:n].copy_(torch.from_numpy(np.ascontiguousarray(array)))
            return
        k, self.turn = self.turn, 1 - self.turn
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        self.bufs[k].numpy()[:n] = array
        self.dst[:n].copy_(self.bufs[k][:n], non_blocking=True)
        self.copied[k] = cudagraphs.cuda.Event()
        self.copied[k].record()


class _Pages:
    """The host's books of the pool: free pages, each page's references (a row, or a prompt kept
    for later copies) and each slot's block table. Page 0 is the trash page: never given out,
    written by what is discarded (free slots, prompt pads)."""

    def __init__(self, total: int, page: int, slots: int, most: int):
        self.page = page
        self.free = list(range(total - 1, 0, -1))                 # pop() gives the lowest page first
        self.ref = np.zeros(total, dtype=np.int64)
        self.table = np.zeros((slots, most), dtype=np.int64)      # (S, pages of the longest row) block tables
        self.held = np.zeros(slots, dtype=np.int64)               # (S,) pages in each slot's table

    def take(self, slot: int, k: int) -> None:
        """k free pages at the end of the slot's table."""
        for _ in range(k):
            p = self.free.pop()
            self.ref[p] = 1
            self.table[slot, self.held[slot]] = p
            self.held[slot] += 1

    def share(self, slot: int, pages) -> None:
        """Pages another holder has (a prompt's full pages) at the start of the slot's table."""
        self.ref[pages] += 1
        self.table[slot, :len(pages)] = pages
        self.held[slot] = len(pages)

    def drop(self, pages) -> None:
        """One reference less to each page; a page nobody holds is free."""
        for p in pages:
            self.ref[p] -= 1
            if self.ref[p] == 0:
                self.free.append(int(p))

    def release(self, slot: int) -> None:
        self.drop(self.table[slot, :self.held[slot]])
        self.held[slot] = 0

    def short(self, slots, column) -> np.ndarray:
        """The slots whose table ends before `column` (their write this step): each needs a page."""
        return slots[self.held[slots] * self.page <= column]

    def permute(self, perm) -> None:
        self.table, self.held = self.table[perm], self.held[perm]


# ----------------------------------------------------------------------------- the rows in flight

@dataclass
class _HostRows:
    """The host's counters of the S row slots, (S,) int64 each: they decide the schedule (which
    slots are free, which pages each row attends and writes) without reading the device."""
    out: np.ndarray      # the output row (prompt index) the slot fills; Rows.discard when free
    made: np.ndarray     # tokens sampled so far
    pos: np.ndarray      # column (= position) of the last token written
    limit: np.ndarray    # the row's max_new_tokens
    busy: np.ndarray     # 1 while the host counts the row as running
    seq: np.ndarray      # when the row was admitted (a count of admissions): preemption takes the latest

    FIELDS = ("out", "made", "pos", "limit", "busy", "seq")


@dataclass
class _DeviceRows:
    """The device's counters of the same slots, which it advances itself after each sample; each
    a buffer written in place, since a CUDA graph reads and writes them."""
    out: torch.Tensor        # (S,) long, as the host's
    made: torch.Tensor       # (S,) long
    pos: torch.Tensor        # (S,) long
    limit: torch.Tensor      # (S,) long
    live: torch.Tensor       # (S,) bool: neither stopped nor at its limit
    tok: torch.Tensor        # (S,) long: the token the row feeds next
    logits: torch.Tensor     # (S, V) fp32: each row's next-token logits

    def buffers(self) -> list:
        return [self.out, self.made, self.pos, self.limit, self.live, self.tok, self.logits]


@dataclass
class _Rows:
    """The S row slots of a generate call, as the host and the device each count them, and the
    pages they hold. They agree, except that the host learns of a stop id up to 2 x STOP_EVERY
    steps late (_StopCheck) and counts the row as running until then (it only holds its pages a
    little longer). Rows in flight sit in the first slots."""
    host: _HostRows
    dev: _DeviceRows
    pages: _Pages
    discard: int          # the output row that rows which have ended write to (B, one past the last)
    n: int = 0            # rows a decode step runs: the first n, n a row bucket
    most: int = 0         # the most rows in flight at once

    @classmethod
    def empty(cls, S: int, discard: int, pages: _Pages, slots: "_Slots"):
        """S rows; the tokens fed, their positions and the logits are the first S of `slots`' (what a
        captured step reads and writes)."""
        device = slots.tok.device
        zeros = lambda: np.zeros(S, dtype=np.int64)   # noqa: E731
        host = _HostRows(np.full(S, discard), zeros(), zeros(), zeros(), zeros(), zeros())
        t = lambda: torch.zeros(S, dtype=torch.long, device=device)   # noqa: E731
        dev = _DeviceRows(torch.full((S,), discard, device=device), t(), slots.pos[:S].zero_(), t(),
                          torch.zeros(S, dtype=torch.bool, device=device), slots.tok[:S].zero_(), slots.logits[:S])
        return cls(host, dev, pages, discard)


@dataclass
class _Job:
    """One generate call: the prompts, their limits, the queue and the outputs being filled."""
    prompts: list
    limits: np.ndarray    # (B,) max_new_tokens per prompt
    distinct: list        # (B,) index of each prompt's distinct prompt (equal for identical prompts when shared)
    queue: deque          # prompt indices not yet admitted, identical prompts adjacent
    waiting: Counter      # distinct prompt -> copies still in the queue
    kept: dict            # distinct prompt -> (its prompt's pages, (V,) its first logits), while copies wait
    resumed: dict         # prompt index -> the tokens it had sampled when it was preempted
    keys: torch.Tensor    # (B+1,) int64 key of each prompt's draws; the discard row's is 0
    tokens: torch.Tensor  # (B+1, T+1) ids; row B and column T take the writes of rows that ended
    logps: torch.Tensor   # (B+1, T+1) fp32
    length: torch.Tensor  # (B+1,) long: tokens kept, the stop token included
    finished: torch.Tensor  # (B+1,) bool: emitted a stop id
    pad_id: int


def _new_job(prompts, limits, pad_id, share_prefix, keys, device) -> _Job:
    seen = {}
    same = [seen.setdefault(tuple(p), len(seen)) for p in prompts]  # (B,) index of each distinct prompt
    distinct = same if share_prefix else list(range(len(prompts)))
    B, T = len(prompts), int(limits.max())
    # identical prompts queue side by side (whether shared or not, so both run the same schedule)
    queue = deque(sorted(range(B), key=lambda i: (same[i], i)))
    return _Job(prompts=prompts, limits=limits, distinct=distinct, queue=queue, waiting=Counter(distinct), kept={},
                resumed={},
                keys=torch.cat([keys, keys.new_zeros(1)]),
                tokens=torch.full((B + 1, T + 1), pad_id, dtype=torch.long, device=device),
                logps=torch.zeros((B + 1, T + 1), dtype=torch.float32, device=device),
                length=torch.zeros(B + 1, dtype=torch.long, device=device),
                finished=torch.zeros(B + 1, dtype=torch.bool, device=device), pad_id=pad_id)


def _row_bucket(n: int, cap: int) -> int:
    """Rows a decode step runs when n are in use: 1, 2, 4, 8, then the next multiple of 8, at
    most cap (a CUDA graph is captured per bucket)."""
    n = max(n, 1)
    return min(1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8, cap)


# ----------------------------------------------------------------------------- the schedule

def _compact(st: _Rows, newcomers: int) -> np.ndarray:
    """Move the rows in flight to the first slots (their counters and block tables; the K/V stays
    in its pages) and return the `newcomers` slots that follow them; st.n becomes the bucket of
    them all."""
    h, S = st.host, len(st.host.busy)
    busy, free = np.flatnonzero(h.busy), np.flatnonzero(h.busy == 0)
    perm = np.concatenate([busy, free])
    if (perm != np.arange(S)).any():
        p = _to(perm, st.dev.out.device)
        for t in st.dev.buffers():
            t.copy_(t[p])                # in place: a CUDA graph holds these buffers
        for name in _HostRows.FIELDS:
            setattr(h, name, getattr(h, name)[perm])
        st.pages.permute(perm)
    st.n = _row_bucket(len(busy) + newcomers, S)
    return np.arange(len(busy), len(busy) + newcomers)


def _prompt(job: _Job, i: int) -> list:
    """Prompt i's ids as a prefill takes them: a preempted row's prompt and what it had sampled."""
    return job.prompts[i] + job.resumed[i] if i in job.resumed else job.prompts[i]


def _distinct(job: _Job, i: int):
    """Prompt i's distinct prompt; a preempted row's prompt and tokens are its own."""
    return ("resumed", i) if i in job.resumed else job.distinct[i]


def _admissible(st: _Rows, job: _Job) -> list:
    """The waiting prompts that can start now, in queue order: while a slot is free and the free
    pages hold the next one's prompt (a copy of a kept or co-admitted prompt shares its full
    pages) and leave one page for every row in flight and admitted that will need one more
    (a step takes at most one a row, so admitting does not at once preempt; a row whose pages
    already hold its prompt and limit takes none). Stops at the first that does not fit, so
    prompts start in queue order."""
    h, page, slots = st.host, st.pages.page, int((st.host.busy == 0).sum())
    spare, out, fresh, rows = len(st.pages.free), [], set(), int(h.busy.sum())
    busy = np.flatnonzero(h.busy)
    growing = int((st.pages.held[busy] < pages_for(h.pos[busy] + 1 + h.limit[busy] - h.made[busy], page)).sum())
    for i in job.queue:
        if len(out) == slots:
            break
        q, P = _distinct(job, i), len(_prompt(job, i))
        need = pages_for(P, page) - (P // page if q in job.kept or q in fresh else 0)
        grows = int(pages_for(P + int(job.limits[i]) - len(job.resumed.get(i, ())), page) > pages_for(P, page))
        reserve = growing + grows if rows + len(out) else 0       # a row alone fits the pool by its size
        if need + reserve > spare:
            break
        spare -= need
        growing += grows
        fresh.add(q)
        out.append(i)
    return out


def _refill(model, cache, writes, st: _Rows, job: _Job, counts) -> bool:
    """Give free slots to the next waiting prompts once REFILL_AT of the rows in flight could
    start (or every waiting prompt can): put their prompts' K/V in pages and their first logits
    in st.dev.logits, and set their counters on both sides (a resumed row goes on from the tokens
    it had sampled)."""
    h, d, pg = st.host, st.dev, st.pages
    ready = _admissible(st, job)
    busy = int(h.busy.sum())
    if not busy and not ready and job.queue:     # nothing runs and the next does not fit: let kept prompts go
        _let_go(job, pg, counts)
        ready = _admissible(st, job)
        if not ready:
            raise RuntimeError("engine: the next prompt fits no page pool (a bug: the pool holds the longest row)")
    if not ready or len(ready) < min(math.ceil(REFILL_AT * (busy + len(ready))), len(job.queue)):
        return False
    admitted = np.array([job.queue.popleft() for _ in ready])                 # prompt indices
    lens = np.array([len(_prompt(job, i)) for i in admitted])
    made = np.array([len(job.resumed.get(i, ())) for i in admitted])          # tokens already sampled
    dest = _compact(st, len(admitted))                                         # their slots
    logits = _first_logits(model, cache, writes, st, job, dest, admitted, counts)   # (N, V)
    rows, limits = _to(dest, d.out.device), job.limits[admitted]
    d.logits[rows] = logits
    for t, v in ((d.out, admitted), (d.made, made), (d.pos, lens - 1), (d.limit, limits)):
        t[rows] = _to(v, t.device)
    d.live[rows] = True
    # pos: the prompt's last column
    h.out[dest], h.made[dest], h.pos[dest], h.limit[dest], h.busy[dest] = admitted, made, lens - 1, limits, 1
    h.seq[dest] = counts["admitted"] + np.arange(len(admitted))
    counts["admitted"] += len(admitted)
    st.most = max(st.most, int(h.busy.sum()))
    return True


def _make_room(st: _Rows, job: _Job, counts) -> None:
    """Before a step: while the rows whose write needs a new page outnumber the free pages, let
    the kept prompts go (a prefill makes them again), then preempt the latest admitted row
    (_preempt); then give each its page. A row alone always fits (the pool holds the longest)."""
    h, pg = st.host, st.pages
    while True:
        busy = np.flatnonzero(h.busy[:st.n])
        short = pg.short(busy, h.pos[busy])
        if len(short) <= len(pg.free):
            break
        if job.kept:
            _let_go(job, pg, counts)
            continue
        assert len(busy) > 1, "engine: a row alone outgrew the pool (a bug: the pool holds the longest row)"
        _preempt(st, job, int(busy[np.argmax(h.seq[busy])]), counts)
    for slot in short:
        pg.take(int(slot), 1)


def _preempt(st: _Rows, job: _Job, slot: int, counts) -> None:
    """Free a running row's slot and pages, and put it first in the queue with the tokens it has
    sampled: readmitted, it prefills its prompt and them and goes on drawing with its own keys at
    its own positions, so its samples stay what they would have been (to float rounding of the
    logits). One read of the device (the row may have ended there unseen: then it just ends)."""
    h, d = st.host, st.dev
    i = int(h.out[slot])
    state = torch.cat([torch.stack([d.live[slot].long(), d.made[slot]]), job.tokens[i]]).cpu()   # (2 + T + 1,)
    live, made = bool(state[0]), int(state[1])
    if live:
        job.resumed[i] = state[2:2 + made].tolist()
        job.waiting[("resumed", i)] = 1
        job.queue.appendleft(i)
        counts["preempted"] += 1
    st.pages.release(slot)
    h.out[slot], h.busy[slot] = st.discard, 0
    d.live[slot], d.out[slot] = False, st.discard


def _schedule(model, cache, writes, st: _Rows, job: _Job, counts) -> None:
    """Before a step: admit waiting prompts (_refill); once none wait, pack the busy rows into
    a smaller row bucket as soon as they fit one."""
    if _refill(model, cache, writes, st, job, counts):
        return
    busy = int(st.host.busy.sum())
    if not job.queue and busy and _row_bucket(busy, len(st.host.busy)) < st.n:
        _compact(st, 0)


def _prefill(model, cache, writes, distinct: list, dst: list, src: list, pad_id: int, pages: _Pages):
    """Run the U `distinct` prompts through the model in the chunks of _prefill_chunks (longest
    first, each padded to its longest); the K/V of distinct[src[k]] goes into the pages of slot
    dst[k] (which hold its prompt; its pad positions to the trash page). Where PREFILL_CAUSAL
    (CUDA), a chunk is right-padded and runs the causal kernel with no mask, its logits read at
    each row's own last position (_last_logits); elsewhere it is left-padded with an explicit
    (U', 1, P, P) mask. Return the (U, V) fp32 logits of each prompt's first new token."""
    dev, page = writes.head.device, pages.page
    kind = _kind(dev)
    chunks = _prefill_chunks([len(p) for p in distinct], kind)
    dst, src = np.asarray(dst), np.asarray(src)
    logits = [None] * len(distinct)
    for chunk in chunks:
        rows = [distinct[u] for u in chunk]
        P, sel, where = max(map(len, rows)), np.flatnonzero(np.isin(src, chunk)), {u: i for i, u in enumerate(chunk)}
        lens = np.array([len(distinct[u]) for u in src[sel]])
        pad = np.zeros_like(lens) if PREFILL_CAUSAL[kind] else P - lens                # (N,) pads before the prompt
        cols = np.arange(P)[None, :] - pad[:, None]                                 # (N, P): position -> column
        real = (cols >= 0) & (cols < lens[:, None])
        c = np.where(real, cols, 0)
        at = np.where(real, pages.table[dst[sel][:, None], c // page], 0)           # (N, P) page, trash for pads
        writes.prefill(_to(np.array([where[u] for u in src[sel]]), dev), _to(at, dev), _to(c % page, dev))
        if PREFILL_CAUSAL[kind]:
            first = _last_logits(model, cache, rows, pad_id, dev)                   # (U', V)
        else:
            ids, mask = left_pad(rows, pad_id, dev)                                 # (U', P)
            first = model(input_ids=ids, attention_mask=_prefill_mask(mask), use_cache=True, logits_to_keep=1,
                          position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                          **{cache_kwarg(model): cache}).logits[:, -1].float()          # (U', V)
        for i, u in enumerate(chunk):
            logits[u] = first[i]
    return torch.stack(logits)


def _last_logits(model, cache, prompts: list, pad_id: int, dev):
    """(U, V) fp32 logits of each prompt's first new token from one right-padded forward with
    no mask: a prompt's tokens come first, so the causal kernel (flash) attends each of them
    over its own prompt only (the pads behind are never attended by a real token); the
    decoder's last hidden state at each row's own last position goes through the output
    embedding, so no (U, P, V) logits are made. That is a causal LM's forward for Qwen3 and
    Llama; a model that scales or caps its logits after the head would need it here too."""
    U, P = len(prompts), max(map(len, prompts))
    ids = torch.full((U, P), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    ids, last = ids.to(dev), torch.tensor([len(p) - 1 for p in prompts], device=dev)   # (U, P), (U,)
    decoder = model.get_decoder()
    hidden = decoder(input_ids=ids, position_ids=torch.arange(P, device=dev).expand(U, P), use_cache=True,
                     **{cache_kwarg(decoder): cache}).last_hidden_state                   # (U, P, hidden)
    return model.get_output_embeddings()(hidden[torch.arange(U, device=dev), last]).float()   # (U, V)


def _prefill_chunks(lens: list, kind: str) -> list:
    """The prompts (their lengths `lens`) in prefill chunks, lists of indices, longest first:
    cut where PREFILL_TOKENS padded tokens would be passed, then each part cut again where one
    more forward (PREFILL_CALL tokens) costs less than the padding it saves (_cheapest, over at
    most ATTN_GROUPS runs of prompts)."""
    parts = [[]]
    for u in sorted(range(len(lens)), key=lambda u: -lens[u]):
        if parts[-1] and (len(parts[-1]) + 1) * lens[parts[-1][0]] > PREFILL_TOKENS:
            parts.append([])
        parts[-1].append(u)
    chunks = []
    for part in parts:
        run = -(-len(part) // ATTN_GROUPS)
        starts = list(range(0, len(part), run))
        ends = [min(a + run, len(part)) for a in starts]
        cuts = _cheapest(starts, ends, [lens[part[a]] for a in starts], PREFILL_CALL[kind])
        chunks += [part[a:b] for a, b, _ in cuts]
    return chunks


def _cheapest(starts: list, ends: list, widths: list, call: float) -> tuple:
    """The partition of runs [starts[i], ends[i]) of widths[i] into consecutive groups that
    minimises sum over groups of (call + rows x the group's widest run), by dynamic programming
    over the k <= ATTN_GROUPS runs (k^2 / 2 steps). `call`: one more group, in row-columns."""
    k = len(starts)
    best, cut = [0.0] + [math.inf] * k, [0] * (k + 1)
    for j in range(1, k + 1):            # best[j]: the cheapest cut of the first j runs
        w = 0
        for i in range(j - 1, -1, -1):   # the last group holds runs i..j-1
            w = max(w, widths[i])
            group = call + (ends[j - 1] - starts[i]) * w
            if group >= best[j]:         # a longer last group only costs more: stop
                break
            if best[i] + group < best[j]:
                best[j], cut[j] = best[i] + group, i
    out, j = [], k
    while j:
        i = cut[j]
        out.append((starts[i], ends[j - 1], max(widths[i:j])))
        j = i
    return tuple(reversed(out))


def _first_logits(model, cache, writes, st: _Rows, job: _Job, dest, admitted, counts):
    """(N, V) logits of each newcomer's first token, its prompt's K/V in the first pages of its
    slot dest[k]: the first newcomer of a prompt that is not kept is prefilled (each distinct
    prompt once) into pages of its own; every other one shares the full pages of the prompt's
    holder (kept, or prefilled in this batch) and copies its partial last page."""
    pg, want = st.pages, [_distinct(job, i) for i in admitted]
    lens = [len(_prompt(job, i)) for i in admitted]
    out, holder = [None] * len(admitted), {}          # distinct prompt -> (its pages, its logits)
    for q, (held, first) in job.kept.items():
        holder[q] = (held, first)
    fresh = {}
    for k, q in enumerate(want):
        if q not in holder and q not in fresh:
            fresh[q] = k
    if fresh:
        ks = list(fresh.values())
        for k in ks:
            pg.take(dest[k], pages_for(lens[k], pg.page))
        first = _prefill(model, cache, writes, [_prompt(job, admitted[k]) for k in ks], [dest[k] for k in ks],
                         list(range(len(ks))), job.pad_id, pg)                     # (U, V)
        counts["prefill_rows"] += len(ks)
        for i, (q, k) in enumerate(fresh.items()):
            out[k] = first[i]
            holder[q] = (pg.table[dest[k], :pages_for(lens[k], pg.page)].copy(), first[i])
    copies = [k for k in range(len(admitted)) if out[k] is None]
    src, new = [], []
    for k in copies:
        held, out[k] = holder[want[k]]
        full = lens[k] // pg.page
        pg.share(dest[k], held[:full])
        if lens[k] % pg.page:            # the partial last page: the copy writes its own tokens there
            pg.take(dest[k], 1)
            src.append(held[full])
            new.append(pg.table[dest[k], full])
    if src:
        s, d = _to(np.array(src), writes.head.device), _to(np.array(new), writes.head.device)
        for layer in cache.layers:
            layer.keys[:, d] = layer.keys[:, s]                             # (H, N', PAGE, D)
            layer.values[:, d] = layer.values[:, s]
    _keep(job, pg, want, holder)
    return torch.stack(out)                                                  # (N, V)


def _keep(job: _Job, pg: _Pages, want: list, holder: dict) -> None:
    """Keep a prompt's pages (a reference each) and first logits while copies of it still wait;
    let them go once none does."""
    for q, c in Counter(want).items():
        job.waiting[q] -= c
        if job.waiting[q] == 0:
            if q in job.kept:
                pg.drop(job.kept.pop(q)[0])
        elif q not in job.kept:
            held, first = holder[q]
            pg.ref[held] += 1
            job.kept[q] = (held, first.clone())


def _let_go(job: _Job, pg: _Pages, counts) -> None:
    """Drop every kept prompt (its next copy will be prefilled again, counted in let_go)."""
    for held, _ in job.kept.values():
        pg.drop(held)
    counts["let_go"] += len(job.kept)
    job.kept.clear()


# ----------------------------------------------------------------------------- the decode step

def _sample(st: _Rows, job: _Job, seed: int, temperature: float, top_p: float, stops) -> None:
    """Sample the next token of the step's n rows from their logits and move the live rows on,
    all on the device: record the token and its logprob, count it, and end the row at a stop id
    (the stop token kept: the policy chose it) or at its limit. Rows that have ended write to
    the discard output row and stay where they are. No host sync."""
    n, d = st.n, st.dev
    out, made, pos, limit, live = d.out[:n], d.made[:n], d.pos[:n], d.limit[:n], d.live[:n]
    u = seeds.uniforms(seed, job.keys[out], made) if temperature > 0 else None     # (n,) float64
    tok, lp = sample_next(d.logits[:n], temperature, top_p, u)                     # (n,)
    out_row = torch.where(live, out, st.discard)                                    # (n,)
    job.tokens[out_row, made], job.logps[out_row, made] = tok, lp
    hit = live & torch.isin(tok, stops)
    made += live                                 # in place: the counters are buffers a CUDA graph reads
    pos += live
    job.length[out_row], job.finished[out_row] = made, hit
    live &= ~hit & (made < limit)
    d.tok[:n] = tok


class _StopCheck:
    """What the host learns of stop ids, once every STOP_EVERY[device] steps. Every step there
    (a CPU's 1): the device's ended rows as they are now. Less often (CUDA's 4): the copy of
    them made STOP_EVERY steps before, then it starts the next copy without blocking (into
    pinned memory on CUDA); the copy it reads is long done, so the decode steps in between never
    wait for the host."""

    def __init__(self, S: int, device):
        self.cuda = device.type == "cuda"
        self.every = STOP_EVERY["cuda" if self.cuda else "cpu"]
        self.host = torch.empty(S, dtype=torch.long, pin_memory=self.cuda)   # (S,) output rows that ended, -1 live
        self.event, self.pending, self.steps = None, False, 0

    def __call__(self, st: _Rows):
        """The output rows that had ended (stop id or limit) at the last copy, or None."""
        self.steps += 1
        if self.steps % self.every:
            return None
        now = torch.where(st.dev.live, -1, st.dev.out)
        if self.every == 1:
            return now.cpu().numpy()
        ended = None
        if self.pending:
            if self.event is not None:
                self.event.synchronize()
            ended = self.host.numpy().copy()       # copied: the buffer is written again below
        self.host.copy_(now, non_blocking=True)
        if self.cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        self.pending = True
        return ended


def _retire(st: _Rows, ended) -> None:
    """The host's side of a step: count a token for every busy row (as the device did for the
    live ones), then free the rows that reached their limit (the host's own count) or that the
    stop check says ended (`ended`, output rows): their pages go back to the pool now."""
    h = st.host
    h.made += h.busy
    h.pos += h.busy
    done = (h.busy == 1) & (h.made >= h.limit)
    if ended is not None:
        done |= (h.busy == 1) & np.isin(h.out, ended)
    for slot in np.flatnonzero(done):
        st.pages.release(int(slot))
    h.out[done], h.busy[done] = st.discard, 0


class _Slots:
    """What the decode steps of one model's weights on one device read and write at fixed
    addresses, kept across generate calls with their CUDA graphs (`graphs`, one a row bucket):
    the token each row feeds, its position, its next-token logits (S, V) fp32 and the 4-D mask
    passed (all True: paged_attention masks by pages). `cache` and `writes` are the call's now,
    which the eager attention between the graphs' pieces looks up (`attend`)."""

    def __init__(self, S: int, config, dtype, device, graphs: bool):
        self.tok = torch.zeros(S, dtype=torch.long, device=device)
        self.pos = torch.zeros(S, dtype=torch.long, device=device)
        self.logits = torch.zeros((S, config.vocab_size), dtype=torch.float32, device=device)
        self.ones = torch.ones((S, 1, 1, 1), dtype=torch.bool, device=device)
        self.graphs = cudagraphs.StepGraphs(device) if graphs else None
        self.cache = self.writes = None
        # with graphs, each layer's hole buffers: the step's q (S, Hq, 1, D), k and v (S, Hkv, 1, D)
        # and the attention's output (S, 1, Hq, D) (hole_bytes a row)
        Hkv, D = _kv_heads_and_dim(config)
        Hq = config.num_attention_heads
        shapes = ((Hq, 1, D), (Hkv, 1, D), (Hkv, 1, D), (1, Hq, D))
        self.holes = [[torch.zeros((S, *sh), dtype=dtype, device=device) for sh in shapes]
                      for _ in range(config.num_hidden_layers)] if graphs else None

    def stage(self, i: int, query, key, value) -> list:
        """Layer i's hole buffers for the step's n rows, the step's q, k and v copied in (inside a
        captured piece: every replay copies them): [q, k, v, out]."""
        n = query.shape[0]
        bufs = [b[:n] for b in self.holes[i]]
        for b, t in zip(bufs, (query, key, value)):
            b.copy_(t)
        return bufs

    def attend(self, i: int, query, key_states, value_states, scaling: float):
        """Layer i of a decode step: its new K/V into the call's pool, then the rows' pages."""
        layer = self.cache.layers[i]
        layer.write(key_states, value_states)
        return ATTENTION_FUNCTIONS[self.writes.mode](query, layer.keys, layer.values, self.writes, scaling)


_KEPT = {}   # (device, weights) -> _Slots of graphed calls, at most KEEP_WEIGHTS, oldest first


def _weights_key(model) -> tuple:
    """What decides the weights a decode forward reads, so a graph replays only the weights it was
    captured with: the storage of every parameter, and the adapter active in any policies.LoRA
    hooked onto the model (its hooks read the adapter named then)."""
    active = {id(c.cell_contents): c.cell_contents.active for m in model.modules()
              for h in m._forward_hooks.values() for c in (getattr(h, "__closure__", None) or ())
              if isinstance(c.cell_contents, policies.LoRA)}
    return tuple(p.data_ptr() for p in model.parameters()), tuple(sorted(active.items()))


def _slots(model, S: int, dev, graphs: bool) -> _Slots:
    """The call's _Slots: with graphs, the kept ones of these weights when they hold S rows (else
    new ones, kept, the oldest let go past KEEP_WEIGHTS); without, new ones."""
    if not graphs:
        return _Slots(S, model.config, model.dtype, dev, False)
    key = (str(dev), _weights_key(model))
    slots = _KEPT.pop(key, None)
    if slots is None or len(slots.tok) < S or slots.logits.shape[1] != model.config.vocab_size:
        slots = _Slots(S, model.config, model.dtype, dev, True)
    _KEPT[key] = slots
    while len(_KEPT) > KEEP_WEIGHTS:
        _KEPT.pop(next(iter(_KEPT)))
    return slots


class _Decoder:
    """The forward of a decode step over the first n slots: every row feeds st.dev.tok at its
    position st.dev.pos, writes its K/V at that column's page and offset, and attends its own
    pages (paged_attention); the next-token logits land in st.dev.logits. What the step attends
    and writes is built on the host from its books (`plan`) and copied into writes.meta before the
    step; nothing in the step reads the device, so on CUDA (slots.graphs) a step of n rows is
    captured once for the process, in pieces around each layer's attention (cudagraphs.hole),
    and replayed. Counts the columns it attends (pages x PAGE) and the rows' own (their widths),
    the measure of what paging saves."""

    def __init__(self, model, cache, writes: _Writes, st: _Rows, slots: _Slots, job: _Job, counts):
        self.model, self.cache, self.writes, self.st, self.slots = model, cache, writes, st, slots
        self.job, self.counts = job, counts
        slots.cache, slots.writes = cache, writes
        self.cache_kw = cache_kwarg(model)
        self.mode = writes.mode = _attend_mode(model, st.dev.out.device)   # "pages", "rows" or "flex"
        self.eager_steps = self.attended = self.own = 0

    def plan(self) -> int:
        """Give every busy row a page for its write (preempting rows if the pool has too few,
        _make_room), fill writes.meta with the step's numbers (one copy to the device): where each
        row writes, then what it attends as the step's attention reads it; return what
        writes.decode needs: the pages attended (C), or for "flex" the tables' width."""
        st, pg = self.st, self.st.pages
        _make_room(st, self.job, self.counts)
        n, h, page = st.n, st.host, pg.page
        width = (h.pos[:n] + 1) * h.busy[:n]                         # (n,) columns each row attends, 0 if free
        count = pages_for(width, page)                               # (n,)
        write = np.where(h.busy[:n] == 1, pg.table[np.arange(n), h.pos[:n] // page], 0)   # (n,) free slots: trash
        offset = np.where(h.busy[:n] == 1, h.pos[:n] % page, 0)
        attended, C = self._flex_tables(width, count) if self.mode == "flex" else self._pages(width, count)
        meta = np.concatenate([write, offset, *attended])
        self.writes.send(meta)
        self.own += int(width.sum())
        self.attended += self._row_tables(width, count) if self.mode == "rows" else int(count.sum()) * page
        return C

    def _pages(self, width, count):
        """Every page attended, its row (its index in the row) and its valid columns; and C, how many."""
        pg = self.st.pages
        rows = np.repeat(np.arange(len(width)), count)                        # (C,) each page's row
        k = np.arange(len(rows)) - np.repeat(np.cumsum(count) - count, count)   # (C,) its index in the row
        return [pg.table[rows, k], rows, np.minimum(pg.page, width[rows] - k * pg.page)], len(rows)

    def _row_tables(self, width, count) -> int:
        """"rows": the pages of each row side by side, as many as the widest row's, and its own
        columns, each in one copy to the device; returns the columns attended."""
        n, page, dev = len(width), self.st.pages.page, self.writes.meta.device
        P = int(count.max())
        table = np.where(np.arange(P) < count[:, None], self.st.pages.table[:n, :P], 0)     # (n, P)
        own = np.arange(P * page) < np.maximum(width, 1)[:, None]    # a free slot: one trash column, not NaN
        self.writes.table, self.writes.row_mask = _to(table, dev), _to(own, dev)[:, None, None]
        return n * P * page

    def _flex_tables(self, width, count):
        """"flex": the columns of each row and its pages (the trash page past its own), for
        flex_rows(n) rows (the padding attends nothing); and P, the tables' width, at least 2 (a
        dimension of size 1 would compile apart)."""
        n, pg = len(width), self.st.pages
        N, P = flex_rows(n), max(int(count.max()), 2)
        cols = min(P, pg.table.shape[1])
        table = np.zeros((N, P), dtype=np.int64)                                            # (N, P)
        table[:n, :cols] = np.where(np.arange(cols) < count[:, None], pg.table[:n, :cols], 0)
        return [np.pad(width, (0, N - n)), table.ravel()], P

    def forward(self, n: int) -> None:
        s = self.slots
        out = self.model(input_ids=s.tok[:n, None], attention_mask=s.ones[:n], position_ids=s.pos[:n, None],
                         use_cache=True, paged=s, **{self.cache_kw: self.cache})
        s.logits[:n] = out.logits[:, -1]                             # (n, V) fp32

    def __call__(self, n: int, C: int) -> None:
        self.writes.decode(n, C)       # eagerly: the views this step's attention reads
        if self.slots.graphs is None:
            self.eager_steps += 1
            return self.forward(n)
        self.slots.graphs.run(n, lambda: self.forward(n))

    def count(self, counts) -> None:
        """Add this call to cudagraphs.GRAPHS (its eager steps; the graphs count their own), and the
        columns attended to `counts`."""
        counts["attended_columns"] += self.attended
        counts["own_columns"] += self.own
        cudagraphs.GRAPHS["calls"] += 1
        cudagraphs.GRAPHS["eager_steps"] += self.eager_steps


def _pool_pages(prompts: list, limits, page: int, page_bytes: int, kv_budget) -> int:
    """Pages the call's pool holds, the trash page included: what every row needs at once (its
    prompt + its limit, in pages), at most what `kv_budget` bytes hold, and at least the longest
    row's (kept prompts are let go when nothing else fits: _refill)."""
    need = pages_for(np.array([len(p) for p in prompts]) + limits, page)   # (B,)
    pages = int(need.sum()) + 1
    if kv_budget is not None:
        pages = min(pages, int(kv_budget) // page_bytes)
        if pages < int(need.max()) + 1:
            raise ValueError(f"kv_budget {int(kv_budget):,} B holds {int(kv_budget) // page_bytes} pages of {page} "
                             f"tokens ({page_bytes:,} B each): the longest row needs {int(need.max())}, plus the trash "
                             "page")
    return pages


@torch.no_grad()  # not inference_mode: its tensors could not be reused by autograd later
def generate(model, prompts: list, max_new_tokens, stop_ids, pad_id: int,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, keys=None, share_prefix: bool = True,
             kv_budget: int | None = None, max_rows: int | None = None, stats: dict | None = None,
             cuda_graphs: bool = True, host: bool = False) -> Generation:
    """Sample a completion for every prompt (a list of token-id lists), as generate_simple does.
    `max_new_tokens`: one limit, or one per prompt. Row i's token t is drawn with
    seeds.uniforms(seed, keys[i], t), so what a row samples does not depend on the slot or pages
    it gets or on which rows share the call (exactly in fp32; in bf16 to rounding: invariant 1).
    At most `kv_budget` bytes of KV cache (None: every row at once) and `max_rows` rows in
    flight. `cuda_graphs`: replay decode steps from CUDA graphs on a CUDA device. `stats`, a
    dict, gets prefill_rows (prompts prefilled), decode_steps, attended_columns / own_columns
    (pages x PAGE each step attends, and its rows' own widths), preempted and let_go (kept
    prompts dropped for pages) added, and kv_bytes (cache held) and rows (the most in flight)
    raised to this call's. `host`: the Generation's tensors copied to the host once each."""
    limits = check_limits(prompts, max_new_tokens)
    dev = next(model.parameters()).device
    page, bpt = PAGE[_kind(dev)], kv_bytes_per_token(model.config, model.dtype)
    need = max(len(p) + int(t) for p, t in zip(prompts, limits))  # tokens of the longest row
    S = _row_count(len(prompts), need, bpt, None, max_rows)
    _row_count(len(prompts), need, bpt, kv_budget, max_rows)       # a budget below the longest row: refused
    total = _pool_pages(prompts, limits, page, page * bpt, kv_budget)
    most = int(pages_for(need, page))
    writes = _Writes(_kv_heads_and_dim(model.config)[0], page, total, S * max(most, 2), S, dev)   # flex's P >= 2
    cache = _page_cache(model, total, page, writes)
    job = _new_job(prompts, limits, pad_id, share_prefix, row_keys(keys, len(prompts), dev), dev)
    slots = _slots(model, S, dev, cuda_graphs and cudagraphs.usable(dev))
    st = _Rows.empty(S, discard=len(prompts), pages=_Pages(total, page, S, most), slots=slots)
    counts = Counter(prefill_rows=0, decode_steps=0, attended_columns=0, own_columns=0, preempted=0, let_go=0,
                     admitted=0)
    decode = _Decoder(model, cache, writes, st, slots, job, counts)
    check = _StopCheck(S, dev)
    stops = torch.tensor(sorted(set(stop_ids)), device=dev)
    # the model's device current (a graph or stream on another one records nothing), and the
    # attention kernel pinned (policies.attention_kernels)
    with cudagraphs.on_device(dev), _row_attention(model), policies.attention_kernels(dev):
        while True:
            _schedule(model, cache, writes, st, job, counts)
            if not st.host.busy.any():
                break
            _sample(st, job, seed, temperature, top_p, stops)
            _retire(st, check(st))
            if st.host.busy.any():
                C = decode.plan()
                if st.host.busy.any():       # a preempted row may have been the last
                    decode(st.n, C)
                    counts["decode_steps"] += 1
    decode.count(counts)
    del counts["admitted"]
    if stats is not None:
        stats.update({k: stats.get(k, 0) + v for k, v in counts.items()})
        stats["kv_bytes"] = max(stats.get("kv_bytes", 0), cache_bytes(cache))
        stats["rows"] = max(stats.get("rows", 0), st.most)
    out = _output(job)
    if host:
        out = Generation(out.tokens.cpu(), out.logprobs.cpu(), out.mask.cpu(), out.finished.cpu())
    slots.cache = slots.writes = None
    if dev.type == "cuda":  # the cache goes back before the update runs (kept graphs keep their pool)
        del cache, decode, st, writes
        torch.cuda.empty_cache()
    return out


def _output(job: _Job) -> Generation:
    B = len(job.prompts)
    T = int(job.length[:B].max())            # the one read of the device after the loop
    mask = torch.arange(T, device=job.length.device) < job.length[:B, None]   # (B, T), the stop token included
    return Generation(job.tokens[:B, :T], job.logps[:B, :T], mask, job.finished[:B].clone())
