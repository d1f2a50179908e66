"""The training forward with no work on padding: rows packed end to end, the head only where a
logprob is read.

    lp, ent = packed.logprobs(model, prompts, completions, temperature, entropy=True)   # (n,) each

It computes what grpo.batch_logprobs computes (the plain reference: prompts left-padded to the
widest, completions right-padded, an explicit mask, logits at every completion column), with
these choices:
- rows: each row's prompt and completion, minus the completion's last token (never an input
  whose output is read), laid end to end in one (1, N) sequence; position ids restart at 0 in
  each row, so RoPE sees each row as it sees it alone (the sampler's cumsum(mask) - 1 of an
  unpadded row). N is the rows' own tokens: no pad column anywhere.
- attention: `packed_attention`, registered in transformers' AttentionInterface as ATTENTION and
  switched on for this forward only (the layers look their function up by the config's name at
  every call): one causal SDPA call per row, over that row's own keys. No mask tensor is built
  (transformers' masking_utils builds none for an attention function it does not know), so the
  causal kernels run (flash on a CPU and on CUDA) and skip the upper triangle; a padded batch
  with a mask runs the full square of the widest row. Chosen over transformers' own packed path
  (position ids without a mask: a dense block-diagonal (N, N) mask, N^2 work and memory) and
  over jagged nested tensors (SDPA refuses is_causal on them on a CPU); one SDPA call per row is
  the eager path, on every device.
- head: only at the positions that predict a completion token (row position len(prompt) - 1 + t),
  chunk by chunk (`CHUNK_ELEMS` fp32 numbers), by `_HeadLogprob`: no (N, V) tensor exists, in
  any dtype. With the head frozen (LoRA; Qwen3's tied embeddings) the forward also computes the
  logprob's gradient with respect to the hidden state, d logp / d h = (W[y] - softmax(z) W) / tau
  with z = h W^T / tau, so the backward is one multiply and never rebuilds the logits (what the
  fused cross-entropy kernels of Liger do); a trainable head (full copies) rebuilds each chunk's
  logits in the backward instead.
- entropy, when asked, from the same chunk's softmax: lse - sum p z, no pass of its own.

`supported(model)`: a decoder (`model.get_decoder()`) whose head is a bias-free nn.Linear and
whose logits are not rescaled or soft-capped (Qwen3, Llama); grpo falls back to the plain path
for any other.

Run the tests: `python -m pytest -q tests/test_grpo.py -k packed`.
"""
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AttentionInterface

CHUNK_ELEMS = 1 << 24   # fp32 numbers of one chunk of the head's logits (64 MB)
ATTENTION = "marl_packed"


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, packed_rows=None,
                     **kwargs):
    """transformers' attention function over packed rows: query (1, Hq, N, D), key and value
    (1, Hkv, N, D); `packed_rows` ((start, k, L), ...): k rows of L positions each from `start`
    (`row_runs`). Each row attends causally to its own keys only; the k rows of a run are one SDPA
    call, as a batch of k. Returns ((1, N, Hq, D), None), the attention functions' contract."""
    if packed_rows is None or attention_mask is not None:
        raise ValueError("packed_attention runs only inside packed.logprobs (its rows and no mask)")
    gqa = query.shape[1] != key.shape[1]
    if gqa and not gqa_kernel(query.device, query.dtype):   # heads repeated: Hq/Hkv x K/V's bytes
        key, value = (x.repeat_interleave(query.shape[1] // x.shape[1], 1) for x in (key, value))
        gqa = False

    def rows(x, a, k, L):   # (1, H, kL, D) -> (k, H, L, D), a view
        return x[0, :, a:a + k * L].unflatten(1, (k, L)).transpose(0, 1)
    parts = [F.scaled_dot_product_attention(rows(query, *r), rows(key, *r), rows(value, *r), is_causal=True,
                                            scale=scaling, enable_gqa=gqa).transpose(0, 1).flatten(1, 2)
             for r in packed_rows]                                     # each (Hq, kL, D)
    return torch.cat(parts, 1).transpose(0, 1)[None], None


def gqa_kernel(device, dtype) -> bool:
    """Whether SDPA runs grouped K/V heads (enable_gqa) on `device` in `dtype` in a kernel that
    skips the (L, L) scores: flash, on a CPU in any dtype and on CUDA in bf16/fp16. CUDA's
    memory-efficient kernel (its fp32 path) takes no grouped heads, so there SDPA would fall to
    its math kernel and keep fp32 (Hq, L, L) scores per row for the backward; packed_attention
    repeats K/V's heads instead, and the memory plan counts them (policies.activation_bytes'
    `repeated_kv`, from this same answer)."""
    return not (torch.device(device).type == "cuda" and dtype == torch.float32)


def row_runs(lengths: list) -> tuple:
    """((start, k, L), ...): the rows of `lengths`, laid end to end, as runs of k consecutive
    rows of one length L (rows sorted by length make few runs, so few attention calls)."""
    out, at = [], 0
    for L in lengths:
        if out and out[-1][2] == L:
            out[-1][1] += 1
        else:
            out.append([at, 1, L])
        at += L
    return tuple(map(tuple, out))


AttentionInterface.register(ATTENTION, packed_attention)


def supported(model) -> bool:
    """True if `logprobs` computes this model's logprobs: a decoder and a plain linear head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    cfg = model.config
    return (hasattr(model, "get_decoder") and type(head) is nn.Linear and head.bias is None
            and getattr(cfg, "final_logit_softcapping", None) is None and getattr(cfg, "logit_scale", None) is None
            and getattr(cfg, "logits_scaling", None) is None)


def used(model, packing: bool = True) -> bool:
    """Whether the packed path computes `model`'s logprobs: asked for, and `supported`."""
    return packing and supported(model)


@contextlib.contextmanager
def attention(model, packing: bool = True):
    """Every attention layer of `model` calls packed_attention for the duration (nothing changes
    where `used(model, packing)` is False). `logprobs` enters it for its forward; a checkpointed
    layer (policies.checkpoint_layers) recomputes its forward in the backward, so a caller that
    runs the backward enters it around both (grpo.update does)."""
    if not used(model, packing):
        yield
        return
    cfg = model.config
    before, cfg._attn_implementation = cfg._attn_implementation, ATTENTION
    try:
        yield
    finally:
        cfg._attn_implementation = before


def layout(prompts: list, completions: list, device):
    """(ids (1, N), position ids (1, N), the rows' runs (`row_runs`), read (n,): the positions whose
    output predicts a completion token, targets (n,): those tokens), n the completions' tokens."""
    ids, pos, lengths, read, targets, at = [], [], [], [], [], 0
    for p, c in zip(prompts, completions):
        row = list(p) + list(c[:-1])                  # the last completion token is never an input
        ids += row
        pos += range(len(row))
        lengths.append(len(row))
        read += range(at + len(p) - 1, at + len(row))   # completion token t is predicted at len(p) - 1 + t
        targets += c
        at += len(row)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)   # noqa: E731
    return as_long(ids)[None], as_long(pos)[None], row_runs(lengths), as_long(read), as_long(targets)


def logprobs(model, prompts: list, completions: list, temperature: float, entropy: bool = False):
    """fp32 logprobs (n,) of every completion token, rows in order, and their entropies (n,) or
    None; grad flows if grad is enabled (entropy never has grad)."""
    if any(len(p) == 0 for p in prompts) or any(len(c) == 0 for c in completions):
        raise ValueError("every row needs a non-empty prompt and completion")
    tau = temperature if temperature > 0 else 1.0     # greedy: logprobs under the unscaled distribution
    head = model.get_output_embeddings()
    ids, pos, spans, read, targets = layout(prompts, completions, head.weight.device)
    with attention(model):
        hidden = model.get_decoder()(input_ids=ids, position_ids=pos, packed_rows=spans,
                                     use_cache=False).last_hidden_state                # (1, N, H)
    h = hidden[0].index_select(0, read)                                                # (n, H)
    return _HeadLogprob.apply(h, head.weight, targets, float(tau), entropy)


class _HeadLogprob(torch.autograd.Function):
    """logp = z[y] - logsumexp(z), z = h W^T / tau in fp32, chunk by chunk of rows (module
    docstring: what the forward keeps for the backward). Returns (logp (n,), entropy (n,) or
    None)."""

    @staticmethod
    def forward(ctx, h, weight, tokens, tau, entropy):
        n, V = h.shape[0], weight.shape[0]
        rows = max(1, CHUNK_ELEMS // V)
        lp = torch.empty(n, dtype=torch.float32, device=h.device)                    # (n,)
        ent = torch.empty(n, dtype=torch.float32, device=h.device) if entropy else None
        lse = torch.empty(n, dtype=torch.float32, device=h.device)                   # (n,)
        jac = torch.empty_like(h) if ctx.needs_input_grad[0] and not ctx.needs_input_grad[1] else None
        for s in range(0, n, rows):
            e = min(n, s + rows)
            z = (h[s:e] @ weight.t()).float() / tau                                    # (c, V) fp32
            lse[s:e] = torch.logsumexp(z, -1)
            lp[s:e] = z.gather(-1, tokens[s:e, None]).squeeze(-1) - lse[s:e]
            if ent is None and jac is None:
                continue
            p = torch.exp(z - lse[s:e, None])                                          # (c, V) softmax
            if ent is not None:
                ent[s:e] = lse[s:e] - (p * z).sum(-1)
            if jac is not None:   # d logp / d h = (onehot(y) - p) W / tau
                p.neg_().scatter_add_(-1, tokens[s:e, None], torch.ones_like(p[:, :1]))
                jac[s:e] = (p / tau).to(h.dtype) @ weight
        ctx.save_for_backward(h, weight, tokens, lse, jac)
        ctx.tau, ctx.rows = tau, rows
        ctx.mark_non_differentiable(*([ent] if ent is not None else []))
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        h, weight, tokens, lse, jac = ctx.saved_tensors
        if jac is not None:
            return grad_lp[:, None].to(jac.dtype) * jac, None, None, None, None
        grad_h = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for s in range(0, h.shape[0], ctx.rows):   # a trainable head: rebuild each chunk's logits
            e = min(h.shape[0], s + ctx.rows)
            z = (h[s:e] @ weight.t()).float() / ctx.tau
            d = -torch.exp(z - lse[s:e, None])                                         # -softmax, (c, V)
            d.scatter_add_(-1, tokens[s:e, None], torch.ones_like(d[:, :1]))
            d = (d * (grad_lp[s:e, None] / ctx.tau)).to(h.dtype)
            if grad_h is not None:
                grad_h[s:e] = d @ weight
            if grad_w is not None:
                grad_w += d.t() @ h[s:e]
        return grad_h, grad_w, None, None, None
