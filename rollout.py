"""Rollout: a hand-written batched sampler, and the `llm` that runs workflow stages through it.

generate(model, prompts, ...) samples completions for a batch of token-id prompts:
- prompts of different lengths are left-padded; position ids are `cumsum(mask) - 1` (the same
  formula as the trainer in grpo.py), and the attention mask is always passed;
- identical prompts are prefilled once and their KV cache rows replicated (prefix sharing: the
  G rollouts of a problem, the 3 voters); each row still samples its own first token;
- one forward per new token over a reused KV cache, preallocated to its final length after the
  prefill and written in place (no per-token concatenation), logits for the last position only,
  sampling on the device, one host sync per step (to stop when every row is done);
- logits are divided by the temperature and upcast to fp32 before the log-softmax; the
  returned logprob of a token is under that temperature-scaled distribution (top-p only
  narrows which tokens can be drawn; with top_p=1, the paper's setting, it is exactly the
  distribution sampled from, and what grpo.py recomputes). temperature=0 is greedy, and its
  logprobs are then under the unscaled (T=1) distribution;
- a row stops at the first of any stop id (Qwen3 has two); the stop token is kept with mask 1,
  later positions are pad with mask 0; `finished` is False for rows cut at max_new_tokens.

Run `python bench/generate.py` to compare its speed with `model.generate`.
"""
import inspect
from dataclasses import dataclass

import torch


@dataclass
class Generation:
    tokens: torch.Tensor    # (B, T) completion ids, pad after the stop token
    logprobs: torch.Tensor  # (B, T) fp32 logprob of each sampled token, 0 where mask is 0
    mask: torch.Tensor      # (B, T) bool, True for real tokens, the stop token included
    finished: torch.Tensor  # (B,) bool, True if the row emitted a stop id


def _cache_kwarg(model) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` (the old name warns until 5.40)
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _preallocate(cache, length: int) -> None:
    """Give every cache layer buffers of the final length, written in place, instead of the
    `torch.cat` per token that copies the whole cache of every row at every step (half of the
    decode time on CPU at a few hundred rows). The layer's keys / values become views of the
    filled part. A cache of another kind (older transformers) is left as it is."""
    for layer in getattr(cache, "layers", None) or []:
        if type(layer).__name__ != "DynamicLayer" or getattr(layer, "keys", None) is None:
            return
    for layer in getattr(cache, "layers", None) or []:
        k, v = layer.keys, layer.values                        # (B, H, P, D)
        shape = (*k.shape[:-2], length, k.shape[-1])
        kbuf, vbuf = k.new_empty(shape), v.new_empty(shape)    # (B, H, length, D)
        kbuf[..., : k.shape[-2], :], vbuf[..., : v.shape[-2], :] = k, v

        def update(key_states, value_states, *args, _l=layer, _k=kbuf, _v=vbuf, **kwargs):
            n, m = _l.keys.shape[-2], key_states.shape[-2]
            _k[..., n : n + m, :], _v[..., n : n + m, :] = key_states, value_states
            _l.keys, _l.values = _k[..., : n + m, :], _v[..., : n + m, :]
            return _l.keys, _l.values
        layer.keys, layer.values = kbuf[..., : k.shape[-2], :], vbuf[..., : v.shape[-2], :]
        layer.update = update


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


def _draw(probs, generator):
    """One index per row of `probs` (B, V) by inverse CDF: a single uniform per row and a cumsum.
    (torch.multinomial is several times slower on CPU for one sample a row.)"""
    c = probs.cumsum(-1)                                               # (B, V)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device) * c[:, -1:]
    # first index whose cumulative mass exceeds u: tokens of probability 0 are never chosen
    return torch.searchsorted(c, u, right=True).clamp_(max=probs.shape[1] - 1).squeeze(-1)


def sample_next(logits, temperature: float, top_p: float, generator):
    """Draw one token per row from fp32 `logits` (B, V); return (ids (B,), logprobs (B,))."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        ids = logp.argmax(-1)
    else:
        logp = torch.log_softmax(logits / temperature, dim=-1)  # (B, V)
        probs = logp.exp()
        if top_p < 1.0:
            sp, si = probs.sort(-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p: a token goes once the mass
            # before it already reaches top_p (`>=`: on an exact tie the next token is not kept)
            drop = sp.cumsum(-1) - sp >= top_p
            ids = si.gather(-1, _draw(sp.masked_fill(drop, 0.0), generator)[:, None]).squeeze(-1)
        else:
            ids = _draw(probs, generator)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


@torch.no_grad()  # not inference_mode: its tensors could not be reused by autograd later
def generate(model, prompts: list, max_new_tokens: int, stop_ids, pad_id: int,
             temperature: float = 1.0, top_p: float = 1.0, generator=None,
             share_prefix: bool = True) -> Generation:
    """Sample a completion for every prompt (a list of token-id lists)."""
    if max_new_tokens < 1 or not prompts:
        raise ValueError("generate needs at least one prompt and max_new_tokens >= 1")
    dev = next(model.parameters()).device
    B, T = len(prompts), max_new_tokens
    if share_prefix:  # prefill each distinct prompt once
        uniq = {}
        src = torch.tensor([uniq.setdefault(tuple(p), len(uniq)) for p in prompts], device=dev)
        to_fill = [list(p) for p in uniq]
    else:
        src, to_fill = None, prompts
    ids, mask = left_pad(to_fill, pad_id, dev)  # (B', P)
    P = ids.shape[1]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)    # (B', P) same formula as the trainer
    cache, ckw = _new_cache(model), _cache_kwarg(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                logits_to_keep=1, **{ckw: cache})
    logits = out.logits[:, -1].float()          # (B', V)
    next_pos = pos[:, -1] + 1                   # (B',) position of the first new token
    if src is not None and len(to_fill) < B:    # replicate prefilled rows to the full batch
        cache.batch_select_indices(src)
        logits, mask, next_pos = logits[src], mask[src], next_pos[src]

    _preallocate(cache, P + T)
    stops = torch.tensor(sorted(set(stop_ids)), device=dev)
    tokens = torch.full((B, T), pad_id, dtype=torch.long, device=dev)   # (B, T)
    logps = torch.zeros((B, T), dtype=torch.float32, device=dev)       # (B, T)
    live = torch.ones((B, T), dtype=torch.bool, device=dev)            # (B, T)
    done = torch.zeros(B, dtype=torch.bool, device=dev)                # (B,)
    attn = torch.cat([mask, torch.ones((B, T), dtype=mask.dtype, device=dev)], 1)  # (B, P+T)
    t = 0
    for t in range(T):
        tok, lp = sample_next(logits, temperature, top_p, generator)
        tok = tok.masked_fill(done, pad_id)     # rows already done emit pad
        tokens[:, t], logps[:, t], live[:, t] = tok, lp.masked_fill(done, 0.0), ~done
        done = done | torch.isin(tok, stops)
        if t == T - 1 or bool(done.all()):      # the one host sync of the step
            break
        out = model(input_ids=tok[:, None], attention_mask=attn[:, : P + t + 1],
                    position_ids=(next_pos + t)[:, None], use_cache=True, **{ckw: cache})
        logits = out.logits[:, -1].float()      # (B, V)
    n = t + 1  # columns actually produced; the rest is pad
    live[:, n:] = False
    return Generation(tokens[:, :n], logps[:, :n], live[:, :n], done)


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


def make_llm(policy, *, temperature: float = 0.7, top_p: float = 1.0, max_new_tokens: int = 512,
             max_prompt_tokens: int | None = None, generator=None, max_rows: int | None = None):
    """The `llm(role, slots, messages_list) -> list[Call]` that workflows.py calls once per stage.

    Every call of a stage goes to the adapter of its role in one `generate` (or chunks of
    `max_rows` rows, identical prompts kept together so they still share their prefill), and
    is recorded as a Call with its prompt ids, completion ids (stop token included), sampler
    logprobs and finished flag; the text is the decoded completion without special tokens.
    `llm.stats` counts calls and cut prompts per role."""
    from policies import stop_ids
    from workflows import Call

    tok = policy.tokenizer
    stops = stop_ids(policy.model, tok)
    stats = {}

    def llm(role, slots, messages_list):
        rendered = [render(tok, m, max_prompt_tokens) for m in messages_list]
        prompts = [ids for ids, _ in rendered]
        s = stats.setdefault(role, {"calls": 0, "prompt_cut": 0})
        s["calls"] += len(prompts)
        s["prompt_cut"] += sum(cut for _, cut in rendered)
        order = sorted(range(len(prompts)), key=lambda i: prompts[i])  # identical prompts adjacent
        step = max_rows or len(order)
        calls = [None] * len(prompts)
        with policy.using(policy.adapter(role)) as model:
            for c in range(0, len(order), step):
                rows = order[c : c + step]
                out = generate(model, [prompts[i] for i in rows], max_new_tokens, stops, tok.pad_token_id,
                               temperature=temperature, top_p=top_p, generator=generator)
                for j, i in enumerate(rows):
                    keep = out.mask[j]
                    ids = out.tokens[j][keep].tolist()
                    calls[i] = Call(role=role, slot=slots[i], messages=messages_list[i],
                                    text=tok.decode(ids, skip_special_tokens=True), prompt_ids=prompts[i],
                                    completion_ids=ids, logprobs=out.logprobs[j][keep].tolist(),
                                    finished=bool(out.finished[j]))
        return calls

    llm.stats = stats
    return llm


def run_episodes(llm, workflow: str, problems: list, group_size: int, task: str, **params) -> list:
    """Run `workflow` on every problem `group_size` times; return the Episodes (calls and final
    text filled in, rewards not yet)."""
    from workflows import Episode, run_workflow

    episodes = [Episode(problem=p, rollout=g) for p in problems for g in range(group_size)]
    run_workflow(workflow, episodes, llm, task, **params)
    return episodes
