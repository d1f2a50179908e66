"""Rollout: the sampler, and the `llm` that runs workflow stages through it.

The module opens with `generate_simple`, the plain reference sampler: every prompt left-padded
into one batch and one ordinary DynamicCache, every row stepping together until all have ended.
`generate`, further down, is the fast version (continuous batching in a KV budget), tested
against it in tests/test_sampler.py: the same tokens, logprobs, masks and finished flags.

Both sample one completion per token-id prompt:
- row i's token t is drawn with the uniform seeds.uniforms(seed, keys[i], t), by inverse CDF
  over float64 probabilities (the exact distribution to float64 rounding), so what a row
  samples depends on its key and nothing else: not on its cache row, the KV budget, the rows beside
  it or the rank it runs on. make_llm keys a row by (stream, problem, rollout, call);
- logits are divided by the temperature and upcast to fp32 before the log-softmax; the
  returned logprob of a token is under that temperature-scaled distribution (top-p only
  narrows which tokens can be drawn; with top_p=1, the paper's setting, it is exactly the
  distribution sampled from, and what grpo.py recomputes). temperature=0 is greedy, and its
  logprobs are then under the unscaled (T=1) distribution;
- a row stops at the first of any stop id (Qwen3 has two) or at its own max_new_tokens; the stop
  token is kept with mask 1, later positions are pad with mask 0; `finished` is False for rows
  cut at their limit. Outputs are per prompt, in input order, whatever order rows ran in.

How `generate`'s rows share memory (dense cache rows, chosen for plain torch + Hugging Face models):
- the call holds S cache rows, each with room for the longest row (L = max prompt +
  max_new_tokens columns): per layer one K and one V buffer (S, kv_heads, L, head_dim),
  zero-filled once. S = what `kv_budget` bytes hold (None: every row at once), capped by
  `max_rows`. Dense rows, not pages: SDPA wants each row's K/V as one dense tensor, and
  gathering pages into one every step would copy the attended cache per token. The price: a
  row is sized for the worst case, so a budget holds budget / (L x bytes per token) rows.
- a prompt is written from column 0 of its row (its prefill chunk is left-padded, and the
  cache's update moves each prompt's K/V to the front), so a token's column is its position.
  A decode step writes every row's new K/V at its own column (one indexed write per layer).
- attention follows each row's own width: the rows in flight sit widest first (re-sorted at
  each refill; all grow by one column a step, so the order holds), the step's rows are cut
  into runs (ATTN_GROUPS, GROUP_ROWS: one row a run on CPU, 32 or more on CUDA), and each run
  attends only its widest row's columns, rounded up to WIDTH_BUCKET (128 on CUDA); a (rows, 1,
  1, W) mask `column <= own column` hides the rest. The model's attention is
  `decode_attention` for the call (registered in transformers' AttentionInterface): it folds
  each KV head's query heads into the query axis, so no K/V is copied per head.
- when a row stops, its cache row goes to the next waiting prompt. Newcomers are prefilled
  together through the same cache object (no second cache). They are admitted once REFILL_AT
  (1/16) of the rows are free: a prefill forward of a few rows costs about as much as a decode
  step (on a GPU both are bound by reading every weight once), so refilling one row at a time
  would add a forward to most steps, while waiting for 1/16 keeps the batch >= 15/16 full.
  Once the queue is empty the busy rows are packed into a smaller row bucket whenever they fit.
- identical prompts are prefilled once: copies in one prefill share a row, and a copy admitted
  later copies the prompt's K/V from a cache row that holds it (a free row keeps its prompt's
  columns) and reuses the saved logits of its first token; each row still samples its own
  first token.

A decode step a CUDA graph can hold: the device keeps its own counters (`_Rows.d`) and
advances them after each sample, the step's inputs are buffers written in place (tokens,
positions, the cache, the logits), the mask is built inside it from the positions, the rows
run come in buckets (1, 2, 4, 8, multiples of 8) and the widths in WIDTH_BUCKET columns, and
nothing inside reads the device. The host decides the schedule from its own copy of the
counters and learns which rows hit a stop id from a copy made without blocking and read once
every STOP_EVERY steps (a row that stopped runs on, discarded, for up to 2 x STOP_EVERY steps).
On CUDA each (rows, row groups) shape is captured once as a CUDA graph and replayed
(`cuda_graphs=True`); elsewhere, or if a capture fails, the same step runs eagerly.

The KV budget's helpers sit here, and with them `memory_plan`, the run's one line of memory
(weights, adapters with AdamW, the KV budget and what it holds, the training micro-batch),
since the budget is the part a user most often has to size.

Run `python bench/generate.py` to compare its speed with `model.generate` and with
`generate_simple` in lockstep batches.
"""
import contextlib
import functools
import inspect
import math
import sys
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import policies
import seeds
from workflows import Call, Episode, run_workflow

CPU_KV_BUDGET = 4 * 2**30  # bytes of KV cache a generate call may hold on CPU by default
KV_FRACTION = 0.85         # share of free CUDA memory (after loading) for the KV cache by default:
                           # the cache lives only inside a generate call and is handed back
                           # (torch.cuda.empty_cache) when it returns, so the update gets it all;
                           # the rest holds what lives beside the cache (AdamW states, logits)
PREFILL_TOKENS = 32768     # padded prompt tokens per prefill forward (bounds its activations)
REFILL_AT = 1 / 16         # admit newcomers once this share of the rows is free (see _refill)
STOP_EVERY = 4             # decode steps between the host's reads of which rows stopped
ATTN_GROUPS = 32           # at most this many row groups in a decode step's attention (see _groups)
GROUP_ROWS = {"cuda": 32, "cpu": 1}     # least rows in a row group: on CUDA SDPA runs one thread block
                                        # per (row, KV head), and fewer than ~256 leave SMs idle
WIDTH_BUCKET = {"cuda": 128, "cpu": 1}  # attended widths round up to a multiple: on CUDA a graph each


@dataclass
class Generation:
    tokens: torch.Tensor    # (B, T) completion ids, pad after the stop token
    logprobs: torch.Tensor  # (B, T) fp32 logprob of each sampled token, 0 where mask is 0
    mask: torch.Tensor      # (B, T) bool, True for real tokens, the stop token included
    finished: torch.Tensor  # (B,) bool, True if the row emitted a stop id


# ----------------------------------------------------------------------------- the reference sampler

@torch.no_grad()  # not inference_mode: its tensors could not be reused by autograd later
def generate_simple(model, prompts: list, max_new_tokens, stop_ids, pad_id: int,
                    temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, keys=None) -> Generation:
    """Sample a completion for every prompt (a list of token-id lists), the plain way: all rows
    in one left-padded batch and one DynamicCache, stepping together until every row has hit a
    stop id or its limit (`max_new_tokens`: one int, or one per prompt). Row i's token t is
    drawn with seeds.uniforms(seed, keys[i], t) (`keys`: one int64 per row; None: the row
    index). The reference that `generate` is tested against; it holds every row at once, for
    as many steps as the longest."""
    dev = next(model.parameters()).device
    keys = _row_keys(keys, len(prompts), dev)                            # (B,) int64
    limits = torch.from_numpy(_limits(prompts, max_new_tokens)).to(dev)  # (B,)
    B, T = len(prompts), int(limits.max())
    # left padding: every prompt ends in the last column, so every row's next token comes
    # from the logits at -1; the pad columns in front have mask 0
    ids, mask = left_pad(prompts, pad_id, dev)                           # (B, P)
    stops = torch.tensor(sorted(set(stop_ids)), device=dev)
    tokens = torch.full((B, T), pad_id, dtype=torch.long, device=dev)   # (B, T)
    logps = torch.zeros((B, T), dtype=torch.float32, device=dev)         # (B, T)
    made = torch.zeros(B, dtype=torch.long, device=dev)                  # (B,) tokens kept per row
    finished = torch.zeros(B, dtype=torch.bool, device=dev)              # (B,) emitted a stop id
    done = torch.zeros(B, dtype=torch.bool, device=dev)                  # (B,) stopped or at its limit
    cache = _new_cache(model)
    for t in range(T):
        # position = cumsum(mask) - 1, the trainer's formula: each prompt starts at position 0
        # whatever its padding. The mask, passed every step, hides the pad columns.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)                         # (B, P+t)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos[:, -ids.shape[1]:],
                    use_cache=True, logits_to_keep=1, **{_cache_kwarg(model): cache})
        logits = out.logits[:, -1].float()                               # (B, V), fp32 before the log-softmax
        # sample_next divides by the temperature: the logprob is under that scaled distribution
        u = seeds.uniforms(seed, keys, torch.full_like(keys, t)) if temperature > 0 else None  # (B,)
        tok, lp = sample_next(logits, temperature, top_p, u)             # (B,)
        tokens[:, t], logps[:, t] = tok.masked_fill(done, pad_id), lp.masked_fill(done, 0.0)
        # a stop token is kept (mask 1: the policy chose it, so it is trained on); pad follows
        hit = ~done & torch.isin(tok, stops)
        made += ~done
        finished |= hit
        done |= hit | (made >= limits)
        if done.all():
            break
        # rows that ended keep stepping, so the batch keeps one shape; their tokens are dropped above
        ids = tok[:, None]                                               # (B, 1)
        mask = torch.cat([mask, mask.new_ones((B, 1))], dim=1)           # (B, P+t+1)
    n = int(made.max())
    mask = torch.arange(n, device=dev) < made[:, None]                   # (B, n), the stop token included
    return Generation(tokens[:, :n], logps[:, :n], mask, finished)


def sample_next(logits, temperature: float, top_p: float, u):
    """Draw one token per row from fp32 `logits` (B, V) with the row's uniform `u` (B,) float64
    (unused when greedy); return (ids (B,), logprobs (B,) fp32)."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        ids = logp.argmax(-1)
    else:
        logp = torch.log_softmax(logits / temperature, dim=-1)  # (B, V) fp32: the logprob returned
        # drawn from float64 probabilities: in fp32 a cumulative sum over 151,936 tokens rounds
        # every late token's mass to 0 or to a whole fp32 step, so many could never be drawn
        probs = torch.softmax(logits.double() / temperature, dim=-1)   # (B, V) float64
        if top_p < 1.0:
            sp, si = probs.sort(-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p: a token goes once the mass
            # before it already reaches top_p (`>=`: on an exact tie the next token is not kept)
            drop = sp.cumsum(-1) - sp >= top_p
            ids = si.gather(-1, _draw(sp.masked_fill(drop, 0.0), u)[:, None]).squeeze(-1)
        else:
            ids = _draw(probs, u)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


def _draw(probs, u):
    """One index per row of `probs` (B, V) float64 by inverse CDF: the row's uniform `u` (B,)
    times the total mass, found in the cumulative sum by a binary search (lighter than
    torch.multinomial for one sample a row). Token v is drawn with probability
    (c[v] - c[v-1]) / c[-1], c the float64 cumsum: the exact distribution to float64 rounding."""
    return inverse_cdf(probs.cumsum(-1), u[:, None]).squeeze(-1)        # cumsum (B, V) float64


def inverse_cdf(c, u):
    """Indices (B, M) of the tokens that uniforms u (B, M) select in cumulative masses c (B, V):
    the first v with c[v] > u c[-1]."""
    x = u * c[:, -1:]                                                  # (B, M)
    # below the total, so the search lands on a token of positive mass (u x total may round up)
    x = torch.minimum(x, torch.nextafter(c[:, -1:], torch.zeros_like(c[:, -1:])))
    # first index whose cumulative mass exceeds x: tokens of probability 0 are never chosen
    return torch.searchsorted(c, x, right=True)


def _row_keys(keys, n: int, device):
    """(n,) int64 row keys on the device: the given ones, or the row index."""
    if keys is None:
        return torch.arange(n, device=device)
    keys = torch.as_tensor(keys, dtype=torch.long, device=device)
    if keys.shape != (n,):
        raise ValueError(f"keys: expected one per prompt ({n}), got shape {tuple(keys.shape)}")
    return keys


def left_pad(prompts: list, pad_id: int, device):
    """(ids (B, P), mask (B, P)) with each prompt right-aligned."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p):] = 1
    return ids.to(device), mask.to(device)


def _limits(prompts: list, max_new_tokens) -> np.ndarray:
    """(B,) max_new_tokens per prompt, checked."""
    B = len(prompts)
    one = np.ndim(max_new_tokens) == 0
    limits = np.full(B, int(max_new_tokens)) if one else np.asarray(list(max_new_tokens), dtype=np.int64)
    if B == 0 or limits.shape != (B,) or limits.min() < 1 or min(map(len, prompts)) < 1:
        raise ValueError("generate needs at least one prompt, none empty, and max_new_tokens >= 1 "
                         "(one int, or one per prompt)")
    return limits.astype(np.int64)


def _cache_kwarg(model) -> str:
    return _cache_kwarg_of(type(model))


@functools.lru_cache
def _cache_kwarg_of(model_class) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` (the old name warns until 5.40)
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model):
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


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


def memory_plan(policy, kv_budget: int, args) -> str:
    """One line of memory: weights, trainable weights with AdamW states, the KV budget and the
    rows it holds at the length limits, and the training micro-batch; a user sees at once
    whether the run fits. On CUDA it also gives the numbers behind the default budget: the free
    memory after loading, KV_FRACTION of it for the cache, and what the rest must hold while
    the cache lives (the AdamW states, made at the first update, and the decode's logits). The
    cache lives only inside a generate call, so the update has all the free memory. The prompt
    length is the limit, else the longest prompt expected: an aggregator's three clipped
    solutions plus ~512 tokens of instruction and problem."""
    a, p = args, policy
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    weights = sum(t.numel() * t.element_size() for t in p.model.parameters())
    trainable = sum(t.numel() for n in p.names for t in p.parameters_of(n))
    cfg, size = p.model.config, next(p.model.parameters()).element_size()
    per_tok = kv_bytes_per_token(cfg, next(p.model.parameters()).dtype)
    prompt = a.max_prompt_tokens or 3 * (a.max_embed_tokens or a.max_new_tokens) + 512
    logits = a.token_budget * cfg.vocab_size * 2 * size        # the logits and their gradient
    acts = a.token_budget * cfg.num_hidden_layers * cfg.hidden_size * size
    rows = rows_that_fit(kv_budget, per_tok, prompt + a.max_new_tokens)
    device = next(p.model.parameters()).device
    why = ""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        share = "--kv-budget-gb" if a.kv_budget_gb else f"{KV_FRACTION:g} of it"
        why = (f" | free after loading {gib(free)}: KV {share}, beside it AdamW {gib(16 * trainable)} + "
               f"decode logits {gib(rows * cfg.vocab_size * 4)} = {gib(kv_budget + 16 * trainable + rows * cfg.vocab_size * 4)}")
    return (f"memory: weights {gib(weights)} | trainable {trainable / 1e6:.1f}M x 16 B (fp32 + grad + AdamW) "
            f"{gib(16 * trainable)} | {kv_budget_line(kv_budget, per_tok, prompt, a.max_new_tokens)} "
            f"({per_tok / 1024:.0f} KiB a token){why} | micro-batch {a.token_budget} tokens: logits + grad {gib(logits)}, "
            f"layer inputs {gib(acts)}{' (checkpointed)' if p.checkpointing else ' + every activation'}")


def _row_count(rows: int, need: int, bytes_per_token: int, kv_budget, max_rows) -> int:
    """Cache rows the call holds: every row, capped by max_rows and by what the budget holds."""
    held = rows if max_rows is None else max(1, min(rows, max_rows))
    if kv_budget is not None:
        fit = rows_that_fit(kv_budget, bytes_per_token, need)
        if fit < 1:
            raise ValueError(f"kv_budget {int(kv_budget):,} B is smaller than one row's need: {need} tokens "
                             f"(prompt + max_new_tokens) x {bytes_per_token:,} B per token = "
                             f"{need * bytes_per_token:,} B")
        held = min(held, fit)
    return held


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
    (n, 1, 1, W) bool mask (True: attended). Longer queries (prefill) go to transformers' SDPA
    function as they are. Returns ((n, 1, Hq, D), None), the attention functions' contract."""
    if query.shape[2] != 1:
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
class _Plan:
    """Where the forward in progress writes; one object shared by every layer of the cache."""
    span: torch.Tensor            # (L,) arange over a row's columns
    ids: torch.Tensor             # (S,) arange over the cache rows
    prefill: bool = False
    rows: int = 0                 # decode: the step runs the first `rows` cache rows
    width: int = 0                # decode: the columns its widest row group attends
    at: torch.Tensor = None       # decode: (rows,) the column each row writes (its position)
    dst: torch.Tensor = None      # prefill: (N, 1) the cache row of each newcomer
    src: torch.Tensor = None      # prefill: (N,) its row in the prefill batch
    cols: torch.Tensor = None     # prefill: (N, P) the column each padded position goes to


class _RowLayer(DynamicLayer):
    """One layer's K and V for S rows of L columns, (S, H, L, D) each, written in place."""

    def __init__(self, keys, values, plan: _Plan):
        super().__init__()
        self.keys, self.values, self.plan = keys, values, plan
        self.is_initialized = True

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.plan.width

    def update(self, key_states, value_states, *args, **kwargs):
        p = self.plan
        if p.prefill:  # (U, H, P, D), left-padded: newcomer k's prompt into columns [0, len) of its row
            self.keys[p.dst, :, p.cols] = key_states[p.src].transpose(1, 2)       # (N, P, H, D)
            self.values[p.dst, :, p.cols] = value_states[p.src].transpose(1, 2)
            return key_states, value_states
        n = p.rows             # (n, H, D): each row at its own column, one indexed write
        self.keys[p.ids[:n], :, p.at], self.values[p.ids[:n], :, p.at] = key_states[:, :, 0], value_states[:, :, 0]
        return self.keys[:n, :, :p.width], self.values[:n, :, :p.width]         # (n, H, W, D)


def _row_cache(model, rows: int, length: int):
    """A cache of `rows` x `length` columns per layer, zero-filled: masked columns are still
    multiplied by a zero weight in attention, and uninitialised memory may hold NaN
    (0 x NaN = NaN), so every column must hold a finite number."""
    cfg, dev = model.config, next(model.parameters()).device
    heads, head_dim = _kv_heads_and_dim(cfg)
    cache = _new_cache(model)
    if any(type(layer) is not DynamicLayer for layer in getattr(cache, "layers", [])):
        raise NotImplementedError("generate supports full-attention models only (no sliding-window layers)")
    plan = _Plan(span=torch.arange(length, device=dev), ids=torch.arange(rows, device=dev))
    shape = (rows, heads, length, head_dim)
    cache.layers = [_RowLayer(torch.zeros(shape, dtype=model.dtype, device=dev),
                              torch.zeros(shape, dtype=model.dtype, device=dev), plan)
                    for _ in range(cfg.num_hidden_layers)]
    return cache, plan


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


# ----------------------------------------------------------------------------- the rows in flight

ROW, MADE, POS, LIMIT, BUSY, PID = range(6)  # counters of a cache row: rows of _Rows.h (the first 4 of _Rows.d)


@dataclass
class _Rows:
    """The S cache rows of a generate call and what each holds. The host's counters decide the
    schedule (which rows are free, how wide each is) without reading the device; the device
    keeps its own and advances them itself after each sample, so no step waits for the host.
    They agree, except that the host learns of a stop id up to 2 x STOP_EVERY steps late
    (_StopCheck) and counts the row as running until then (its width is only overestimated).
    Rows in flight sit first, widest first (_arrange), so a row group holds rows of about one
    width; every busy row grows by one column a step, so the order holds between refills."""
    h: np.ndarray                # (6, S) int64 on the host: h[ROW], h[MADE], h[POS], h[LIMIT], h[BUSY], h[PID]
    d: torch.Tensor              # (4, S) long on the device: d[ROW], d[MADE], d[POS], d[LIMIT]
    live: torch.Tensor           # (S,) bool on the device: the row has neither stopped nor reached its limit
    tok: torch.Tensor            # (S,) long: the token each row feeds next (a CUDA graph reads it)
    spare: int                   # the output row that rows which have ended write to (B)
    n: int = 0                   # rows a decode step runs: the first n, n a row bucket
    logits: torch.Tensor = None  # (S, V) fp32: each row's next-token logits (a CUDA graph writes them)

    # views of the rows of `h`: `st.made[free] = 0` writes into h[MADE]
    row = property(lambda self: self.h[ROW])      # (S,) output row held, `spare` when free
    made = property(lambda self: self.h[MADE])    # (S,) tokens sampled so far
    pos = property(lambda self: self.h[POS])      # (S,) column (= position) of the last sampled token
    limit = property(lambda self: self.h[LIMIT])  # (S,) the row's max_new_tokens
    busy = property(lambda self: self.h[BUSY])    # (S,) 1 while the host counts the row as running
    pid = property(lambda self: self.h[PID])      # (S,) distinct prompt whose K/V columns [0, len) hold, -1 none

    @classmethod
    def empty(cls, S: int, spare: int, device):
        h = np.zeros((6, S), dtype=np.int64)
        h[ROW], h[PID] = spare, -1
        d = torch.zeros((4, S), dtype=torch.long, device=device)
        d[ROW] = spare
        return cls(h=h, d=d, live=torch.zeros(S, dtype=torch.bool, device=device),
                   tok=torch.zeros(S, dtype=torch.long, device=device), spare=spare)


@dataclass
class _Job:
    """One generate call: the prompts, their limits, the queue and the outputs being filled."""
    prompts: list
    limits: np.ndarray    # (B,) max_new_tokens per prompt
    pids: list            # (B,) distinct-prompt id of each prompt (prefix sharing)
    queue: deque          # prompt indices not yet admitted, identical prompts adjacent
    waiting: Counter      # distinct-prompt id -> copies still in the queue
    first: dict           # distinct-prompt id -> (V,) logits of its first token, while copies wait
    keys: torch.Tensor    # (B+1,) int64 key of each prompt's draws; the spare row's is 0
    tokens: torch.Tensor  # (B+1, T+1) ids; row B and column T take the writes of rows that ended
    logps: torch.Tensor   # (B+1, T+1) fp32
    length: torch.Tensor  # (B+1,) long: tokens kept, the stop token included
    finished: torch.Tensor  # (B+1,) bool: emitted a stop id
    pad_id: int


def _new_job(prompts, limits, pad_id, share_prefix, keys, device) -> _Job:
    ids = {}
    same = [ids.setdefault(tuple(p), len(ids)) for p in prompts]  # (B,) id of each distinct prompt
    pids = same if share_prefix else list(range(len(prompts)))
    B, T = len(prompts), int(limits.max())
    # identical prompts queue side by side (whether shared or not, so both run the same schedule)
    queue = deque(sorted(range(B), key=lambda i: (same[i], i)))
    return _Job(prompts=prompts, limits=limits, pids=pids, queue=queue, waiting=Counter(pids), first={},
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


def _groups(st: _Rows, length: int) -> tuple:
    """((start, end, w), ...): the step's n rows cut into up to ATTN_GROUPS runs of equal size
    (at least GROUP_ROWS rows), each attending its widest busy row's columns rounded up to
    WIDTH_BUCKET (at most `length`); neighbouring runs of one width merge. Rows sit widest
    first, so a short row is attended with rows about as short, and a step costs about the
    sum of its rows' own widths."""
    n, kind = st.n, "cuda" if st.d.device.type == "cuda" else "cpu"
    width = (st.pos[:n] + 1) * st.busy[:n]               # (n,) host counters: no sync
    size, bucket = max(-(-n // ATTN_GROUPS), GROUP_ROWS[kind]), WIDTH_BUCKET[kind]
    out = []
    for a in range(0, n, size):
        b = min(a + size, n)
        w = min(length, max(1, -(-int(width[a:b].max()) // bucket)) * bucket)
        if out and out[-1][2] == w:
            out[-1] = (out[-1][0], b, w)
        else:
            out.append((a, b, w))
    return tuple(out)


# ----------------------------------------------------------------------------- the schedule

def _arrange(cache, st: _Rows, lens: np.ndarray) -> np.ndarray:
    """Reorder the cache rows: the rows in flight and the newcomers (prompt lengths `lens`) by
    width, widest first, then the free rows (those keeping no prompt first, so newcomers take
    them). Return the row each newcomer goes to; st.n becomes the bucket of the busy rows."""
    S = len(st.busy)
    busy, free = np.flatnonzero(st.busy), np.flatnonzero(st.busy == 0)
    free = free[np.argsort(st.pid[free] >= 0, kind="stable")]
    order = np.argsort(-np.concatenate([st.pos[busy] + 1, lens]), kind="stable")  # ties: rows in flight first
    perm, at, spare = np.empty(S, dtype=np.int64), np.empty(len(lens), dtype=np.int64), iter(free)
    for j, e in enumerate(order):
        if e < len(busy):
            perm[j] = busy[e]
        else:
            perm[j] = next(spare)
            at[e - len(busy)] = j
    perm[len(order):] = list(spare)
    _move(cache, st, perm)
    st.n = _row_bucket(len(order), S)
    return at


def _move(cache, st: _Rows, perm: np.ndarray) -> None:
    """Row perm[j] becomes row j: the K/V of the rows that hold something (in flight, or a prompt
    kept for a later copy) up to the widest of them, and every counter."""
    if (perm == np.arange(len(perm))).all():
        return
    keep = (perm != np.arange(len(perm))) & ((st.busy[perm] == 1) | (st.pid[perm] >= 0))
    moved = np.flatnonzero(keep)
    if len(moved):
        _copy_rows(cache, moved, perm[moved], int(st.pos[perm[moved]].max()) + 1)
    p = _to(perm, st.d.device)
    for t in (st.live, st.tok, *([st.logits] if st.logits is not None else [])):
        t.copy_(t[p])                # in place: a CUDA graph holds these buffers
    st.d.copy_(st.d[:, p])
    st.h = st.h[:, perm]


def _refill(model, cache, plan, st: _Rows, job: _Job, counts) -> bool:
    """Give free rows to the next waiting prompts, once REFILL_AT of the rows are free (or every
    waiting prompt fits): sort them in among the rows in flight, put their prompts' K/V in place
    and their first logits in st.logits, and set their counters on both sides."""
    free = int((st.busy == 0).sum())
    if not job.queue or free < min(math.ceil(REFILL_AT * len(st.busy)), len(job.queue)):
        return False
    rows = np.array([job.queue.popleft() for _ in range(min(free, len(job.queue)))])
    lens = np.array([len(job.prompts[r]) for r in rows])
    at = _arrange(cache, st, lens)
    logits = _first_logits(model, cache, plan, st, job, at, rows, counts)     # (N, V)
    if st.logits is None:
        st.logits = logits.new_zeros((len(st.busy), logits.shape[1]))        # (S, V)
    dev, limits, t = st.d.device, job.limits[rows], _to(at, st.d.device)
    st.logits[t] = logits
    st.d[:, t] = _to(np.stack([rows, np.zeros_like(rows), lens - 1, limits]), dev)
    st.live[t] = True
    st.row[at], st.made[at], st.pos[at], st.limit[at] = rows, 0, lens - 1, limits   # pos: the prompt's last column
    st.busy[at], st.pid[at] = 1, np.asarray(job.pids)[rows]
    return True


def _schedule(model, cache, plan, st: _Rows, job: _Job, counts) -> None:
    """Before a step: admit waiting prompts (_refill); once none wait, pack the busy rows into
    a smaller row bucket as soon as they fit one."""
    if _refill(model, cache, plan, st, job, counts):
        return
    busy = int(st.busy.sum())
    if not job.queue and busy and _row_bucket(busy, len(st.busy)) < st.n:
        _arrange(cache, st, np.zeros(0, dtype=np.int64))


def _prefill(model, cache, plan, distinct: list, dst: list, src: list, pad_id: int):
    """Run the U `distinct` prompts through the model, left-padded, in chunks of at most
    PREFILL_TOKENS padded tokens (longest first); the K/V of distinct[src[k]] goes into columns
    [0, len) of cache row dst[k] (its pad positions to the last column, which no live row
    attends). Return the (U, V) fp32 logits of each prompt's first new token."""
    dev, L = plan.span.device, len(plan.span)
    chunks = [[]]
    for u in sorted(range(len(distinct)), key=lambda u: -len(distinct[u])):
        c = chunks[-1]
        if c and (len(c) + 1) * len(distinct[c[0]]) > PREFILL_TOKENS:
            chunks.append(c := [])
        c.append(u)
    dst, src = np.asarray(dst), np.asarray(src)
    logits = [None] * len(distinct)
    for chunk in chunks:
        ids, mask = left_pad([distinct[u] for u in chunk], pad_id, dev)    # (U', P)
        P, sel, where = ids.shape[1], np.flatnonzero(np.isin(src, chunk)), {u: i for i, u in enumerate(chunk)}
        lens = np.array([len(distinct[u]) for u in src[sel]])
        cols = np.arange(P)[None, :] - (P - lens)[:, None]                 # (N, P): padded position -> column
        plan.prefill, plan.width = True, 0
        plan.dst, plan.cols = _to(dst[sel][:, None], dev), _to(np.where(cols < 0, L - 1, cols), dev)
        plan.src = _to(np.array([where[u] for u in src[sel]]), dev)
        res = model(input_ids=ids, attention_mask=_prefill_mask(mask), position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    use_cache=True, logits_to_keep=1, **{_cache_kwarg(model): cache})
        for i, u in enumerate(chunk):
            logits[u] = res.logits[i, -1].float()
    plan.prefill = False
    return torch.stack(logits)


def _copy_rows(cache, dst, src, width: int) -> None:
    """Copy the first `width` columns of cache rows `src` into rows `dst` (host index arrays;
    gathered before written, so a row may be both a source and a destination)."""
    dev = cache.layers[0].keys.device
    d, s = _to(np.asarray(dst), dev), _to(np.asarray(src), dev)
    for layer in cache.layers:
        layer.keys[d, :, :width] = layer.keys[s, :, :width]        # (N, H, width, D)
        layer.values[d, :, :width] = layer.values[s, :, :width]


def _first_logits(model, cache, plan, st: _Rows, job: _Job, at, rows, counts):
    """(N, V) logits of each newcomer's first token, its prompt's K/V put in columns [0, len) of
    its cache row at[k]: copied from a row that holds the same prompt (whose first logits were
    kept while copies waited), else prefilled, each distinct prompt once."""
    pids = [job.pids[r] for r in rows]
    held = {q: i for i, q in enumerate(st.pid.tolist()) if q >= 0}  # distinct prompt -> a row with its K/V
    copy = [k for k, q in enumerate(pids) if q in held and q in job.first]
    out = [None] * len(rows)
    if copy:  # before the prefill, which may overwrite a holder
        _copy_rows(cache, [at[k] for k in copy], [held[pids[k]] for k in copy],
                      max(len(job.prompts[rows[k]]) for k in copy))
        for k in copy:
            out[k] = job.first[pids[k]]
    fresh = [k for k in range(len(rows)) if out[k] is None]
    if fresh:
        u = {q: i for i, q in enumerate(dict.fromkeys(pids[k] for k in fresh))}  # distinct prompts
        prompt = [None] * len(u)
        for k in fresh:
            prompt[u[pids[k]]] = job.prompts[rows[k]]
        first = _prefill(model, cache, plan, prompt, [at[k] for k in fresh], [u[pids[k]] for k in fresh],
                         job.pad_id)                                             # (U, V)
        counts["prefill_rows"] += len(u)
        for k in fresh:
            out[k] = first[u[pids[k]]]
    _keep_first_logits(job, pids, out)
    return torch.stack(out)                                                       # (N, V)


def _keep_first_logits(job: _Job, pids: list, out: list) -> None:
    """Keep a prompt's first logits while copies of it still wait in the queue."""
    for q, c in Counter(pids).items():
        job.waiting[q] -= c
        if job.waiting[q] == 0:
            job.first.pop(q, None)
        elif q not in job.first:
            job.first[q] = out[pids.index(q)].clone()


# ----------------------------------------------------------------------------- the decode step

def _sample(st: _Rows, job: _Job, seed: int, temperature: float, top_p: float, stops) -> None:
    """Sample the next token of the step's n rows from st.logits and move the live rows on, all
    on the device: record the token and its logprob, count it, and end the row at a stop id
    (the stop token kept: the policy chose it) or at its limit. Rows that have ended write to
    the spare output row and stay where they are. No host sync."""
    n = st.n
    row, made, pos, limit, live = st.d[ROW, :n], st.d[MADE, :n], st.d[POS, :n], st.d[LIMIT, :n], st.live[:n]
    u = seeds.uniforms(seed, job.keys[row], made) if temperature > 0 else None    # (n,) float64
    tok, lp = sample_next(st.logits[:n], temperature, top_p, u)                     # (n,)
    at = torch.where(live, row, st.spare)                                            # (n,) output row
    job.tokens[at, made], job.logps[at, made] = tok, lp
    hit = live & torch.isin(tok, stops)
    made += live                                 # in place: the counters are buffers a CUDA graph reads
    pos += live
    job.length[at], job.finished[at] = made, hit
    live &= ~hit & (made < limit)
    st.tok[:n] = tok


class _StopCheck:
    """What the host learns of stop ids: every STOP_EVERY steps it reads the copy of the device's
    ended rows made STOP_EVERY steps before, then starts the next copy without blocking (into
    pinned memory on CUDA). So it reads at most once every STOP_EVERY steps, and the copy it
    reads is long done: the decode steps in between never wait for the host."""

    def __init__(self, S: int, device):
        self.cuda = device.type == "cuda"
        self.host = torch.empty(S, dtype=torch.long, pin_memory=self.cuda)   # (S,) output rows that ended, -1 live
        self.event, self.pending, self.steps = None, False, 0

    def __call__(self, st: _Rows):
        """The output rows that had ended (stop id or limit) at the last copy, or None."""
        self.steps += 1
        if self.steps % STOP_EVERY:
            return None
        ended = None
        if self.pending:
            if self.event is not None:
                self.event.synchronize()
            ended = self.host.numpy().copy()       # copied: the buffer is written again below
        self.host.copy_(torch.where(st.live, -1, st.d[ROW]), non_blocking=True)
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
    st.h[[MADE, POS]] += st.busy
    done = (st.busy == 1) & (st.made >= st.limit)
    if ended is not None:
        done |= (st.busy == 1) & np.isin(st.row, ended)
    st.row[done], st.busy[done] = st.spare, 0


class _Decoder:
    """The forward of a decode step over the first n cache rows: every row feeds st.tok at its
    column st.d[POS] (= its position), writes its K/V there, and row group (a, b, w) attends its
    first w columns; the next-token logits land in st.logits. Its inputs are buffers written in
    place (tokens, positions, the cache), the mask is built inside from the positions, and
    nothing in it reads the device, so on CUDA it is captured as a CUDA graph once per (n,
    groups) and replayed; a generate call runs one adapter, so a graph belongs to one adapter.
    If a capture fails, the call decodes eagerly and the reason is printed once."""

    def __init__(self, model, cache, plan: _Plan, st: _Rows, graphs: bool):
        self.model, self.cache, self.plan, self.st = model, cache, plan, st
        self.graphs, self.pool, self.cache_kw = ({} if graphs else None), None, _cache_kwarg(model)

    def forward(self, n: int, groups: tuple) -> None:
        st, p = self.st, self.plan
        pos = st.d[POS, :n]                                          # (n,) column of the token fed
        p.rows, p.width, p.at = n, max(w for _, _, w in groups), pos
        mask = (p.span[:p.width] <= pos[:, None])[:, None, None]     # (n, 1, 1, W): each row its own columns
        out = self.model(input_ids=st.tok[:n, None], attention_mask=mask, position_ids=pos[:, None], use_cache=True,
                         row_groups=groups, **{self.cache_kw: self.cache})
        st.logits[:n] = out.logits[:, -1]                            # (n, V) fp32

    def __call__(self, n: int, groups: tuple) -> None:
        if self.graphs is None:
            return self.forward(n, groups)
        graph = self.graphs.get((n, groups))
        if graph is None:
            graph = self._capture(n, groups)                         # its warm-up ran this step
            if self.graphs is not None:
                self.graphs[(n, groups)] = graph
            return
        graph.replay()

    def _capture(self, n: int, groups: tuple):
        """Run the step once on a side stream (lazy set-ups happen outside the capture), then
        capture it into a graph that shares one memory pool with the call's other graphs."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(n, groups)
        torch.cuda.current_stream().wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.forward(n, groups)
            self.pool = graph.pool()
            return graph
        except Exception as e:  # noqa: BLE001 - any failure: decode eagerly
            global _GRAPHS_REFUSED
            if not _GRAPHS_REFUSED:
                _GRAPHS_REFUSED = True
                print(f"rollout: no CUDA graph ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                      "decoding eagerly", file=sys.stderr)
            self.graphs = None
            torch.cuda.synchronize()


_GRAPHS_REFUSED = False  # a capture failed in this process (said once)


@torch.no_grad()  # not inference_mode: its tensors could not be reused by autograd later
def generate(model, prompts: list, max_new_tokens, stop_ids, pad_id: int,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, keys=None, share_prefix: bool = True,
             kv_budget: int | None = None, max_rows: int | None = None, stats: dict | None = None,
             cuda_graphs: bool = True) -> Generation:
    """Sample a completion for every prompt (a list of token-id lists). `max_new_tokens`: one
    limit, or one per prompt. Row i's token t is drawn with seeds.uniforms(seed, keys[i], t),
    as in generate_simple, so what a row samples does not depend on the cache row it gets or on
    which rows share the call. At most `kv_budget` bytes of KV cache (None: every row at once)
    and `max_rows` rows are held. `cuda_graphs`: replay decode steps from CUDA graphs on a CUDA
    device. `stats`, a dict, gets prefill_rows (prompts run through a prefill) and decode_steps
    added, and kv_bytes (cache tensors held) and rows (rows held at once) raised to this call's."""
    limits = _limits(prompts, max_new_tokens)
    dev = next(model.parameters()).device
    need = max(len(p) + int(t) for p, t in zip(prompts, limits))  # columns of the longest row
    S = _row_count(len(prompts), need, kv_bytes_per_token(model.config, model.dtype), kv_budget, max_rows)
    cache, plan = _row_cache(model, S, need)
    job = _new_job(prompts, limits, pad_id, share_prefix, _row_keys(keys, len(prompts), dev), dev)
    st = _Rows.empty(S, spare=len(prompts), device=dev)
    decode, check = _Decoder(model, cache, plan, st, cuda_graphs and dev.type == "cuda"), _StopCheck(S, dev)
    stops = torch.tensor(sorted(set(stop_ids)), device=dev)
    counts = Counter(prefill_rows=0, decode_steps=0)
    with _row_attention(model):
        while True:
            _schedule(model, cache, plan, st, job, counts)
            if not st.busy.any():
                break
            _sample(st, job, seed, temperature, top_p, stops)
            _retire(st, check(st))
            if st.busy.any():
                decode(st.n, _groups(st, need))
                counts["decode_steps"] += 1
    if stats is not None:
        for k, v in counts.items():
            stats[k] = stats.get(k, 0) + v
        stats["kv_bytes"] = max(stats.get("kv_bytes", 0), cache_bytes(cache))
        stats["rows"] = max(stats.get("rows", 0), S)
    out = _output(job)
    if dev.type == "cuda":  # the cache and the graphs' pool go back before the update runs
        del cache, decode, st, plan
        torch.cuda.empty_cache()
    return out


def _output(job: _Job) -> Generation:
    B = len(job.prompts)
    T = int(job.length[:B].max())            # the one read of the device after the loop
    mask = torch.arange(T, device=job.length.device) < job.length[:B, None]   # (B, T), the stop token included
    return Generation(job.tokens[:B, :T], job.logps[:B, :T], mask, job.finished[:B].clone())


# ----------------------------------------------------------------------------- workflow llm

def render(tokenizer, messages, max_prompt_tokens: int | None = None) -> tuple[list, bool]:
    """Prompt ids of a chat (generation prompt added, Qwen3 thinking disabled) and whether it
    was cut: an over-long prompt keeps its last `max_prompt_tokens` ids, so the generation
    prompt and the newest text (the solutions to judge) survive."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=False)  # ignored by templates without it
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        return ids[-max_prompt_tokens:], True
    return ids, False


def make_clip(tokenizer, max_tokens: int | None):
    """`clip(text) -> text` that keeps at most `max_tokens` tokens of a text embedded in a
    later prompt: its first quarter and its last three quarters (where a final answer or the
    code block usually is), joined by a line saying how much was cut. None: no limit."""
    def clip(text: str) -> str:
        if not max_tokens:
            return text
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_tokens:
            return text
        head = max_tokens // 4
        return (tokenizer.decode(ids[:head]) + f"\n[... {len(ids) - max_tokens} tokens cut ...]\n"
                + tokenizer.decode(ids[len(ids) - (max_tokens - head):]))
    return clip


def make_llm(policy, *, temperature: float = 0.7, top_p: float = 1.0, max_new_tokens: int = 512,
             max_prompt_tokens: int | None = None, seed: int = 0, max_rows: int | None = None,
             kv_budget: int | None = None, max_embed_tokens: int | None = None, sampler: str = "fast",
             cuda_graphs: bool = True):
    """The `llm(role, slots, messages_list, keys=None) -> list[Call]` that workflows.py calls
    once per stage.

    `keys` names each row (workflows.stage passes its episode's stream, problem id and rollout
    and the call's index in the episode); its draws come from seeds.uniforms(seed, key(row),
    position), so a row samples the same tokens whatever else is in the stage. Without keys a
    row is named by the llm's call count and its index in the call. Every call of a stage goes
    to the adapter of its role in one `generate`, which holds at most `kv_budget` bytes of KV
    cache and `max_rows` rows at once (continuous batching; identical prompts still share
    their prefill), and is recorded as a Call with its prompt ids,
    completion ids (stop token included), sampler logprobs and finished flag; the text is the
    decoded completion without special tokens. `llm.stats` counts calls and cut prompts per
    role, plus the sampler's counters (see `generate`). `sampler="simple"` runs
    generate_simple instead (every row of a stage at once, no budget); its draws are keyed
    the same way, so it samples the same tokens. `cuda_graphs`: see `generate`."""
    if sampler not in ("fast", "simple"):
        raise ValueError(f"sampler must be fast or simple, got {sampler!r}")
    tok = policy.tokenizer
    stops = policies.stop_ids(policy.model, tok)
    stats, made = {}, [0]

    def llm(role, slots, messages_list, keys=None):
        rendered = [render(tok, m, max_prompt_tokens) for m in messages_list]
        prompts = [ids for ids, _ in rendered]
        made[0] += 1
        keys = keys if keys is not None else [("call", made[0], i) for i in range(len(prompts))]
        row_keys = [seeds.key(*k) if isinstance(k, tuple) else seeds.key(k) for k in keys]
        s = stats.setdefault(role, {"calls": 0, "prompt_cut": 0})
        s["calls"] += len(prompts)
        s["prompt_cut"] += sum(cut for _, cut in rendered)
        with torch.no_grad(), policy.inference(policy.adapter(role)) as model:
            if sampler == "simple":
                out = generate_simple(model, prompts, max_new_tokens, stops, tok.pad_token_id,
                                      temperature=temperature, top_p=top_p, seed=seed, keys=row_keys)
            else:
                out = generate(model, prompts, max_new_tokens, stops, tok.pad_token_id, temperature=temperature,
                               top_p=top_p, seed=seed, keys=row_keys, kv_budget=kv_budget, max_rows=max_rows,
                               stats=s, cuda_graphs=cuda_graphs)
        calls = []
        for i, ids in enumerate(prompts):
            keep = out.mask[i]
            comp = out.tokens[i][keep].tolist()
            calls.append(Call(role=role, slot=slots[i], messages=messages_list[i],
                              text=tok.decode(comp, skip_special_tokens=True), prompt_ids=ids,
                              completion_ids=comp, logprobs=out.logprobs[i][keep].tolist(),
                              finished=bool(out.finished[i])))
        return calls

    llm.stats = stats
    llm.clip = make_clip(tok, max_embed_tokens)   # workflows.py shortens embedded texts with it
    return llm


def run_episodes(llm, workflow: str, problems: list, group_size: int, task: str, stream: tuple = (),
                 **params) -> list:
    """Run `workflow` on every problem `group_size` times; return the Episodes (calls and final
    text filled in, rewards not yet). `stream` names what the episodes' draws are for, e.g.
    ("train", step) or ("eval", step): with the problem, the rollout and the call, it keys
    every row's random numbers."""
    episodes = [Episode(problem=p, rollout=g, stream=tuple(stream)) for p in problems for g in range(group_size)]
    run_workflow(workflow, episodes, llm, task, **params)
    return episodes
