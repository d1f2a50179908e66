"""The engine: rollout.generate_simple's contract, fast, within a KV-cache budget.

    out = engine.generate(model, prompts, max_new_tokens, stop_ids, pad_id, temperature=0.7,
                          seed=0, keys=row_keys, kv_budget=2 * 2**30)   # a rollout.Generation

`generate_simple` (rollout.py) holds every row of a call for as many steps as the longest and
attends every row over the widest one. `generate` keeps what it samples and changes how:
- continuous batching: S cache rows, as many as `kv_budget` bytes hold at the call's longest
  row (prompt + max_new_tokens columns), capped by `max_rows`; a row that stops gives its cache
  row to the next waiting prompt. Newcomers are admitted once REFILL_AT (1/16) of the rows are
  free, together in one prefill through the same cache (in chunks of alike lengths, so a short
  prompt is not padded to the longest: `_prefill_chunks`): a prefill of a few rows costs about a
  decode step (on a GPU both read every weight once), so refilling one row at a time would add
  a forward to most steps, while waiting for 1/16 keeps the batch at least 15/16 full. Once
  nothing waits, the busy rows are packed into a smaller row bucket as soon as they fit.
- dense cache rows, not pages: SDPA wants each row's K/V as one tensor, and gathering pages into
  one every step would copy the attended cache per token. The price: a row is sized for the
  worst case. A prompt is written from column 0 of its row, so a token's column is its
  position, and a decode step writes each row's new K/V at its own column (one index_copy_ a
  layer).
- prefix sharing: identical prompts (Voting's voters) are prefilled once; a copy admitted
  later copies the K/V from a cache row that still holds the prompt and reuses its first
  logits. Each row still draws its own first token.
- width-aware attention: rows in flight sit widest first and are cut into row groups; a group
  attends its widest row's columns only (`_groups`: one rule on every device, the groups that
  cost least when a call costs ATTN_CALL and a padded column what it attends). `decode_attention`
  folds each KV head's query heads into the query axis, so no K/V is copied per head.
- no host sync in a decode step: the device keeps its own counters and advances them after
  each sample; the host keeps a copy that decides the schedule, and learns which rows hit a
  stop id from a copy made without blocking and read once every STOP_EVERY steps (a row that
  stopped runs on, its tokens discarded, for up to 2 x STOP_EVERY steps). On a CPU the device
  is the host, so a read waits for nothing: there it reads every step, and no row runs on.
- static shapes: a decode step's inputs are buffers written in place, the rows run come in
  buckets (1, 2, 4, 8, multiples of 8) and widths in WIDTH_BUCKET columns, so on CUDA each
  (rows, groups) shape is captured once as a CUDA graph and replayed (cudagraphs.py: the model's
  device current, the first failed capture turning graphs off for the process); a row's own
  length is data (the mask), and a step keeps an earlier step's groups while they cover its rows
  (given HEADROOM columns to grow into), so one graph serves about 130 steps, not one width
  bucket's worth. Elsewhere, or once a capture has failed (said in one line), the step runs eagerly.
- attention kernels: on CUDA the SDPA kernels are pinned (policies.attention_kernels here, and
  policies.cuda_settings for the whole run): the memory-efficient kernel wherever a mask is
  passed (decode), flash where none is (prefill), never cuDNN's, which PyTorch 2.9+ tries first
  on H100/H200 and which builds a plan for every new shape. A prefill on CUDA is right-padded
  and causal with no mask (half the P x P work, no K/V copy per head), each row's logits read at
  its own last position (_last_logits); on a CPU it is left-padded with a mask, and nothing is
  pinned.

Invariants, each a test in tests/test_sampler.py (the engine's spec):
1. the same samples as generate_simple: tokens, mask (stop token included) and finished flags
   equal, logprobs equal to float rounding, for greedy and keyed sampling, whatever the budget,
   the refills, the row groups and the model (`test_sampling_equals_generate_simple_...`,
   `test_rows_attended_in_width_groups_...`, `test_generate_equals_generate_simple_greedy_...`);
2. at most `kv_budget` bytes of cache are held (`test_kv_memory_held_never_exceeds_the_budget`);
3. no host read inside a decode step, the stop check read once every STOP_EVERY["cuda"] steps
   (`test_no_host_sync_inside_a_decode_step_...`), and no K/V copy per query head on any
   transformers version (`test_no_repeat_kv_in_a_decode_step_...`);
4. on CUDA, graphs replay what eager steps sample, every CUDA call names the model's device and
   runs with it current, and the schedule of a paper-like voter call captures a graph every
   hundred steps or more (tests/test_cudagraphs.py, with a stand-in for torch.cuda on a CPU).

The KV budget's helpers (bytes per token, rows that fit, the default budget) sit here too,
with `memory_plan`, the line a run prints to say what its memory holds beside the cache.
Run `python bench/generate.py` for its speed against model.generate and generate_simple.
"""
import contextlib
import math
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import cudagraphs
import policies
import seeds
from rollout import Generation, cache_kwarg, check_limits, left_pad, new_cache, row_keys, sample_next

CPU_KV_BUDGET = 4 * 2**30  # bytes of KV cache a generate call may hold on CPU by default
KV_FRACTION = 0.85         # share of free CUDA memory (after loading) for the KV cache by default:
                           # the cache lives only inside a generate call and is handed back
                           # (torch.cuda.empty_cache) when it returns, so the update gets it all;
                           # the rest holds what lives beside the cache (AdamW states, logits)
PREFILL_TOKENS = 32768     # padded prompt tokens per prefill forward (bounds its activations)
# bytes a decode step's sampling holds at once per row and vocabulary entry (rollout.sample_next):
# the fp32 logits buffer and their log-softmax (4 + 4), then a float64 copy of the scaled logits
# and its softmax, or that softmax and its cumulative sum (8 + 8): 6 x the logits' 4 bytes, not
# 1 x (top-p's sort adds 16 more)
SAMPLE_BYTES = 24
REFILL_AT = 1 / 16         # admit newcomers once this share of the rows is free (see _refill)
# decode steps between the host's reads of which rows stopped: on CUDA a read waits for the
# device, so it reads a copy made 4 steps before; on a CPU it costs nothing, so every step
STOP_EVERY = {"cuda": 4, "cpu": 1}
ATTN_GROUPS = 32           # at most this many runs _cheapest partitions: of rows in a decode step's
                           # attention (_groups), of prompts in a prefill (_prefill_chunks)
GROUP_ROWS = {"cuda": 32, "cpu": 1}     # rows a row group grows by: on CUDA SDPA runs one thread block
                                        # per (row, KV head), and fewer than ~256 leave SMs idle
WIDTH_BUCKET = {"cuda": 128, "cpu": 1}  # attended widths round up to a multiple: on CUDA a graph each
# What one more attention call costs, as the K/V elements (row x column x KV head x head dim) that
# the same time attends. CPU: measured with bench/generate.py --call-cost (13-15 us a bare call
# against 0.5-0.9 ns an element, 16k-29k elements, one thread, torch 2.13 on an AMD EPYC), set a
# little above for the slicing and concatenation around the call. CUDA: stated, not measured:
# a launch inside a graph (~2 us) against reading bf16 K and V at ~4.8 TB/s (an H200).
ATTN_CALL = {"cpu": 30_000, "cuda": 4_000_000}
# What one more prefill forward costs, as padded prompt tokens: prompts are prefilled longest
# first in the chunks that cost least (_prefill_chunks), so short prompts are not padded to the
# longest. CPU: chosen from bench/generate.py's equal work on the small shape, where 16, 64 and
# 256 did alike (1.19-1.21x model.generate against 1.12x for one chunk). CUDA: stated, not
# measured: a forward's launches (~2-5 ms at 28 layers) against ~2 us a 0.6B prompt token.
PREFILL_CALL = {"cpu": 64, "cuda": 2048}
# Columns a step's fresh row groups get beyond their widest row, so that the groups (and the CUDA
# graph of their shapes) serve the next HEADROOM steps as the rows grow, and a step keeps an
# earlier step's groups while they cover its rows and cost at most RELAYOUT times fresh ones
# (_Decoder.layout). CUDA: what a capture costs (stated, not measured: ~50-200 ms with its
# warm-up step and synchronize; cudagraphs.GRAPHS times them) against what the padding costs
# each step. On tests/test_cudagraphs.py's paper-like voter call, 0 / 64 / 128 / 256 columns
# capture every 33 / 90 / 129 / 171 steps and attend 1.28 / 1.31 / 1.35 / 1.43 x the rows' own
# widths: 128 saves the most decode time for captures of 40 ms or more at the 0.6B shape.
# CPU: no graph, so none (every step its own cheapest groups).
HEADROOM = {"cuda": 128, "cpu": 0}
RELAYOUT = 1.25
# Prefill: on CUDA prompts are right-padded and run the causal kernel with no mask (flash: half
# of the P x P attention, and no K/V copy per head on transformers 5.17), each row's logits read
# at its own last position; on a CPU left-padded with an explicit mask, as the reference is
# (_prefill: the CPU's samples stay as they were).
PREFILL_CAUSAL = {"cuda": True, "cpu": False}


# ----------------------------------------------------------------------------- KV budget

def _kv_heads_and_dim(config) -> tuple[int, int]:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads, head_dim


def kv_bytes_per_token(config, dtype) -> int:
    """Bytes of KV cache one token costs: K and V, every layer, every kv head."""
    heads, head_dim = _kv_heads_and_dim(config)
    return 2 * config.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def rows_that_fit(kv_budget: int, bytes_per_token: int, length: int) -> int:
    """Rows of `length` tokens (prompt + max_new_tokens) that `kv_budget` bytes hold."""
    return int(kv_budget) // (bytes_per_token * length)


def default_kv_budget(device, fraction: float = KV_FRACTION) -> int:
    """Bytes a generate call may hold: `fraction` of the free memory of a CUDA device (measure
    it after the model is loaded), CPU_KV_BUDGET elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return CPU_KV_BUDGET


def kv_budget_line(kv_budget: int, bytes_per_token: int, prompt_tokens: int, new_tokens: int) -> str:
    """The line a script prints once: what the budget holds at its length limits."""
    n = rows_that_fit(kv_budget, bytes_per_token, prompt_tokens + new_tokens)
    return f"KV budget {kv_budget / 2**30:.2f} GiB holds {n} rows of {prompt_tokens}+{new_tokens} tokens"


def _row_count(prompts: int, need: int, bytes_per_token: int, kv_budget, max_rows) -> int:
    """Cache rows the call holds: one per prompt, capped by max_rows and by what the budget holds."""
    held = prompts if max_rows is None else max(1, min(prompts, max_rows))
    if kv_budget is not None:
        fit = rows_that_fit(kv_budget, bytes_per_token, need)
        if fit < 1:
            raise ValueError(f"kv_budget {int(kv_budget):,} B is smaller than one row's need: {need} tokens "
                             f"(prompt + max_new_tokens) x {bytes_per_token:,} B per token = "
                             f"{need * bytes_per_token:,} B")
        held = min(held, fit)
    return held


def memory_plan(policy, kv_budget: int, args) -> str:
    """One line of memory: weights, trainable weights with AdamW states, the KV budget and the
    rows it holds at the length limits, and the training micro-batch; a user sees at once
    whether the run fits. On CUDA it also gives the numbers behind the default budget: the free
    memory after loading, KV_FRACTION of it for the cache, and what the rest must hold
    while the cache lives (the AdamW states, made at the first update, and what sampling holds:
    SAMPLE_BYTES a row and vocabulary entry).
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
    logits = a.token_budget * cfg.vocab_size * 2 * size        # the logits and their gradient
    acts = a.token_budget * cfg.num_hidden_layers * cfg.hidden_size * size
    rows = rows_that_fit(kv_budget, per_tok, prompt + a.max_new_tokens)
    device = next(p.model.parameters()).device
    why = ""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        share = "--kv-budget-gb" if a.kv_budget_gb else f"{KV_FRACTION:g} of it"
        sampling = rows * cfg.vocab_size * SAMPLE_BYTES
        why = (f" | free after loading {gib(free)}: KV {share}, beside it AdamW {gib(16 * trainable)} + "
               f"sampling {gib(sampling)} = {gib(kv_budget + 16 * trainable + sampling)}")
    return (f"memory: weights {gib(weights)} | trainable {trainable / 1e6:.1f}M x 16 B (fp32 + grad + AdamW) "
            f"{gib(16 * trainable)} | {kv_budget_line(kv_budget, per_tok, prompt, a.max_new_tokens)} "
            f"({per_tok / 1024:.0f} KiB a token){why} | micro-batch {a.token_budget} tokens: logits + grad {gib(logits)}, "
            f"layer inputs {gib(acts)}{' (checkpointed)' if p.checkpointing else ' + every activation'}")


# ----------------------------------------------------------------------------- decode attention

ATTENTION = "marl_rows"  # the name decode_attention has in transformers' AttentionInterface


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, row_groups=None,
                     **kwargs):
    """transformers' attention function while `generate` runs (registered as ATTENTION).

    A one-token query (decode) folds the g query heads of each KV head into the query axis,
    (n, Hkv*g, 1, D) -> (n, Hkv, g, D), so SDPA reads each K/V head once and nothing copies it
    (transformers' own SDPA path repeats the K/V g times with repeat_kv in 5.17). Query head h
    uses KV head h // g, as repeat_kv pairs them. `row_groups`, ((start, end, w), ...), attends
    rows [start, end) over their first w columns only; `attention_mask` is generate's
    (n, 1, 1, W) bool mask (True: attended). Longer queries, or any without a mask (a prefill),
    go to transformers' SDPA function as they are. Returns ((n, 1, Hq, D), None), the attention
    functions' contract."""
    if query.shape[2] != 1 or attention_mask is None:   # a prefill (a causal one may have a 1-token chunk)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    n, Hq, _, D = query.shape
    Hkv = key.shape[1]
    q = query.reshape(n, Hkv, Hq // Hkv, D)                            # (n, Hkv, g, D)
    parts = [F.scaled_dot_product_attention(q[a:b], key[a:b, :, :w], value[a:b, :, :w],
                                            attn_mask=attention_mask[a:b, :, :, :w], scale=scaling)
             for a, b, w in row_groups or ((0, n, key.shape[2]),)]    # each (b - a, Hkv, g, D)
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(n, 1, Hq, D), None


AttentionInterface.register(ATTENTION, decode_attention)


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


# ----------------------------------------------------------------------------- the row cache

@dataclass
class _Writes:
    """Where the forward in progress puts its K/V, read by every layer of the row cache: a model's
    forward cannot hand its cache arguments, so generate sets this before each forward
    (`prefill`, `decode`) and the layers' `update` reads it."""
    columns: torch.Tensor         # (L,) arange over a row's columns
    head_rows: torch.Tensor       # (S, H): row r's head h at r * H + h of a layer's (S * H, L, D) view
    is_prefill: bool = False
    n: int = 0                    # decode: the step runs the first n cache rows
    width: int = 0                # decode: the columns its widest row group attends
    at: torch.Tensor = None       # decode: (n * H,) where row r's head h writes in the (S * H * L, D) view
    dst: torch.Tensor = None      # prefill: (N, 1) the cache row of each newcomer
    src: torch.Tensor = None      # prefill: (N,) its row in the prefill batch
    cols: torch.Tensor = None     # prefill: (N, P) the column each padded position goes to

    def prefill(self, dst, src, cols) -> None:
        self.is_prefill, self.width, self.dst, self.src, self.cols = True, 0, dst, src, cols

    def decode(self, n: int, width: int, column) -> None:
        """`column` (n,): each row's column, its position: the same write for every layer, so
        its flat index is computed once a step (one index_copy_ a layer, not an indexed put)."""
        L = len(self.columns)
        self.is_prefill, self.n, self.width = False, n, width
        self.at = (self.head_rows[:n] * L + column[:, None]).reshape(-1)


class _RowLayer(DynamicLayer):
    """One layer's K and V for S rows of L columns, (S, H, L, D) each, written in place."""

    def __init__(self, keys, values, writes: _Writes):
        super().__init__()
        self.keys, self.values, self.writes = keys, values, writes
        self.is_initialized = True

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.writes.width

    def update(self, key_states, value_states, *args, **kwargs):
        w = self.writes
        if w.is_prefill:  # (U, H, P, D), left-padded: newcomer k's prompt into columns [0, len) of its row
            self.keys[w.dst, :, w.cols] = key_states[w.src].transpose(1, 2)       # (N, P, H, D)
            self.values[w.dst, :, w.cols] = value_states[w.src].transpose(1, 2)
            return key_states, value_states
        n, D = w.n, key_states.shape[-1]   # (n, H, 1, D): each row at its own column
        self.keys.view(-1, D).index_copy_(0, w.at, key_states.reshape(-1, D))
        self.values.view(-1, D).index_copy_(0, w.at, value_states.reshape(-1, D))
        return self.keys[:n, :, :w.width], self.values[:n, :, :w.width]         # (n, H, W, D)


def _row_cache(model, rows: int, length: int):
    """A cache of `rows` x `length` columns per layer, zero-filled: masked columns are still
    multiplied by a zero weight in attention, and uninitialised memory may hold NaN
    (0 x NaN = NaN), so every column must hold a finite number. Returns (cache, writes)."""
    cfg, dev = model.config, next(model.parameters()).device
    heads, head_dim = _kv_heads_and_dim(cfg)
    cache = new_cache(model)
    if any(type(layer) is not DynamicLayer for layer in getattr(cache, "layers", [])):
        raise NotImplementedError("generate supports full-attention models only (no sliding-window layers)")
    writes = _Writes(columns=torch.arange(length, device=dev),
                     head_rows=torch.arange(rows * heads, device=dev).view(rows, heads))
    shape = (rows, heads, length, head_dim)
    cache.layers = [_RowLayer(torch.zeros(shape, dtype=model.dtype, device=dev),
                              torch.zeros(shape, dtype=model.dtype, device=dev), writes)
                    for _ in range(cfg.num_hidden_layers)]
    return cache, writes


def cache_bytes(cache) -> int:
    """Bytes of the tensors the cache's layers hold (measured from their storage)."""
    storages = {}
    for layer in cache.layers:
        for t in vars(layer).values():
            if torch.is_tensor(t):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _to(array, device):
    """A host array on the device, copied without waiting for the device."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


def _copy_rows(cache, dst, src, width: int) -> None:
    """Copy the first `width` columns of cache rows `src` into rows `dst` (host index arrays;
    gathered before written, so a row may be both a source and a destination)."""
    dev = cache.layers[0].keys.device
    d, s = _to(np.asarray(dst), dev), _to(np.asarray(src), dev)
    for layer in cache.layers:
        layer.keys[d, :, :width] = layer.keys[s, :, :width]        # (N, H, width, D)
        layer.values[d, :, :width] = layer.values[s, :, :width]


# ----------------------------------------------------------------------------- the rows in flight

@dataclass
class _HostRows:
    """The host's counters of the S cache rows, (S,) int64 each: they decide the schedule (which
    rows are free, how wide each is) without reading the device."""
    out: np.ndarray      # the output row (prompt index) the cache row fills; Rows.discard when free
    made: np.ndarray     # tokens sampled so far
    pos: np.ndarray      # column (= position) of the last token written
    limit: np.ndarray    # the row's max_new_tokens
    busy: np.ndarray     # 1 while the host counts the row as running
    holds: np.ndarray    # the distinct prompt whose K/V columns [0, len) the row holds, -1 none

    FIELDS = ("out", "made", "pos", "limit", "busy", "holds")


@dataclass
class _DeviceRows:
    """The device's counters of the same rows, which it advances itself after each sample; each
    a buffer written in place, since a CUDA graph reads and writes them."""
    out: torch.Tensor        # (S,) long, as the host's
    made: torch.Tensor       # (S,) long
    pos: torch.Tensor        # (S,) long
    limit: torch.Tensor      # (S,) long
    live: torch.Tensor       # (S,) bool: neither stopped nor at its limit
    tok: torch.Tensor        # (S,) long: the token the row feeds next
    logits: torch.Tensor = None   # (S, V) fp32: each row's next-token logits

    def buffers(self) -> list:
        return [self.out, self.made, self.pos, self.limit, self.live, self.tok] + \
            ([self.logits] if self.logits is not None else [])


@dataclass
class _Rows:
    """The S cache rows of a generate call, as the host and the device each count them. They
    agree, except that the host learns of a stop id up to 2 x STOP_EVERY steps late (_StopCheck)
    and counts the row as running until then (its width is only overestimated). Rows in flight
    sit first, widest first (_arrange), so a row group holds rows of about one width; every busy
    row grows by one column a step, so the order holds between refills."""
    host: _HostRows
    dev: _DeviceRows
    discard: int          # the output row that rows which have ended write to (B, one past the last)
    n: int = 0            # rows a decode step runs: the first n, n a row bucket

    @classmethod
    def empty(cls, S: int, discard: int, device):
        zeros = lambda: np.zeros(S, dtype=np.int64)   # noqa: E731
        host = _HostRows(np.full(S, discard), zeros(), zeros(), zeros(), zeros(), np.full(S, -1))
        t = lambda: torch.zeros(S, dtype=torch.long, device=device)   # noqa: E731
        dev = _DeviceRows(torch.full((S,), discard, device=device), t(), t(), t(),
                          torch.zeros(S, dtype=torch.bool, device=device), t())
        return cls(host, dev, discard)


@dataclass
class _Job:
    """One generate call: the prompts, their limits, the queue and the outputs being filled."""
    prompts: list
    limits: np.ndarray    # (B,) max_new_tokens per prompt
    distinct: list        # (B,) index of each prompt's distinct prompt (equal for identical prompts when shared)
    queue: deque          # prompt indices not yet admitted, identical prompts adjacent
    waiting: Counter      # distinct prompt -> copies still in the queue
    first: dict           # distinct prompt -> (V,) logits of its first token, while copies wait
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
    return _Job(prompts=prompts, limits=limits, distinct=distinct, queue=queue, waiting=Counter(distinct), first={},
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


def _groups(st: _Rows, length: int, per_column: int, headroom: int = 0) -> tuple:
    """((start, end, w), ...): the step's n rows cut into row groups, each attending its widest
    busy row's columns plus `headroom`, rounded up to WIDTH_BUCKET (at most `length`). Rows sit
    widest first and are taken in runs of GROUP_ROWS, or more where n would make more than
    ATTN_GROUPS runs; the runs are then joined into the groups that cost least, one attention
    call (ATTN_CALL, in K/V elements) a group plus its rows x its width x `per_column` elements
    (_cheapest). So rows of about one width share a call, and a step costs about its rows' own
    widths plus a call per group."""
    n, kind = st.n, "cuda" if st.dev.out.device.type == "cuda" else "cpu"
    width = (st.host.pos[:n] + 1) * st.host.busy[:n]      # (n,) host counters: no sync
    run, bucket = max(-(-n // ATTN_GROUPS), GROUP_ROWS[kind]), WIDTH_BUCKET[kind]
    starts = np.arange(0, n, run)
    need = np.maximum.reduceat(width, starts) + headroom                    # (runs,) columns each run needs
    widest = np.minimum(length, np.maximum(1, -(-need // bucket)) * bucket)
    return _cheapest(starts.tolist(), np.minimum(starts + run, n).tolist(), widest.tolist(),
                     ATTN_CALL[kind] / per_column)


def _cost(groups: tuple, call: float) -> float:
    """What a step attending `groups` costs, in row-columns: `call` a group plus rows x width."""
    return sum(call + (b - a) * w for a, b, w in groups)


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


# ----------------------------------------------------------------------------- the schedule

def _arrange(cache, st: _Rows, lens: np.ndarray) -> np.ndarray:
    """Reorder the cache rows: the rows in flight and the newcomers (prompt lengths `lens`) by
    width, widest first, then the free rows (those holding no prompt first, so newcomers take
    them). Return the cache row each newcomer goes to; st.n becomes the bucket of the busy rows."""
    h, S = st.host, len(st.host.busy)
    busy, free = np.flatnonzero(h.busy), np.flatnonzero(h.busy == 0)
    free = free[np.argsort(h.holds[free] >= 0, kind="stable")]
    order = np.argsort(-np.concatenate([h.pos[busy] + 1, lens]), kind="stable")  # ties: rows in flight first
    perm, dest, free_rows = np.empty(S, dtype=np.int64), np.empty(len(lens), dtype=np.int64), iter(free)
    for j, e in enumerate(order):
        if e < len(busy):
            perm[j] = busy[e]
        else:
            perm[j] = next(free_rows)
            dest[e - len(busy)] = j
    perm[len(order):] = list(free_rows)
    _move(cache, st, perm)
    st.n = _row_bucket(len(order), S)
    return dest


def _move(cache, st: _Rows, perm: np.ndarray) -> None:
    """Cache row perm[j] becomes row j: the K/V of the rows that hold something (in flight, or a
    prompt kept for a later copy) up to the widest of them, and every counter on both sides."""
    if (perm == np.arange(len(perm))).all():
        return
    h = st.host
    keep = (perm != np.arange(len(perm))) & ((h.busy[perm] == 1) | (h.holds[perm] >= 0))
    moved = np.flatnonzero(keep)
    if len(moved):
        _copy_rows(cache, moved, perm[moved], int(h.pos[perm[moved]].max()) + 1)
    p = _to(perm, st.dev.out.device)
    for t in st.dev.buffers():
        t.copy_(t[p])                # in place: a CUDA graph holds these buffers
    for name in _HostRows.FIELDS:
        setattr(h, name, getattr(h, name)[perm])


def _refill(model, cache, writes, st: _Rows, job: _Job, counts) -> bool:
    """Give free rows to the next waiting prompts, once REFILL_AT of the rows are free (or every
    waiting prompt fits): sort them in among the rows in flight, put their prompts' K/V in place
    and their first logits in st.dev.logits, and set their counters on both sides."""
    h, d = st.host, st.dev
    free = int((h.busy == 0).sum())
    if not job.queue or free < min(math.ceil(REFILL_AT * len(h.busy)), len(job.queue)):
        return False
    admitted = np.array([job.queue.popleft() for _ in range(min(free, len(job.queue)))])   # prompt indices
    lens = np.array([len(job.prompts[i]) for i in admitted])
    dest = _arrange(cache, st, lens)                                           # their cache rows
    logits = _first_logits(model, cache, writes, st, job, dest, admitted, counts)   # (N, V)
    if d.logits is None:
        d.logits = logits.new_zeros((len(h.busy), logits.shape[1]))           # (S, V)
    rows, limits = _to(dest, d.out.device), job.limits[admitted]
    d.logits[rows] = logits
    for t, v in ((d.out, admitted), (d.made, np.zeros_like(admitted)), (d.pos, lens - 1), (d.limit, limits)):
        t[rows] = _to(v, t.device)
    d.live[rows] = True
    # pos: the prompt's last column
    h.out[dest], h.made[dest], h.pos[dest], h.limit[dest] = admitted, 0, lens - 1, limits
    h.busy[dest], h.holds[dest] = 1, np.asarray(job.distinct)[admitted]
    return True


def _schedule(model, cache, writes, st: _Rows, job: _Job, counts) -> None:
    """Before a step: admit waiting prompts (_refill); once none wait, pack the busy rows into
    a smaller row bucket as soon as they fit one."""
    if _refill(model, cache, writes, st, job, counts):
        return
    busy = int(st.host.busy.sum())
    if not job.queue and busy and _row_bucket(busy, len(st.host.busy)) < st.n:
        _arrange(cache, st, np.zeros(0, dtype=np.int64))


def _prefill(model, cache, writes, distinct: list, dst: list, src: list, pad_id: int):
    """Run the U `distinct` prompts through the model in the chunks of _prefill_chunks (longest
    first, each padded to its longest); the K/V of distinct[src[k]] goes into columns [0, len)
    of cache row dst[k] (its pad positions to the last column, which no live row attends).
    Where PREFILL_CAUSAL (CUDA), a chunk is right-padded and runs the causal kernel with no
    mask, its logits read at each row's own last position (_last_logits); elsewhere it is
    left-padded with an explicit (U', 1, P, P) mask. Return the (U, V) fp32 logits of each
    prompt's first new token."""
    dev, L = writes.columns.device, len(writes.columns)
    kind = "cuda" if dev.type == "cuda" else "cpu"
    chunks = _prefill_chunks([len(p) for p in distinct], kind)
    dst, src = np.asarray(dst), np.asarray(src)
    logits = [None] * len(distinct)
    for chunk in chunks:
        rows = [distinct[u] for u in chunk]
        P, sel, where = max(map(len, rows)), np.flatnonzero(np.isin(src, chunk)), {u: i for i, u in enumerate(chunk)}
        lens = np.array([len(distinct[u]) for u in src[sel]])
        pad = np.zeros_like(lens) if PREFILL_CAUSAL[kind] else P - lens                # (N,) pads before the prompt
        cols = np.arange(P)[None, :] - pad[:, None]                                 # (N, P): position -> column
        writes.prefill(_to(dst[sel][:, None], dev), _to(np.array([where[u] for u in src[sel]]), dev),
                       _to(np.where((cols < 0) | (cols >= lens[:, None]), L - 1, cols), dev))
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


def _first_logits(model, cache, writes, st: _Rows, job: _Job, dest, admitted, counts):
    """(N, V) logits of each newcomer's first token, its prompt's K/V put in columns [0, len) of
    its cache row dest[k]: copied from a row that holds the same prompt (whose first logits were
    kept while copies waited), else prefilled, each distinct prompt once."""
    want = [job.distinct[i] for i in admitted]
    held = {q: r for r, q in enumerate(st.host.holds.tolist()) if q >= 0}   # distinct prompt -> a row with its K/V
    copy = [k for k, q in enumerate(want) if q in held and q in job.first]
    out = [None] * len(admitted)
    if copy:  # before the prefill, which may overwrite a holder
        _copy_rows(cache, [dest[k] for k in copy], [held[want[k]] for k in copy],
                   max(len(job.prompts[admitted[k]]) for k in copy))
        for k in copy:
            out[k] = job.first[want[k]]
    fresh = [k for k in range(len(admitted)) if out[k] is None]
    if fresh:
        u = {q: i for i, q in enumerate(dict.fromkeys(want[k] for k in fresh))}   # distinct prompt -> prefill row
        prompt = [None] * len(u)
        for k in fresh:
            prompt[u[want[k]]] = job.prompts[admitted[k]]
        first = _prefill(model, cache, writes, prompt, [dest[k] for k in fresh], [u[want[k]] for k in fresh],
                         job.pad_id)                                             # (U, V)
        counts["prefill_rows"] += len(u)
        for k in fresh:
            out[k] = first[u[want[k]]]
    _keep_first_logits(job, want, out)
    return torch.stack(out)                                                       # (N, V)


def _keep_first_logits(job: _Job, want: list, out: list) -> None:
    """Keep a prompt's first logits while copies of it still wait in the queue."""
    for q, c in Counter(want).items():
        job.waiting[q] -= c
        if job.waiting[q] == 0:
            job.first.pop(q, None)
        elif q not in job.first:
            job.first[q] = out[want.index(q)].clone()


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
    stop check says ended (`ended`, output rows). A free row keeps its prompt's K/V, columns
    [0, len), for a later copy of the same prompt."""
    h = st.host
    h.made += h.busy
    h.pos += h.busy
    done = (h.busy == 1) & (h.made >= h.limit)
    if ended is not None:
        done |= (h.busy == 1) & np.isin(h.out, ended)
    h.out[done], h.busy[done] = st.discard, 0


class _Decoder:
    """The forward of a decode step over the first n cache rows: every row feeds st.dev.tok at
    its column st.dev.pos (= its position), writes its K/V there, and row group (a, b, w) attends
    its first w columns (the mask, built inside from the positions, hides a row's columns past
    its own); the next-token logits land in st.dev.logits. Its inputs are buffers written in
    place (tokens, positions, the cache) and nothing in it reads the device, so on CUDA
    (`graphs`) a step of n rows over `groups` is captured once as a CUDA graph and replayed
    (cudagraphs.StepGraphs); a generate call runs one adapter, so a graph belongs to one adapter.

    Which groups a step attends is `layout`: where HEADROOM is 0 (a CPU), the cheapest groups of
    this step's widths (_groups); elsewhere the groups of an earlier step of as many rows are
    kept while they still cover every busy row and cost at most RELAYOUT times the fresh ones,
    and fresh groups get HEADROOM columns to grow into: so one graph serves a hundred steps or
    more instead of one width bucket's worth."""

    def __init__(self, model, cache, writes: _Writes, st: _Rows, graphs: bool):
        self.model, self.cache, self.writes, self.st = model, cache, writes, st
        self.graphs = cudagraphs.StepGraphs(st.dev.out.device) if graphs else None
        self.cache_kw = cache_kwarg(model)
        self.layouts = {}          # n -> the row groups steps of n rows attend while they cover
        self.eager_steps = 0

    def forward(self, n: int, groups: tuple) -> None:
        d = self.st.dev
        pos = d.pos[:n]                                              # (n,) column of the token fed
        self.writes.decode(n, max(w for _, _, w in groups), pos)
        mask = (self.writes.columns[:self.writes.width] <= pos[:, None])[:, None, None]   # (n, 1, 1, W)
        out = self.model(input_ids=d.tok[:n, None], attention_mask=mask, position_ids=pos[:, None], use_cache=True,
                         row_groups=groups, **{self.cache_kw: self.cache})
        d.logits[:n] = out.logits[:, -1]                             # (n, V) fp32

    def __call__(self, n: int, groups: tuple) -> None:
        if self.graphs is None:
            self.eager_steps += 1
            return self.forward(n, groups)
        self.graphs.run((n, groups), lambda: self.forward(n, groups))

    def layout(self, length: int, per_column: int) -> tuple:
        """The row groups of this step (see the class): ((start, end, w), ...)."""
        st = self.st
        kind = "cuda" if st.dev.out.device.type == "cuda" else "cpu"
        fresh = _groups(st, length, per_column, HEADROOM[kind])
        if not HEADROOM[kind]:
            return fresh
        held, call = self.layouts.get(st.n), ATTN_CALL[kind] / per_column
        width = (st.host.pos[:st.n] + 1) * st.host.busy[:st.n]      # (n,) host counters: no sync
        if held is not None and all(width[a:b].max() <= w for a, b, w in held) \
                and _cost(held, call) <= RELAYOUT * _cost(fresh, call):
            return held
        self.layouts[st.n] = fresh
        return fresh

    def count(self) -> None:
        """Add this call's captures, replays and eager steps to cudagraphs.GRAPHS."""
        if self.graphs is None:
            cudagraphs.GRAPHS["calls"] += 1
            cudagraphs.GRAPHS["eager_steps"] += self.eager_steps
        else:
            self.graphs.count()


@torch.no_grad()  # not inference_mode: its tensors could not be reused by autograd later
def generate(model, prompts: list, max_new_tokens, stop_ids, pad_id: int,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, keys=None, share_prefix: bool = True,
             kv_budget: int | None = None, max_rows: int | None = None, stats: dict | None = None,
             cuda_graphs: bool = True, host: bool = False) -> Generation:
    """Sample a completion for every prompt (a list of token-id lists), as generate_simple does.
    `max_new_tokens`: one limit, or one per prompt. Row i's token t is drawn with
    seeds.uniforms(seed, keys[i], t), so what a row samples does not depend on the cache row it
    gets or on which rows share the call. At most `kv_budget` bytes of KV cache (None: every row
    at once) and `max_rows` rows are held. `cuda_graphs`: replay decode steps from CUDA graphs
    on a CUDA device. `stats`, a dict, gets prefill_rows (prompts run through a prefill) and
    decode_steps added, and kv_bytes (cache tensors held) and rows (rows held at once) raised to
    this call's. `host`: the Generation's tensors on the host, each copied there once (what
    rollout.make_llm reads row by row, several device reads a row otherwise)."""
    limits = check_limits(prompts, max_new_tokens)
    dev = next(model.parameters()).device
    need = max(len(p) + int(t) for p, t in zip(prompts, limits))  # columns of the longest row
    S = _row_count(len(prompts), need, kv_bytes_per_token(model.config, model.dtype), kv_budget, max_rows)
    cache, writes = _row_cache(model, S, need)
    job = _new_job(prompts, limits, pad_id, share_prefix, row_keys(keys, len(prompts), dev), dev)
    st = _Rows.empty(S, discard=len(prompts), device=dev)
    decode = _Decoder(model, cache, writes, st, cuda_graphs and cudagraphs.usable(dev))
    check = _StopCheck(S, dev)
    stops = torch.tensor(sorted(set(stop_ids)), device=dev)
    per_column = math.prod(_kv_heads_and_dim(model.config))   # K/V elements of one row-column, per layer
    counts = Counter(prefill_rows=0, decode_steps=0)
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
                decode(st.n, decode.layout(need, per_column))
                counts["decode_steps"] += 1
    if stats is not None:
        for k, v in counts.items():
            stats[k] = stats.get(k, 0) + v
        stats["kv_bytes"] = max(stats.get("kv_bytes", 0), cache_bytes(cache))
        stats["rows"] = max(stats.get("rows", 0), S)
    decode.count()
    out = _output(job)
    if host:
        out = Generation(out.tokens.cpu(), out.logprobs.cpu(), out.mask.cpu(), out.finished.cpu())
    if dev.type == "cuda":  # the cache and the graphs' pool go back before the update runs
        del cache, decode, st, writes
        torch.cuda.empty_cache()
    return out


def _output(job: _Job) -> Generation:
    B = len(job.prompts)
    T = int(job.length[:B].max())            # the one read of the device after the loop
    mask = torch.arange(T, device=job.length.device) < job.length[:B, None]   # (B, T), the stop token included
    return Generation(job.tokens[:B, :T], job.logps[:B, :T], mask, job.finished[:B].clone())
