"""Rollout: the sampler as a concept, and the `llm` that runs a workflow's stages through it.

    out = generate_simple(model, prompts, max_new_tokens=48, stop_ids=[im_end, eot], pad_id=eot,
                          temperature=0.7, seed=0, keys=[7, 8])    # a Generation: tokens, logprobs, mask
    llm = make_llm(policy, temperature=0.7, max_new_tokens=48)      # llm(role, slots, messages_list, keys=keys)

`generate_simple` is the sampler to read: every prompt left-padded into one batch and one
ordinary DynamicCache, every row stepping together until all have ended. What it promises:
- keyed draws: row i's token t is drawn with the uniform seeds.uniforms(seed, keys[i], t), by
  inverse CDF over float64 probabilities (the exact distribution to float64 rounding), so what
  a row samples depends on its key and nothing else: not on the rows beside it, the batch it is
  in or the rank it runs on. A workflow's rows are keyed by workflows.stage. On CUDA the draw's
  probabilities are fp32, drawn in two levels (SAMPLE_DTYPE: the CPU's float64 is what the kept
  toy runs sampled);
- logits are divided by the temperature and upcast to fp32 before the log-softmax; the
  returned logprob of a token is under the distribution it was drawn from: the
  temperature-scaled softmax (with top_p=1, the paper's setting, what grpo.py recomputes), or
  with top_p < 1 that softmax cut to the nucleus and renormalised. temperature=0 is greedy, and
  its logprobs are then under the unscaled (T=1) distribution;
- a row stops at the first of any stop id (Qwen3 has two) or at its own max_new_tokens; the stop
  token is kept with mask 1, later positions are pad with mask 0; `finished` is False for rows
  cut at their limit. Outputs are per prompt, in input order.

It holds every row of a call for as many steps as the longest and attends every row over the
widest: fine for a test or a toy stage, wasteful at the paper's scale (hundreds of rows, 5,120
new tokens, prompts of 100 to 3,000 tokens). engine.py's `generate` keeps the same contract and
the same samples (tests/test_sampler.py compares them token for token) and adds what a GPU
needs: rows refilled as others stop within a KV-cache budget, prompts shared by several rows
prefilled once, each row attending about its own width, no host sync in a decode step, and
decode steps a CUDA graph can replay. `make_llm` takes either as its `sampler`; train.py's
`--sampler fast|simple` chooses.

Run the tests: `python -m pytest -q tests/test_sampler.py`.
"""
import functools
import inspect
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

import policies
import seeds
from workflows import Call, Episode, run_workflow


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
    index). The reference that engine.generate is tested against; it holds every row at once,
    for as many steps as the longest."""
    dev = next(model.parameters()).device
    keys = row_keys(keys, len(prompts), dev)                            # (B,) int64
    limits = torch.from_numpy(check_limits(prompts, max_new_tokens)).to(dev)  # (B,)
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
    cache = new_cache(model)
    for t in range(T):
        # position = cumsum(mask) - 1, the trainer's formula: each prompt starts at position 0
        # whatever its padding. The mask, passed every step, hides the pad columns.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)                         # (B, P+t)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos[:, -ids.shape[1]:],
                    use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
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


# The float type of the draw's probabilities, by device. CPU: float64, the exact distribution to
# float64 rounding, what every kept toy run sampled (another type would move their samples).
# CUDA: float32, drawn in two levels (_draw_blocks), each token's probability exact to fp32
# rounding, at half the traffic of float64 over a 151,936-token vocabulary and hundreds of rows.
SAMPLE_DTYPE = {"cpu": torch.float64, "cuda": torch.float32}
DRAW_BLOCK = 1024   # tokens in a block of the fp32 draw: its cumulative sum is float64 and short


def sample_next(logits, temperature: float, top_p: float, u):
    """Draw one token per row from fp32 `logits` (B, V) with the row's uniform `u` (B,) float64
    (unused when greedy); return (ids (B,), logprobs (B,) fp32). The logprob is under the
    distribution the token was drawn from: the temperature-scaled softmax, and with top_p < 1 that
    softmax cut to the nucleus and renormalised (log p - log of the mass kept), so a correction
    that weighs by the sampler's probability (truncated importance sampling) sees the one used."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        ids = logp.argmax(-1)
        return ids, logp.gather(-1, ids[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)  # (B, V) fp32: the logprob returned
    # drawn from float64 probabilities on a CPU: in fp32 a cumulative sum over 151,936 tokens
    # rounds every late token's mass to 0 or to a whole fp32 step, so many could never be drawn
    # (CUDA's fp32 draw sums in blocks to avoid it)
    wide = SAMPLE_DTYPE["cuda" if logits.is_cuda else "cpu"]
    probs = torch.softmax(logits.to(wide) / temperature, dim=-1)   # (B, V)
    if top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p: a token goes once the mass
        # before it already reaches top_p (`>=`: on an exact tie the next token is not kept)
        kept = sp.masked_fill(sp.cumsum(-1) - sp >= top_p, 0.0)           # (B, V) sorted
        j = _draw(kept, u)[:, None]                                        # (B, 1) in the sorted order
        # log p - log of the mass kept, in the draw's type (float64 on a CPU: the two logs' rounding
        # would otherwise add up)
        lp = torch.log(kept.gather(-1, j)).squeeze(-1) - torch.log(kept.sum(-1, dtype=torch.float64))
        return si.gather(-1, j).squeeze(-1), lp.float()
    ids = _draw(probs, u)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


def _draw(probs, u):
    """One index per row of `probs` (B, V) by inverse CDF with the row's uniform `u` (B,): float64
    probabilities through one cumulative sum (lighter than torch.multinomial for one sample a
    row; token v is drawn with probability (c[v] - c[v-1]) / c[-1], c the float64 cumsum: the
    exact distribution to float64 rounding), fp32 ones in two levels (_draw_blocks)."""
    if probs.dtype != torch.float64:
        return _draw_blocks(probs, u)
    return inverse_cdf(probs.cumsum(-1), u[:, None]).squeeze(-1)        # cumsum (B, V) float64


def _draw_blocks(probs, u, block: int = DRAW_BLOCK):
    """`_draw` of fp32 `probs` (B, V), for uniforms u (B,) or (B, M): the block of DRAW_BLOCK
    tokens first, by the float64 cumulative sum of the blocks' masses (each summed in float64),
    then the token within it, by the float64 cumulative sum of its block: no cumulative sum runs
    long in fp32, so every token keeps its fp32 probability (a sum over the whole vocabulary in
    fp32 would round late tokens' mass away). The draw's mass within its block is u x total -
    the mass of the blocks before it."""
    B, V = probs.shape
    x = u.double().reshape(B, -1)                                       # (B, M)
    p = F.pad(probs, (0, -V % block)).view(B, -1, block)                # (B, K, block), zeros past V
    c = p.sum(-1, dtype=torch.float64).cumsum(-1)                       # (B, K) float64
    k = inverse_cdf(c, x)                                               # (B, M) the blocks: positive mass
    before = torch.where(k > 0, c.gather(-1, (k - 1).clamp(min=0)), 0.0)   # (B, M) mass of the blocks before
    rows = torch.arange(B, device=probs.device)[:, None]
    inner = p[rows, k].double().cumsum(-1)                              # (B, M, block) within each block
    at = (x * c[:, -1:] - before) / inner[..., -1]                      # (B, M) where in the block, 0..1
    j = inverse_cdf(inner.view(-1, block), at.view(-1, 1)).view(B, -1)  # (B, M)
    return (k * block + j).view(u.shape)


def inverse_cdf(c, u):
    """Indices (B, M) of the tokens that uniforms u (B, M) select in cumulative masses c (B, V):
    the first v with c[v] > u c[-1]."""
    x = u * c[:, -1:]                                                  # (B, M)
    # below the total, so the search lands on a token of positive mass (u x total may round up)
    x = torch.minimum(x, torch.nextafter(c[:, -1:], torch.zeros_like(c[:, -1:])))
    # first index whose cumulative mass exceeds x: tokens of probability 0 are never chosen
    return torch.searchsorted(c, x, right=True)


def row_keys(keys, n: int, device):
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


def check_limits(prompts: list, max_new_tokens) -> np.ndarray:
    """(B,) max_new_tokens per prompt, checked."""
    B = len(prompts)
    one = np.ndim(max_new_tokens) == 0
    limits = np.full(B, int(max_new_tokens)) if one else np.asarray(list(max_new_tokens), dtype=np.int64)
    if B == 0 or limits.shape != (B,) or limits.min() < 1 or min(map(len, prompts)) < 1:
        raise ValueError("a sampler needs at least one prompt, none empty, and max_new_tokens >= 1 "
                         "(one int, or one per prompt)")
    return limits.astype(np.int64)


def cache_kwarg(model) -> str:
    return cache_kwarg_of(type(model))


@functools.lru_cache
def cache_kwarg_of(model_class) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` (the old name warns until 5.40)
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model):
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


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


def make_llm(policy, *, sampler=None, temperature: float = 0.7, top_p: float = 1.0, max_new_tokens: int = 512,
             max_prompt_tokens: int | None = None, seed: int = 0, max_embed_tokens: int | None = None):
    """The `llm(role, slots, messages_list, keys) -> list[Call]` that workflows.py calls once
    per stage.

    `sampler`: a function with generate_simple's contract (the default), e.g. engine.generate
    with its budget bound (functools.partial(engine.generate, kv_budget=...)); both sample the
    same tokens. `keys` names each row (workflows.stage passes its episode's stream, problem id
    and rollout and the call's index in the episode); its draws come from seeds.uniforms(seed,
    key(row), position), so a row samples the same tokens whatever else is in the stage; a call
    without keys is refused (an order of calls is not the same on resume or on another rank).
    Every call of a stage goes to the adapter of its role in one sampler call and is recorded as
    a Call with its prompt ids, completion ids (stop token included), sampler logprobs and
    finished flag; the text is the decoded completion without special tokens. `llm.stats` counts
    calls and cut prompts per role."""
    sampler = sampler or generate_simple
    if not callable(sampler):
        raise ValueError(f"sampler must be a function with generate_simple's contract, got {sampler!r}")
    tok = policy.tokenizer
    stops = policies.stop_ids(policy.model, tok)
    stats = {}

    def llm(role, slots, messages_list, keys=None):
        if keys is None:
            raise ValueError("llm(role, slots, messages_list) needs keys=, one per row (workflows.stage gives them)")
        rendered = [render(tok, m, max_prompt_tokens) for m in messages_list]
        prompts = [ids for ids, _ in rendered]
        s = stats.setdefault(role, {"calls": 0, "prompt_cut": 0})
        s["calls"] += len(prompts)
        s["prompt_cut"] += sum(cut for _, cut in rendered)
        with torch.no_grad(), policy.inference(policy.adapter(role)) as model:
            out = sampler(model, prompts, max_new_tokens, stops, tok.pad_token_id, temperature=temperature,
                          top_p=top_p, seed=seed, keys=[seeds.key(*k) if isinstance(k, tuple) else seeds.key(k)
                                                        for k in keys])
        return [_call(role, slots[i], messages_list[i], ids, out, i, tok, rendered[i][1])
                for i, ids in enumerate(prompts)]

    llm.stats, llm.seed = stats, seed
    llm.clip = make_clip(tok, max_embed_tokens)   # workflows.py shortens embedded texts with it
    return llm


def _call(role, slot, messages, prompt_ids, out: Generation, i: int, tok, prompt_cut: bool = False) -> Call:
    """Row i of a Generation as the Call of one role: what it sampled, kept with its logprobs."""
    keep = out.mask[i]
    comp = out.tokens[i][keep].tolist()
    return Call(role=role, slot=slot, messages=messages, text=tok.decode(comp, skip_special_tokens=True),
                prompt_ids=prompt_ids, completion_ids=comp, logprobs=out.logprobs[i][keep].tolist(),
                finished=bool(out.finished[i]), prompt_cut=bool(prompt_cut))


def run_episodes(llm, workflow: str, problems: list, group_size: int, task: str, stream: tuple = (),
                 **params) -> list:
    """Run `workflow` on every problem `group_size` times; return the Episodes (calls and final
    text filled in, rewards not yet). `stream` names what the episodes' draws are for, e.g.
    ("train", step) or ("eval", step): with the problem, the rollout and the call, it keys
    every row's random numbers. A workflow's own draws from Python's, numpy's or torch's global
    generator are seeded from the same (seed, stream, problems) and leave those generators as
    they were (seeds.global_generators)."""
    episodes = [Episode(problem=p, rollout=g, stream=tuple(stream)) for p in problems for g in range(group_size)]
    ids = tuple(str(p.get("id")) for p in problems)
    with seeds.global_generators(seeds.derive(getattr(llm, "seed", 0), "workflow", tuple(stream), ids, group_size)):
        run_workflow(workflow, episodes, llm, task, **params)
    return episodes
