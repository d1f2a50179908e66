"""Rollout: the sampler, and the `llm` that runs workflow stages through it.

The module opens with `generate_simple`, the plain reference sampler: every prompt left-padded
into one batch and one ordinary DynamicCache, every row stepping together until all have ended.
`generate`, further down, is the fast version (continuous batching in a KV budget), tested
against it in tests/test_sampler.py: the same tokens, logprobs, masks and finished flags.

Both sample one completion per token-id prompt:
- row i's token t is drawn with the uniform seeds.uniforms(seed, keys[i], t), by inverse CDF
  over float64 probabilities (the exact distribution to float64 rounding), so what a row
  samples depends on its key and nothing else: not on its slot, the KV budget, the rows beside
  it or the rank it runs on. make_llm keys a row by (stream, problem, rollout, call);
- logits are divided by the temperature and upcast to fp32 before the log-softmax; the
  returned logprob of a token is under that temperature-scaled distribution (top-p only
  narrows which tokens can be drawn; with top_p=1, the paper's setting, it is exactly the
  distribution sampled from, and what grpo.py recomputes). temperature=0 is greedy, and its
  logprobs are then under the unscaled (T=1) distribution;
- a row stops at the first of any stop id (Qwen3 has two) or at its own max_new_tokens; the stop
  token is kept with mask 1, later positions are pad with mask 0; `finished` is False for rows
  cut at their limit. Outputs are per prompt, in input order, whatever order rows ran in.

How `generate`'s rows share memory (fixed slots, chosen for plain torch + Hugging Face models):
- the call holds S slots, each with room for the longest row (L = max prompt + max_new_tokens
  columns): per layer one K and one V buffer (S, kv_heads, L, head_dim), zero-filled once.
  S = what `kv_budget` bytes hold (None: every row at once), capped by `max_rows`. Slots, not
  pages: attention in transformers wants each row's K/V as one dense tensor, and gathering
  pages into one every step would copy the whole cache per token. The price: a slot is sized
  for the worst case, so a budget holds budget / (L x bytes per token) rows, however short
  they turn out.
- a newcomer's prompt is written left-padded to its prefill chunk's length P, so its tokens sit
  at columns pad, pad+1, ... of its slot and its position id is column - pad (the trainer's
  `cumsum(mask) - 1`). A decode step writes every row's new K/V at its own column (one indexed
  write per layer, no Python loop over rows; a plain slice write while every slot shares one
  column, as rows admitted together do) and attends columns [0, W], W the furthest column of
  a busy slot (one holding a row that has not ended); the 2-D attention mask
  `pad <= column <= own column` hides the rest, and is always passed. A chunk never pads a
  prompt past the room its limit leaves in the slot.
- when a row stops, its slot goes to the next waiting prompt. Newcomers are prefilled together
  through the same cache object, whose update writes their K/V straight into their slots (no
  second cache). They are admitted once REFILL_AT (1/16) of the slots are free: a prefill
  forward of a few rows costs about as much as a decode step (on a GPU both are bound by
  reading every weight once), so refilling one row at a time would add a forward to most
  steps, while waiting for 1/16 keeps the batch >= 15/16 full. Once the queue is empty the
  batch shrinks to the busy slots each time they fall to half.
- identical prompts are prefilled once: copies in one prefill share a row, and a copy admitted
  later copies the prompt's K/V from a slot that holds it (free slots keep theirs: they write
  at column L-1, which no prompt reaches) and reuses the saved logits of its first token; each
  row still samples its own first token.
- one host sync per decode step (which rows hit a stop id); the host decides everything else
  from its own counters (`_Slots`, one packed array named row by row: ROW, MADE, POS, BUSY,
  PAD). The refill phase loops over the rows that just ended.

CUDA graphs are not captured: the decode step's shapes change every step (the attended width
W grows, the batch shrinks) and transformers builds the mask and walks the cache in Python, so
capturing would need a static window (all L columns every step, a fixed S) and torch.compile,
giving up the work that the growing window and the shrinking batch save.

Run `python bench/generate.py` to compare its speed with `model.generate` and with
`generate_simple` in lockstep batches.
"""
import functools
import inspect
import math
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

import seeds

CPU_KV_BUDGET = 4 * 2**30  # bytes of KV cache a generate call may hold on CPU by default
KV_FRACTION = 0.5          # share of free CUDA memory for the KV cache by default (the update
                           # needs the rest: activations, adapters and their AdamW states)
PREFILL_TOKENS = 32768     # padded prompt tokens per prefill forward (bounds its activations)
REFILL_AT = 1 / 16         # admit newcomers once this share of the slots is free (see _refill)


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


def _slot_count(rows: int, need: int, bytes_per_token: int, kv_budget, max_rows) -> int:
    """Slots the call holds: every row, capped by max_rows and by what the budget holds."""
    slots = rows if max_rows is None else max(1, min(rows, max_rows))
    if kv_budget is not None:
        fit = rows_that_fit(kv_budget, bytes_per_token, need)
        if fit < 1:
            raise ValueError(f"kv_budget {int(kv_budget):,} B is smaller than one row's need: {need} tokens "
                             f"(prompt + max_new_tokens) x {bytes_per_token:,} B per token = "
                             f"{need * bytes_per_token:,} B")
        slots = min(slots, fit)
    return slots


# ----------------------------------------------------------------------------- the slot cache

@dataclass
class _Plan:
    """Where the forward in progress writes; one object shared by every layer of the cache."""
    span: torch.Tensor            # (L,) arange over a slot's columns
    ids: torch.Tensor             # (S,) arange over the slots
    prefill: bool = False
    width: int = 0                # cached columns before the forward's own (sizes HF's mask)
    rows: torch.Tensor = None     # decode: (n,) arange over the slots in the batch
    at: torch.Tensor = None       # decode: (n,) column each slot writes
    col: int | None = None        # decode: the column every slot writes, when they all share one
    slots: torch.Tensor = None    # prefill: (N,) slot of each newcomer
    src: torch.Tensor = None      # prefill: (N,) its row in the prefill batch


class _SlotLayer(DynamicLayer):
    """One layer's K and V for S slots of L columns, (S, H, L, D) each, written in place."""

    def __init__(self, keys, values, plan: _Plan):
        super().__init__()
        self.keys, self.values, self.plan = keys, values, plan
        self.is_initialized = True

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.plan.width  # HF sizes the mask as this + the forward's own tokens

    def update(self, key_states, value_states, *args, **kwargs):
        p = self.plan
        if p.prefill:  # (U, H, P, D), left-padded: each newcomer's row into columns [0, P) of its slot
            P = key_states.shape[-2]
            self.keys[p.slots, :, :P], self.values[p.slots, :, :P] = key_states[p.src], value_states[p.src]
            return key_states, value_states
        n, w = len(p.rows), p.width + 1
        if p.col is not None:  # every slot at one column: a plain slice write, no index tensors
            self.keys[:n, :, p.col], self.values[:n, :, p.col] = key_states[:, :, 0], value_states[:, :, 0]
        else:                  # (n, H, D): each row at its own column
            self.keys[p.rows, :, p.at], self.values[p.rows, :, p.at] = key_states[:, :, 0], value_states[:, :, 0]
        return self.keys[:n, :, :w], self.values[:n, :, :w]     # (n, H, W+1, D)


def _slot_cache(model, slots: int, length: int):
    """A cache of `slots` x `length` columns per layer, zero-filled: masked columns are still
    multiplied by a zero weight in attention, and uninitialised memory may hold NaN
    (0 x NaN = NaN), so every column must hold a finite number."""
    cfg, dev = model.config, next(model.parameters()).device
    heads, head_dim = _kv_heads_and_dim(cfg)
    cache = _new_cache(model)
    if any(type(layer) is not DynamicLayer for layer in getattr(cache, "layers", [])):
        raise NotImplementedError("generate supports full-attention models only (no sliding-window layers)")
    plan = _Plan(span=torch.arange(length, device=dev), ids=torch.arange(slots, device=dev))
    shape = (slots, heads, length, head_dim)
    cache.layers = [_SlotLayer(torch.zeros(shape, dtype=model.dtype, device=dev),
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


# ----------------------------------------------------------------------------- the decode batch

ROW, MADE, POS, BUSY, PAD = range(5)  # the counters of a slot: the rows of _Slots.h and of _Slots.dev


@dataclass
class _Slots:
    """The n slots of the decode batch. The host counters decide everything (no sync); `dev`
    is their copy on the device, for the step's writes. The counters are packed in one array,
    a row per counter (ROW, MADE, POS, BUSY, PAD), so that one copy takes them to the device."""
    h: np.ndarray                # (5, n) int64: h[ROW], h[MADE], h[POS], h[BUSY], h[PAD] (views below)
    limit: np.ndarray            # (n,) the row's max_new_tokens
    pid: np.ndarray              # (n,) distinct prompt whose K/V the slot's first columns hold, -1 none
    spare: int                   # the output row free slots write to (B, a row of no prompt)
    park: int                    # the column free slots write to (L-1, which no prompt reaches)
    dev: torch.Tensor = None     # (5, n) long: `h` on the device, indexed the same way
    tok: torch.Tensor = None     # (n,) the token each slot sampled last
    logits: torch.Tensor = None  # (n, V) fp32 logits of each slot's next token
    shared: np.ndarray = None    # on CPU: the `h` that `dev` shares memory with

    # views of the rows of `h`: `st.made[free] = 0` writes into h[MADE]
    row = property(lambda self: self.h[ROW])    # (n,) prompt index held, `spare` when free
    made = property(lambda self: self.h[MADE])  # (n,) tokens sampled so far
    pos = property(lambda self: self.h[POS])    # (n,) column of the last sampled token
    busy = property(lambda self: self.h[BUSY])  # (n,) 1 if the slot holds a row that has not ended
    pad = property(lambda self: self.h[PAD])    # (n,) columns before the prompt: position = column - pad

    @classmethod
    def empty(cls, n: int, spare: int, park: int):
        h = np.zeros((5, n), dtype=np.int64)
        h[ROW], h[POS] = spare, park
        return cls(h=h, limit=np.zeros(n, dtype=np.int64), pid=np.full(n, -1), spare=spare, park=park)

    def upload(self, device):
        """Copy the counters to the device without a sync (pinned memory on CUDA). On CPU the
        tensor shares `h`, so later changes to `h` show through without a copy."""
        if device.type == "cpu" and self.shared is self.h:
            return
        t = torch.from_numpy(self.h)
        self.dev = (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)
        self.shared = self.h if device.type == "cpu" else None

    def select(self, keep: np.ndarray, device):
        """Keep only the slots `keep` (in that order): the batch shrinks to them."""
        self.h, self.limit, self.pid = self.h[:, keep], self.limit[keep], self.pid[keep]
        k = torch.from_numpy(keep).to(device)
        self.tok, self.logits = self.tok[k], self.logits[k]
        self.upload(device)


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
    tokens: torch.Tensor  # (B+1, T) ids; row B is the spare row free slots write to
    logps: torch.Tensor   # (B+1, T) fp32
    length: np.ndarray    # (B,) tokens produced
    finished: np.ndarray  # (B,) bool, emitted a stop id
    pad_id: int


def _new_job(prompts, limits, pad_id, share_prefix, keys, device) -> _Job:
    ids = {}
    same = [ids.setdefault(tuple(p), len(ids)) for p in prompts]  # (B,) id of each distinct prompt
    pids = same if share_prefix else list(range(len(prompts)))
    B, T = len(prompts), int(limits.max())
    # identical prompts queue side by side (whether shared or not, so both run the same schedule)
    queue = deque(sorted(range(B), key=lambda i: (same[i], i)))
    return _Job(prompts=prompts, limits=limits, pids=pids, queue=queue, waiting=Counter(pids), first={},
                keys=torch.cat([keys, keys.new_zeros(1)]), tokens=torch.full((B + 1, T), pad_id, dtype=torch.long, device=device),
                logps=torch.zeros((B + 1, T), dtype=torch.float32, device=device),
                length=np.zeros(B, dtype=np.int64), finished=np.zeros(B, dtype=bool),
                pad_id=pad_id)


# ----------------------------------------------------------------------------- the steps

def _prefill(model, cache, plan, distinct: list, room: list, dst: list, src: list, pad_id: int):
    """Run the U `distinct` prompts through the model, left-padded, in chunks; the K/V of
    distinct[src[k]] goes straight into columns [0, P) of slot dst[k], P its chunk's padded
    length. A chunk holds at most PREFILL_TOKENS padded tokens and pads no prompt past its
    `room` (the columns its rows may fill before their new tokens). Return the (U, V) fp32
    logits of each prompt's first new token and the (U,) P of its chunk."""
    dev = plan.span.device
    chunks = [[]]
    for u in sorted(range(len(distinct)), key=lambda u: -len(distinct[u])):  # longest first
        c = chunks[-1]
        if c and ((len(c) + 1) * len(distinct[c[0]]) > PREFILL_TOKENS or len(distinct[c[0]]) > room[u]):
            chunks.append(c := [])
        c.append(u)
    dst, src = np.asarray(dst), np.asarray(src)
    logits, width = [None] * len(distinct), np.zeros(len(distinct), dtype=np.int64)
    for chunk in chunks:
        ids, mask = left_pad([distinct[u] for u in chunk], pad_id, dev)    # (U', P)
        sel = np.flatnonzero(np.isin(src, chunk))                          # newcomers of this chunk
        where = {u: i for i, u in enumerate(chunk)}
        plan.prefill, plan.width = True, 0
        plan.slots = torch.from_numpy(dst[sel]).to(dev)
        plan.src = torch.tensor([where[u] for u in src[sel]], device=dev)
        res = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    use_cache=True, logits_to_keep=1, **{_cache_kwarg(model): cache})
        for i, u in enumerate(chunk):
            logits[u], width[u] = res.logits[i, -1].float(), ids.shape[1]
    plan.prefill = False
    return torch.stack(logits), width


def _copy_prompts(cache, dst: list, src: list, width: int) -> None:
    """Copy the first `width` columns of slots `src` into slots `dst` (gathered before written,
    so a slot may be both a source and a destination)."""
    dev = cache.layers[0].keys.device
    d, s = torch.tensor(dst, device=dev), torch.tensor(src, device=dev)
    for layer in cache.layers:
        layer.keys[d, :, :width] = layer.keys[s, :, :width]        # (N, H, width, D)
        layer.values[d, :, :width] = layer.values[s, :, :width]


def _first_logits(model, cache, plan, st: _Slots, job: _Job, free, rows, counts):
    """(N, V) logits of each newcomer's first token and (N,) its pad, its prompt's K/V put in
    its slot: copied from a slot that holds the same prompt (whose first logits were kept while
    copies waited) when the newcomer's limit fits behind that slot's pad, else prefilled, each
    distinct prompt once."""
    L, N = len(plan.span), len(rows)
    pids, lens, limits = [job.pids[r] for r in rows], [len(job.prompts[r]) for r in rows], job.limits[rows]
    held = dict(zip(st.pid.tolist(), range(len(st.pid))))  # distinct prompt -> a slot with its K/V
    src = [held.get(q, -1) if q in job.first else -1 for q in pids]
    copy = [k for k in range(N) if src[k] >= 0 and st.pad[src[k]] + lens[k] + limits[k] <= L]
    out, pad = [None] * N, np.zeros(N, dtype=np.int64)
    if copy:  # before the prefill, which may overwrite a holder that was freed
        _copy_prompts(cache, [free[k] for k in copy], [src[k] for k in copy],
                      max(st.pad[src[k]] + lens[k] for k in copy))
        for k in copy:
            out[k], pad[k] = job.first[pids[k]], st.pad[src[k]]
    fresh = sorted(set(range(N)) - set(copy))
    if fresh:
        u = {q: i for i, q in enumerate(dict.fromkeys(pids[k] for k in fresh))}  # distinct prompts
        prompt, room = [None] * len(u), [L] * len(u)
        for k in fresh:
            prompt[u[pids[k]]] = job.prompts[rows[k]]
            room[u[pids[k]]] = min(room[u[pids[k]]], L - limits[k])
        first, width = _prefill(model, cache, plan, prompt, room, [free[k] for k in fresh],
                                [u[pids[k]] for k in fresh], job.pad_id)   # (U, V), (U,)
        counts["prefill_rows"] += len(u)
        for k in fresh:
            out[k], pad[k] = first[u[pids[k]]], width[u[pids[k]]] - lens[k]
    _keep_first_logits(job, pids, out)
    return torch.stack(out), pad                                              # (N, V), (N,)


def _keep_first_logits(job: _Job, pids: list, out: list) -> None:
    """Keep a prompt's first logits while copies of it still wait in the queue."""
    for q, c in Counter(pids).items():
        job.waiting[q] -= c
        if job.waiting[q] == 0:
            job.first.pop(q, None)
        elif q not in job.first:
            job.first[q] = out[pids.index(q)].clone()


def _refill(model, cache, plan, st: _Slots, job: _Job, counts) -> None:
    """Give the free slots to the next waiting prompts, once enough are free (REFILL_AT)."""
    if not job.queue:
        return
    free = np.flatnonzero(st.busy == 0)[: len(job.queue)]
    if len(free) < min(math.ceil(REFILL_AT * len(st.busy)), len(job.queue)):
        return
    dev = plan.span.device
    rows = np.array([job.queue.popleft() for _ in free])
    logits, pad = _first_logits(model, cache, plan, st, job, free, rows, counts)  # (N, V), (N,)
    if st.logits is None:
        st.logits = logits.new_zeros((len(st.busy), logits.shape[1]))         # (n, V)
        st.tok = torch.zeros(len(st.busy), dtype=torch.long, device=dev)
    st.logits[torch.from_numpy(free).to(dev)] = logits
    lens = np.array([len(job.prompts[r]) for r in rows])
    st.row[free], st.pad[free] = rows, pad
    st.made[free], st.busy[free] = 0, 1
    st.pos[free] = pad + lens - 1            # the column of the prompt's last token
    st.limit[free], st.pid[free] = job.limits[rows], np.asarray(job.pids)[rows]
    st.upload(dev)


def _retire(st: _Slots, job: _Job, hit: np.ndarray) -> None:
    """Free the slots whose row just ended (a stop id, or its limit). A free slot keeps
    writing, at column `park` (L-1), which no prompt reaches: its first columns keep the
    prompt's K/V, for a later copy of the same prompt."""
    ended = np.flatnonzero((st.busy == 1) & (hit | (st.made >= st.limit)))
    if len(ended):
        rows = st.row[ended]
        job.length[rows], job.finished[rows] = st.made[ended], hit[ended]
        st.row[ended], st.made[ended], st.pos[ended], st.busy[ended] = st.spare, 0, st.park, 0
        # st.pad is kept: it goes with the prompt's K/V, which the slot keeps


def _shrink(cache, st: _Slots, device) -> None:
    """Drop the free slots (the queue is empty): the busy slots' K/V move to the first slots, one
    layer at a time, so the copy in flight is one layer's busy slots, not a second cache."""
    keep = np.flatnonzero(st.busy)
    k = torch.from_numpy(keep).to(device)
    for layer in cache.layers:
        layer.keys[: len(keep)] = layer.keys[k]     # (m, H, L, D)
        layer.values[: len(keep)] = layer.values[k]
    st.select(keep, device)


def _decode(model, cache, plan, st: _Slots) -> torch.Tensor:
    """One forward over the batch: every slot feeds its last token at its own column and
    attends columns [0, W], W the furthest column of a busy slot; return the (n, V) fp32
    next-token logits."""
    pos, pad = st.dev[POS], st.dev[PAD]                     # (n,) column of the token fed, its pad
    plan.width = int((st.pos * st.busy).max())              # host counters: no sync
    same = st.busy.all() and st.pos.min() == st.pos.max()   # rows admitted together share columns
    plan.rows, plan.at, plan.col = plan.ids[: len(st.busy)], pos, int(st.pos[0]) if same else None
    # a row attends its own columns only; a free slot (parked past W) sees finite junk
    cols = plan.span[: plan.width + 1]
    attn = (cols >= pad[:, None]) & (cols <= pos[:, None])  # (n, W+1)
    res = model(input_ids=st.tok[:, None], attention_mask=attn, position_ids=(pos - pad)[:, None],
                use_cache=True, **{_cache_kwarg(model): cache})
    return res.logits[:, -1].float()                        # (n, V)


@torch.no_grad()  # not inference_mode: its tensors could not be reused by autograd later
def generate(model, prompts: list, max_new_tokens, stop_ids, pad_id: int,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, keys=None, share_prefix: bool = True,
             kv_budget: int | None = None, max_rows: int | None = None, stats: dict | None = None) -> Generation:
    """Sample a completion for every prompt (a list of token-id lists). `max_new_tokens`: one
    limit, or one per prompt. Row i's token t is drawn with seeds.uniforms(seed, keys[i], t),
    as in generate_simple, so what a row samples does not depend on the slot it gets or on
    which rows share the call. At most `kv_budget` bytes of KV cache (None: every row at once)
    and `max_rows` rows are held. `stats`, a dict, gets prefill_rows (prompts run through a
    prefill) and decode_steps added, and kv_bytes (cache tensors held) and slots (rows held at
    once) raised to this call's."""
    limits = _limits(prompts, max_new_tokens)
    dev = next(model.parameters()).device
    need = max(len(p) + int(t) for p, t in zip(prompts, limits))  # columns of the longest row
    S = _slot_count(len(prompts), need, kv_bytes_per_token(model.config, model.dtype), kv_budget, max_rows)
    cache, plan = _slot_cache(model, S, need)
    job = _new_job(prompts, limits, pad_id, share_prefix, _row_keys(keys, len(prompts), dev), dev)
    st = _Slots.empty(S, spare=len(prompts), park=need - 1)
    stops = torch.tensor(sorted(set(stop_ids)), device=dev)
    counts = Counter(prefill_rows=0, decode_steps=0)
    while True:
        _refill(model, cache, plan, st, job, counts)
        if not st.busy.any():
            break
        at = st.dev[ROW], st.dev[MADE]                                   # (n,) output row and column
        u = seeds.uniforms(seed, job.keys[at[0]], at[1]) if temperature > 0 else None   # (n,)
        tok, lp = sample_next(st.logits, temperature, top_p, u)          # (n,)
        job.tokens[at], job.logps[at] = tok, lp
        hit = (tok[:, None] == stops).any(-1).cpu().numpy()               # the one host sync of the step
        st.tok = tok
        st.h[MADE] += st.busy                                            # a free slot stays put
        st.h[POS] += st.busy
        _retire(st, job, hit)
        st.upload(dev)
        if not job.queue and 0 < 2 * st.busy.sum() <= len(st.busy):
            _shrink(cache, st, dev)
        if st.busy.any():
            st.logits = _decode(model, cache, plan, st)
            counts["decode_steps"] += 1
    if stats is not None:
        for k, v in counts.items():
            stats[k] = stats.get(k, 0) + v
        stats["kv_bytes"] = max(stats.get("kv_bytes", 0), cache_bytes(cache))
        stats["slots"] = max(stats.get("slots", 0), S)
    return _output(job)


def _output(job: _Job) -> Generation:
    dev = job.tokens.device
    T = int(job.length.max())
    length = torch.from_numpy(job.length).to(dev)
    mask = torch.arange(T, device=dev) < length[:, None]      # (B, T), the stop token included
    return Generation(job.tokens[:-1, :T], job.logps[:-1, :T], mask, torch.from_numpy(job.finished).to(dev))


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
             kv_budget: int | None = None, max_embed_tokens: int | None = None):
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
    role, plus the sampler's counters (see `generate`)."""
    from policies import stop_ids
    from workflows import Call

    tok = policy.tokenizer
    stops = stop_ids(policy.model, tok)
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
            out = generate(model, prompts, max_new_tokens, stops, tok.pad_token_id, temperature=temperature,
                           top_p=top_p, seed=seed, keys=row_keys, kv_budget=kv_budget, max_rows=max_rows, stats=s)
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
    from workflows import Episode, run_workflow

    episodes = [Episode(problem=p, rollout=g, stream=tuple(stream)) for p in problems for g in range(group_size)]
    run_workflow(workflow, episodes, llm, task, **params)
    return episodes
