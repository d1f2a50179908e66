"""GRPO for workflows: per-slot advantages, the clipped objective, the per-role update, and
role-level gradient diagnostics.

Objective minimised at each optimizer step, over the mini-batch M of one optimizer:

    L = mean_{i in M} mean_{t < |o_i|} l_it                                     (--loss-norm seq)
    l_it = min*( max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high)) ) + beta_role k3_it
    r_it = exp(logp_theta(o_it) - logp_old(o_it)),   min*(x) = min(x, c |A_i|) if A_i < 0 else x
    k3_it = exp(logp_ref - logp_theta) - (logp_ref - logp_theta) - 1
    A_i  = (R_i - mean_g R) / (std_g R + 1e-6)  over the group g of i (unbiased std; a group of
           one has mean 0 and std 1, so A = R)

Each choice and the train.py flag that sets it:
- group g = (problem, slot) (`--adv-group slot`, the paper), or (problem, role) with every
  same-role slot pooled (`--adv-group role`). The episode's 0/1 reward is copied to each call.
- eps_low / eps_high: `--clip-low 0.2 --clip-high 0.28` (clip-higher); c: `--clip-c 3.0` (dual
  clip: for A < 0 a token's loss is capped at c |A|, so a huge ratio cannot blow up the step).
- normalisation: `--loss-norm seq` (mean over sequences of each sequence's token mean, paper) or
  `--loss-norm token` (sum over every token of the mini-batch / their number).
- KL: beta_role = `--kl-coef` (0, off, as in the paper), overridden per role by
  `--kl-coef-role ROLE=VALUE`; the reference is the base model (`policy.using(None)`: for LoRA,
  the adapter switched off). No entropy bonus.
- logp_old is recomputed by this training forward, once, before the first mini-batch (the
  sampler's logprobs differ numerically even at equal weights; their gap is logged, not used).
- temperature: logits / `--temperature` in the trainer exactly as in the sampler.
- one epoch; each optimizer's n samples are shuffled and cut into ceil(n / `--mini-batch`)
  mini-batches of near-equal size (512 each at the paper's settings), one AdamW step per
  mini-batch (so a role with more calls takes more steps under isolated), gradients
  accumulated over micro-batches of at most `--token-budget` padded tokens, clipped to
  `--max-grad-norm` per optimizer step; lr `--lr` with `--warmup-steps` of linear warm-up then
  cosine to 0 over `--steps`.
- rows that cannot move the weights (advantage exactly 0 and no KL: the loss is -0 * ratio)
  skip the old-logprob recompute and the training forward and backward; they still count in
  the denominators, so the gradient is the same to float rounding. The token statistics
  (clip fraction, ratio, entropy, logprob gap, KL) then cover the rows that ran; `skipped`
  counts the others per role.
- `--coherence-damp ROLE=LAMBDA` (CoherenceDamp): the paper's intervention on a role whose
  successive gradients keep pointing one way; off by default.
- data parallel (train.py under torchrun, `comm`): n is over every rank, each optimizer step
  sums every (role, slot) part of the gradient over the ranks, and the loss divides by the
  global mini-batch, so N ranks take the same steps as one process holding every sample.

Layout of the training forward (the same as rollout.generate for the rows it admits
together; a row admitted later sits at other columns of its slot but has the same positions):
prompts left-padded to P, completions right after them (so every completion starts at column
P) and right-padded to T; position_ids = cumsum(mask) - 1; the attention mask is always passed; the logprob of completion
token t is read from the logits at position P-1+t. Only those T positions get logits
(`logits_to_keep`), and the fp32 log-softmax is taken chunk by chunk by a small autograd
function whose backward rebuilds each chunk, so no (B, T, V) fp32 tensor is ever held.

Diagnostics (no extra backward): inside a mini-batch the micro-batches run grouped by role and,
within a role, by slot; the flattened gradient is read after each slot, and the difference is
that slot's contribution (it carries the slot's share of the loss normalisation, so it is not
weighted again). Summed over the step's mini-batches they give per-slot and per-role gradients
(`grad_norm`); the norm of a role's part of each optimizer step gives `grad_norm_opt`, the
figure that compares roles taking different numbers of steps. Every field: docs/RUNFOLDER.md.

Run the tests: `python -m pytest -q tests/test_grpo.py`.
"""
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One call of one episode, as a training row."""
    role: str                  # role type: decides which adapter the sample trains
    slot: str                  # position in the workflow: decides its advantage group
    problem_id: str
    prompt_ids: list           # token ids the sampler was given
    completion_ids: list       # sampled ids, stop token included
    sampler_logprobs: list     # the sampler's logprob of each completion id
    finished: bool             # False: cut at the length limit
    reward: float              # the episode's reward, unchanged
    advantage: float           # group-normalised reward
    rollout: int = 0           # which of the problem's G episodes (for logs)
    call: int = 0              # index of the call within its episode (for logs)


# ----------------------------------------------------------------------------- advantages

def group_advantages(rewards: list, keys: list, eps: float = 1e-6) -> list:
    """A_i = (R_i - mean) / (std + eps) within the rows sharing a key (unbiased std).

    A group of one gets mean 0 and std 1, so its advantage is its reward. A zero-variance
    group gets A = 0 for every row (it stays in the batch, contributing only to the KL)."""
    if len(rewards) != len(keys):
        raise ValueError(f"{len(rewards)} rewards but {len(keys)} keys")
    groups = defaultdict(list)
    for i, k in enumerate(keys):
        groups[k].append(i)
    adv = [0.0] * len(rewards)
    for rows in groups.values():
        r = [float(rewards[i]) for i in rows]
        if len(r) == 1:
            adv[rows[0]] = r[0]
            continue
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
        for i, x in zip(rows, r):
            adv[i] = (x - mean) / (std + eps)
    return adv


def samples_from_episodes(episodes, group_by: str = "slot") -> list:
    """Every call of every (scored) episode as a Sample, with its group's advantage.

    Reads only attributes: episode.problem_id, .rollout, .reward, .calls; call.role, .slot, .prompt_ids,
    .completion_ids, .logprobs, .finished."""
    if group_by not in ("slot", "role"):
        raise ValueError(f"group_by must be slot or role, got {group_by!r}")
    samples = []
    for ep in episodes:
        for i, c in enumerate(ep.calls):
            # A call with no completion token (never sampled, e.g. a prompt over the length
            # limit) has nothing to train on: dropped before the group statistics.
            if not c.completion_ids:
                continue
            samples.append(Sample(c.role, c.slot, str(ep.problem_id), list(c.prompt_ids),
                                  list(c.completion_ids), [float(x) for x in c.logprobs],
                                  bool(c.finished), float(ep.reward), 0.0, ep.rollout, i))
    keys = [(s.problem_id, s.slot if group_by == "slot" else s.role) for s in samples]
    for s, a in zip(samples, group_advantages([s.reward for s in samples], keys)):
        s.advantage = a
    return samples


# ----------------------------------------------------------------------------- logprobs

CHUNK_ELEMS = 1 << 24  # fp32 numbers per log-softmax chunk (64 MB)


class _TokenLogprob(torch.autograd.Function):
    """logp = z[y] - logsumexp(z), z = logits / tau in fp32, chunk by chunk of rows.

    Autograd would keep every chunk's fp32 copy for the backward, i.e. a full (N, V) fp32
    tensor; this keeps only the model-dtype logits and the (N,) logsumexp, and the backward
    rebuilds each chunk: d logp / d logits_v = (1[v = y] - softmax(z)_v) / tau."""

    @staticmethod
    def forward(ctx, logits, tokens, tau):
        N, V = logits.shape
        rows = max(1, CHUNK_ELEMS // V)
        lp = torch.empty(N, dtype=torch.float32, device=logits.device)    # (N,)
        lse = torch.empty(N, dtype=torch.float32, device=logits.device)   # (N,)
        for s in range(0, N, rows):
            z = logits[s:s + rows].float() / tau                          # (n, V) fp32
            lse[s:s + rows] = torch.logsumexp(z, -1)
            lp[s:s + rows] = z.gather(-1, tokens[s:s + rows, None]).squeeze(-1) - lse[s:s + rows]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.tau = tau
        return lp

    @staticmethod
    def backward(ctx, grad_lp):
        logits, tokens, lse = ctx.saved_tensors
        N, V = logits.shape
        rows = max(1, CHUNK_ELEMS // V)
        grad = torch.empty_like(logits)                                   # (N, V) model dtype
        for s in range(0, N, rows):
            z = logits[s:s + rows].float() / ctx.tau
            d = -torch.exp(z - lse[s:s + rows, None])                     # -softmax, (n, V)
            d.scatter_add_(-1, tokens[s:s + rows, None], torch.ones_like(d[:, :1]))
            grad[s:s + rows] = (d * (grad_lp[s:s + rows, None] / ctx.tau)).to(grad.dtype)
        return grad, None, None


@torch.no_grad()
def token_entropy(logits, temperature: float):
    """Entropy (N,) of softmax(logits / temperature), fp32 chunk by chunk, no grad."""
    N, V = logits.shape
    rows = max(1, CHUNK_ELEMS // V)
    out = []
    for s in range(0, N, rows):
        z = logits[s:s + rows].float() / temperature
        logp = z - torch.logsumexp(z, -1, keepdim=True)                   # (n, V)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)


def token_logprobs(logits, tokens, temperature: float):
    """fp32 logprob (N,) of `tokens` (N,) under softmax(logits / temperature), with logits
    (N, V) in the model's dtype; differentiable, with no (N, V) fp32 tensor kept."""
    return _TokenLogprob.apply(logits, tokens, float(temperature))


def batch_logprobs(model, prompts: list, completions: list, temperature: float,
                   entropy: bool = False, pad_id: int = 0):
    """One forward over a micro-batch laid out as the sampler does.

    Returns (logp (B, T) fp32, entropy (B, T) fp32 or None, mask (B, T) bool); positions past
    a row's completion hold 0. Runs with grad if grad is enabled."""
    if any(len(p) == 0 for p in prompts) or any(len(c) == 0 for c in completions):
        raise ValueError("every row needs a non-empty prompt and completion")
    # the sampler's temperature 0 is greedy with logprobs under the unscaled distribution
    tau = temperature if temperature > 0 else 1.0
    dev = next(model.parameters()).device
    B, P, T = len(prompts), max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((B, P + T), pad_id, dtype=torch.long)        # (B, P+T)
    mask = torch.zeros((B, P + T), dtype=torch.long)              # (B, P+T)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - len(p):P] = torch.tensor(p)                    # left-padded prompt
        ids[i, P:P + len(c)] = torch.tensor(c)                    # completion at column P
        mask[i, P - len(p):P + len(c)] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)                      # same formula as the sampler
    # completion token t is predicted at position P-1+t, so the last column is never an input
    # whose output we need: drop it, and keep logits for the last T positions only
    out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1],
                logits_to_keep=T, use_cache=False)
    logits = out.logits                                           # (B, T, V) model dtype
    targets = ids[:, P:]                                          # (B, T)
    flat = logits.reshape(B * T, -1)                              # (B*T, V) a view
    cmask = mask[:, P:].bool()                                    # (B, T)
    lp = token_logprobs(flat, targets.reshape(-1), tau).view(B, T).masked_fill(~cmask, 0.0)
    ent = token_entropy(flat, tau).view(B, T).masked_fill(~cmask, 0.0) if entropy else None
    return lp, ent, cmask


def micro_batches(samples: list, rows: list, token_budget: int) -> list:
    """Split `rows` (indices into samples) into lists whose rows x padded length (longest prompt
    + longest completion) fits token_budget; sorted by length so rows of a batch are alike. A
    row longer than the budget gets a micro-batch of its own."""
    order = sorted(rows, key=lambda i: (len(samples[i].prompt_ids) + len(samples[i].completion_ids),
                                        len(samples[i].prompt_ids)), reverse=True)
    out, cur, P, T = [], [], 0, 0
    for i in order:
        p, t = max(P, len(samples[i].prompt_ids)), max(T, len(samples[i].completion_ids))
        if cur and (len(cur) + 1) * (p + t) > token_budget:
            out.append(cur)
            cur, p, t = [], len(samples[i].prompt_ids), len(samples[i].completion_ids)
        cur.append(i)
        P, T = p, t
    if cur:
        out.append(cur)
    return out


def sequence_logprobs(model, samples: list, temperature: float, token_budget: int = 8192):
    """Per-sample fp32 logprobs of the completion tokens (list of 1-D tensors, in the order of
    `samples`) and their entropies (same shape, no grad). Grad flows if grad is enabled."""
    lps, ents = [None] * len(samples), [None] * len(samples)
    for mb in micro_batches(samples, list(range(len(samples))), token_budget):
        lp, ent, _ = batch_logprobs(model, [samples[i].prompt_ids for i in mb],
                                    [samples[i].completion_ids for i in mb], temperature, entropy=True)
        for r, i in enumerate(mb):
            n = len(samples[i].completion_ids)
            lps[i], ents[i] = lp[r, :n], ent[r, :n]
    return lps, ents


# ----------------------------------------------------------------------------- objective

def objective(logp, old_logp, adv, mask, *, clip_low: float, clip_high: float, clip_c: float,
              loss_norm: str, denom: float, ref_logp=None, kl_coef: float = 0.0):
    """This micro-batch's part of the mini-batch loss (the parts sum to the mini-batch loss).

    logp, old_logp, ref_logp, mask: (B, T); adv: (B,). `denom` is the mini-batch's number of
    sequences (loss_norm "seq") or of completion tokens ("token").
    Returns (loss, per-token loss (B, T), ratio (B, T), clipped (B, T) bool, k3 (B, T) or None)."""
    m = mask.float()
    a = adv[:, None]                                                   # (B, 1)
    # the log-ratio is bounded only so exp cannot overflow: past +-20 a token is clipped or its
    # gradient (-A r) is ~0 anyway
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))            # (B, T)
    surr = -a * ratio
    surr_clip = -a * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(surr, surr_clip)                                # (B, T)
    capped = torch.minimum(pg, clip_c * a.abs())                       # dual clip
    tok = torch.where(a < 0, capped, pg)                               # (B, T)
    # a token whose loss no longer follows -A r gets no policy gradient: that is "clipped"
    clipped = ((surr_clip > surr) | ((a < 0) & (pg > clip_c * a.abs()))) & mask
    k3 = None
    if ref_logp is not None and kl_coef:
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1.0                                    # (B, T) >= 0
        tok = tok + kl_coef * k3
    tok = tok * m
    if loss_norm == "seq":  # each sequence's token mean; empty masks clamp to 1
        loss = (tok.sum(1) / m.sum(1).clamp(min=1.0)).sum() / denom
    elif loss_norm == "token":
        loss = tok.sum() / denom
    else:
        raise ValueError(f"loss_norm must be seq or token, got {loss_norm!r}")
    return loss, tok, ratio, clipped, k3


# ----------------------------------------------------------------------------- optimizers

def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base lr for the training step after `step` scheduler steps: linear
    warm-up (step+1)/warmup, then cosine from 1 down to 0 at step == total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizers(policy, lr: float, warmup_steps: int, total_steps: int,
                    weight_decay: float = 0.0, betas=(0.9, 0.999)):
    """One AdamW per adapter name of the policy, and one LambdaLR per AdamW.

    The schedulers are stepped once per training step, every one of them, however many
    mini-batches (optimizer steps) its adapter took: so every role follows the same lr curve in
    training steps, and a role that makes more calls takes more steps, not a faster-decaying lr."""
    opts, scheds = {}, {}
    for name in policy.names:
        opts[name] = torch.optim.AdamW(policy.parameters_of(name), lr=lr, betas=betas,
                                       weight_decay=weight_decay)
        scheds[name] = torch.optim.lr_scheduler.LambdaLR(
            opts[name], lambda s: lr_factor(s, warmup_steps, total_steps))
    return opts, scheds


# ----------------------------------------------------------------------------- update

def flat_grad(params) -> torch.Tensor:
    """(N,) fp32 concatenation of the parameters' gradients (zeros where there is none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in params])


def set_flat_grad(params, vec) -> None:
    """Write the (N,) vector back into the parameters' .grad, in flat_grad's order."""
    k = 0
    for p in params:
        n = p.numel()
        p.grad = vec[k:k + n].view_as(p).to(p.dtype).clone()
        k += n


def needs_forward(samples, kl_of, skip_zero: bool = True) -> list:
    """Which rows can move the weights. With A = 0 the policy term is -0 * ratio, so a row
    whose role also has no KL coefficient has exactly zero gradient: it skips the old-logprob
    recompute and the training forward and backward, and still counts in the denominators."""
    return [not skip_zero or s.advantage != 0.0 or kl_of(s.role) != 0.0 for s in samples]


@torch.no_grad()
def old_logprobs(policy, samples, by_name, live, kl_of, temperature, token_budget):
    """(old, entropy, ref): per-sample 1-D tensors from the training forward before any
    parameter moves, None for rows that do not run; ref only for rows whose role has a KL."""
    old, ent, ref = [None] * len(samples), [None] * len(samples), [None] * len(samples)
    for name, rows in by_name.items():
        rows = [i for i in rows if live[i]]
        if rows:
            with policy.using(name) as model:
                lps, ents = sequence_logprobs(model, [samples[i] for i in rows], temperature, token_budget)
            for i, lp, e in zip(rows, lps, ents):
                old[i], ent[i] = lp, e
    kl_rows = [i for i in range(len(samples)) if live[i] and kl_of(samples[i].role)]
    if kl_rows:
        with policy.using(None) as model:   # the frozen base is the KL reference
            lps, _ = sequence_logprobs(model, [samples[i] for i in kl_rows], temperature, token_budget)
        for i, lp in zip(kl_rows, lps):
            ref[i] = lp
    return old, ent, ref


def _padded(ts, T, dev):
    """Per-sample 1-D tensors -> (B, T), zeros past each completion."""
    out = torch.zeros((len(ts), T), device=dev)
    for r, t in enumerate(ts):
        out[r, :len(t)] = t
    return out


def _micro_step(policy, name, samples, mb, old, ref, beta, denom, obj, stats):
    """Forward, loss and backward of one micro-batch; gradients accumulate into .grad.
    The backward runs while the adapter is active: under activation checkpointing the layers
    are recomputed during it, and their LoRA hooks must see the same adapter."""
    role = samples[mb[0]].role
    with policy.using(name) as model:
        logp, _, mask = batch_logprobs(model, [samples[i].prompt_ids for i in mb],
                                       [samples[i].completion_ids for i in mb], obj["temperature"])
        T, dev = logp.shape[1], logp.device
        adv = torch.tensor([samples[i].advantage for i in mb], device=dev, dtype=torch.float32)
        loss, _, ratio, clipped, k3 = objective(
            logp, _padded([old[i] for i in mb], T, dev), adv, mask, clip_low=obj["clip_low"],
            clip_high=obj["clip_high"], clip_c=obj["clip_c"], loss_norm=obj["loss_norm"], denom=denom,
            ref_logp=_padded([ref[i] for i in mb], T, dev) if beta else None, kl_coef=beta)
        loss.backward()
    if stats is not None:
        with torch.no_grad():
            stats[role, "tokens"] += float(mask.sum())
            stats[role, "clipped"] += float(clipped.sum())
            stats[role, "ratio"] += float((ratio * mask).sum())
            if k3 is not None:
                stats[role, "kl"] += float((k3 * mask).sum())


def _denominator(samples, rows, loss_norm):
    """Sequences (seq) or completion tokens (token) of a mini-batch: what its loss divides by."""
    return len(rows) if loss_norm == "seq" else sum(len(samples[i].completion_ids) for i in rows)


def minibatch_gradients(policy, name, samples, rows, old, ref, *, temperature, clip_low,
                        clip_high, clip_c, loss_norm, kl_of, token_budget, acc=None, stats=None,
                        live=None, denom=None):
    """Accumulate the gradient of one mini-batch's loss into the .grad of adapter `name`, and
    return each (role, slot)'s part of it: {(role, slot): flattened contribution}.

    rows: indices into samples; old / ref: per-sample 1-D tensors (ref may hold None); kl_of:
    role -> KL coefficient; live: which rows run (needs_forward; default all); denom: the loss
    normalisation (default: this mini-batch's sequences or tokens; under data parallelism
    the global mini-batch's). Micro-batches
    run role by role and slot by slot, and the flattened gradient is read after each slot:
    the difference is that slot's contribution (it carries the slot's share of the loss
    normalisation, so it is not weighted again). If `acc` is given, the contributions are
    added to it in place and it is returned. `stats`, if given, is a defaultdict(float) keyed
    by (role, field) that gets token counts and sums."""
    params = policy.parameters_of(name)
    for p in params:  # zeros, not None: a mini-batch with nothing to run still steps AdamW
        p.grad = torch.zeros_like(p)
    obj = dict(temperature=temperature, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c,
               loss_norm=loss_norm)
    denom = denom or _denominator(samples, rows, loss_norm)
    by_slot = defaultdict(list)
    for i in rows:
        by_slot[(samples[i].role, samples[i].slot)].append(i)
    out = {} if acc is None else acc
    prev = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    for role, slot in sorted(by_slot, key=lambda k: (policy.roles.index(k[0]), k[1])):
        run = [i for i in by_slot[role, slot] if live is None or live[i]]
        for mb in micro_batches(samples, run, token_budget):
            _micro_step(policy, name, samples, mb, old, ref, kl_of(role), denom, obj, stats)
        now = flat_grad(params)                  # (N,) the accumulated gradient so far
        part = now - prev
        out[role, slot] = out[role, slot] + part if (role, slot) in out else part
        prev = now
    return out


class CoherenceDamp:
    """The paper's coherence intervention (`--coherence-damp ROLE=LAMBDA`): at each optimizer
    step a role's gradient g is scaled by s = 1 - LAMBDA * max(0, cos(g, m)), where m is an
    EMA of the role's past (scaled) gradients, m <- d m + (1 - d) s g with d = 1 - 1/window
    (`--coherence-window`). A gradient that keeps pointing where the role already went is
    damped; the first step of a role (no history) is not. LAMBDA 0 leaves the update exact."""

    def __init__(self, lambdas: dict, window: int = 10):
        if window < 1:
            raise ValueError("coherence window must be >= 1")
        self.lambdas, self.decay, self.ema = dict(lambdas), 1.0 - 1.0 / window, {}

    def __call__(self, role: str, g):
        """(scale, cosine or None) for this step's gradient of `role`; updates its EMA."""
        if role not in self.lambdas:
            return 1.0, None
        m = self.ema.get(role)
        cos = _cos(g, m) if m is not None else None
        scale = 1.0 - self.lambdas[role] * max(0.0, cos) if cos is not None else 1.0
        self.ema[role] = g * scale if m is None else m.mul_(self.decay).add_(g, alpha=(1 - self.decay) * scale)
        return scale, cos

    def state_dict(self) -> dict:
        return {"ema": {r: m.cpu() for r, m in self.ema.items()}}

    def load_state_dict(self, state: dict, device=None) -> None:
        self.ema = {r: m.to(device) if device is not None else m for r, m in state["ema"].items()}


def _cos(a, b):
    na, nb = float(a.norm()), float(b.norm())
    return None if na == 0 or nb == 0 else float(a @ b) / (na * nb)


class StepLog:
    """What one training step measured, gathered while the adapters update."""

    def __init__(self):
        self.stats = defaultdict(float)        # (role, field) -> token counts and sums
        self.opt_norms = defaultdict(list)     # role -> norm of its part of each optimizer step
        self.damp = defaultdict(list)          # role -> (cosine, scale) per optimizer step
        self.opt_steps = defaultdict(int)      # role -> optimizer steps whose mini-batch held it
        self.role_norm, self.slot_norm, self.adapters = {}, {}, {}
        self.coherence, self.slot_cos, self.cos_roles = {}, {}, {}


def optimizer_step(opt, params, parts, max_grad_norm, damp, log):
    """Damp (if asked), clip and apply one mini-batch's gradient; return its pre-clip norm.
    parts: {(role, slot): contribution}; their sum is what .grad holds."""
    by_role = defaultdict(list)
    for (role, _), v in parts.items():
        by_role[role].append(v)
    scales = {}
    for role, vs in by_role.items():
        g = torch.stack(vs).sum(0) if len(vs) > 1 else vs[0]
        log.opt_norms[role].append(float(g.norm()))   # before damping and clipping
        log.opt_steps[role] += 1
        if damp is not None:
            scales[role], cos = damp(role, g)
            if cos is not None:
                log.damp[role].append((cos, scales[role]))
    if any(s != 1.0 for s in scales.values()):  # only then rebuild: scale 1 keeps .grad exact
        set_flat_grad(params, sum(v * scales.get(role, 1.0) for (role, _), v in parts.items()))
    if max_grad_norm and max_grad_norm > 0:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    else:
        norm = float(flat_grad(params).norm())
    opt.step()
    return norm


def minibatches(rows, offset, total, n_mb):
    """This rank's part of each of the step's n_mb mini-batches. The global order is every
    rank's rows one rank after the other (this rank's start at `offset` of `total`), cut into
    n_mb contiguous pieces whose sizes differ by at most one, so every mini-batch holds rows
    and one process cuts exactly as N processes together do."""
    out = []
    for k in range(n_mb):
        lo, hi = k * total // n_mb - offset, (k + 1) * total // n_mb - offset
        out.append(rows[max(0, lo):max(0, min(len(rows), hi))])
    return out


def _reduce_parts(comm, parts, keys, params):
    """Sum every (role, slot) part over ranks (zeros where a rank has none) and set .grad to
    their sum: the global gradient of this optimizer step."""
    n = sum(p.numel() for p in params)
    held = comm.sum([float(k in parts) for k in keys])   # which parts some rank has
    stack = torch.stack([parts[k] if k in parts else torch.zeros(n, device=params[0].device) for k in keys])
    comm.all_reduce_(stack)                          # (K, N)
    set_flat_grad(params, stack.sum(0))
    return {k: stack[j] for j, k in enumerate(keys) if held[j]}


def adapter_step(policy, name, opt, samples, rows, live, old, ref, kl_of, obj, mini_batch,
                 max_grad_norm, generator, damp, log, comm=None):
    """Every mini-batch of one adapter: shuffle its rows (not when generator is None), cut the
    step's rows into ceil(n / mini_batch) mini-batches (n over every rank), one optimizer step
    each; then reduce the step's diagnostics."""
    params = policy.parameters_of(name)
    counts = comm.gather(len(rows)) if comm else [len(rows)]
    offset, total = sum(counts[:comm.rank]) if comm else 0, sum(counts)
    log.adapters[name] = {"n": total, "opt_steps": 0, "grad_norm": 0.0, "lr": opt.param_groups[0]["lr"]}
    if not total:
        return
    if generator is not None:
        rows = [rows[j] for j in torch.randperm(len(rows), generator=generator).tolist()]
    keys = sorted({(samples[i].role, samples[i].slot) for i in rows})
    if comm:
        keys = sorted({tuple(k) for ks in comm.gather(keys) for k in ks})
    step_parts, norms = {}, []   # (role, slot) -> contribution summed over the step
    for mb in minibatches(rows, offset, total, math.ceil(total / mini_batch)):
        denom = _denominator(samples, mb, obj["loss_norm"])
        parts = minibatch_gradients(policy, name, samples, mb, old, ref, kl_of=kl_of, stats=log.stats,
                                    live=live, denom=comm.sum(denom) if comm else denom, **obj)
        if comm:
            parts = _reduce_parts(comm, parts, keys, params)
        norms.append(optimizer_step(opt, params, parts, max_grad_norm, damp, log))
        for k, v in parts.items():
            step_parts[k] = step_parts[k].add_(v) if k in step_parts else v
    opt.zero_grad(set_to_none=True)
    log.adapters[name].update(opt_steps=len(norms), grad_norm=sum(norms) / len(norms))
    reduce_diagnostics(policy, step_parts, log)


def reduce_diagnostics(policy, parts, log):
    """Per-role and per-slot norms, slot cosines, coherence and role cosines of one adapter's
    step contributions, as floats (the vectors are freed after)."""
    roles_here = sorted({r for r, _ in parts}, key=policy.roles.index)
    rvec = {}
    for role in roles_here:
        keys = sorted(k for k in parts if k[0] == role)
        rvec[role] = sum(parts[k] for k in keys)
        log.role_norm[role] = float(rvec[role].norm())
        for k in keys:
            log.slot_norm[k[1]] = float(parts[k].norm())
        if len(keys) > 1:
            total = sum(log.slot_norm[k[1]] for k in keys)
            if total > 0:
                log.coherence[role] = log.role_norm[role] / total
            pairs = {f"{a[1]}|{b[1]}": _cos(parts[a], parts[b]) for i, a in enumerate(keys) for b in keys[i + 1:]}
            log.slot_cos[role] = {k: c for k, c in pairs.items() if c is not None}
    for i, a in enumerate(roles_here):
        for b in roles_here[i + 1:]:
            c = _cos(rvec[a], rvec[b])
            if c is not None:
                log.cos_roles[f"{a}|{b}"] = c


def _step_schedulers(schedulers):
    for sched in schedulers.values():
        with warnings.catch_warnings():
            # an adapter without samples this step took no optimizer step; torch's order warning
            # does not apply, since the schedule counts training steps, not optimizer steps
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            sched.step()


def update(policy, optimizers, schedulers, samples, *, temperature, mini_batch=512, clip_low=0.2,
           clip_high=0.28, clip_c=3.0, loss_norm="seq", kl_coef=0.0, kl_coef_role=None,
           max_grad_norm=1.0, token_budget=8192, generator=None, damp=None, skip_zero=True,
           comm=None) -> dict:
    """One training step over `samples`; returns the step's metrics (docs/RUNFOLDER.md).

    Steps: (1) old logprobs (and the base's, for roles with a KL coefficient) recomputed once,
    before any parameter moves, for the rows that can move the weights (needs_forward);
    (2) for each adapter name: its samples (those of the roles routed to it) are shuffled with
    `generator` and cut into mini-batches of `mini_batch` sequences; each mini-batch takes one
    optimizer step after gradient accumulation over micro-batches, the optional coherence
    damping (`damp`, a CoherenceDamp) and clipping to `max_grad_norm`; (3) every scheduler
    steps once; (4) the diagnostics are summarised (`summarise`). With `comm` (parallel.Comm,
    under torchrun) `samples` are this rank's, and every count, norm and mean is global."""
    if loss_norm not in ("seq", "token"):
        raise ValueError(f"loss_norm must be seq or token, got {loss_norm!r}")
    if mini_batch < 1:
        raise ValueError("mini_batch must be >= 1")
    kl_coef_role = dict(kl_coef_role or {})
    unknown = set(kl_coef_role) - set(policy.roles)
    if unknown:
        raise KeyError(f"kl_coef_role names roles {sorted(unknown)} not in {policy.roles}")

    def kl_of(role):
        return float(kl_coef_role.get(role, kl_coef))

    by_name = defaultdict(list)
    for i, s in enumerate(samples):
        by_name[policy.adapter(s.role)].append(i)
    live = needs_forward(samples, kl_of, skip_zero)
    old, ent, ref = old_logprobs(policy, samples, by_name, live, kl_of, temperature, token_budget)
    obj = dict(temperature=temperature, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c,
               loss_norm=loss_norm, token_budget=token_budget)
    log = StepLog()
    for name in policy.names:
        adapter_step(policy, name, optimizers[name], samples, by_name.get(name, []), live, old, ref,
                     kl_of, obj, mini_batch, max_grad_norm, generator, damp, log, comm)
    _step_schedulers(schedulers)
    return summarise(policy, samples, live, old, ent, log, kl_of, comm)


ROLE_SUMS = ("n", "toks", "skipped", "trunc", "ent", "ent_n", "gap", "gap_n", "tokens", "clipped", "ratio", "kl")


def _role_sums(samples, idx, live, old, ent, log, role) -> list:
    """One role's additive numbers on this rank, in ROLE_SUMS order; the token statistics
    cover the rows that ran."""
    ran = [i for i in idx if live[i]]
    gap = gap_n = 0.0
    for i in ran:
        sl = samples[i].sampler_logprobs
        if len(sl) == len(samples[i].completion_ids):  # skip rows without sampler logprobs
            gap += float((torch.tensor(sl, device=old[i].device) - old[i]).abs().sum())
            gap_n += len(sl)
    return [len(idx), sum(len(samples[i].completion_ids) for i in idx), len(idx) - len(ran),
            sum(not samples[i].finished for i in idx), float(sum(ent[i].sum() for i in ran)),
            sum(len(ent[i]) for i in ran), gap, gap_n,
            *(log.stats[role, k] for k in ("tokens", "clipped", "ratio", "kl"))]


def _role_summary(s: dict, log, role, total_norm, kl: bool) -> dict:
    """The role's metrics from its summed numbers; a token statistic of a role none of whose
    rows ran (every advantage 0) is None, not 0."""
    t = s["tokens"] or None
    norm, opt = log.role_norm.get(role, 0.0), log.opt_norms.get(role, [])
    r = {"n": int(s["n"]), "len": s["toks"] / s["n"], "skipped": int(s["skipped"]), "trunc_frac": s["trunc"] / s["n"],
         "grad_norm": norm, "grad_share": norm / total_norm if total_norm > 0 else 0.0,
         "grad_norm_opt": sum(opt) / len(opt) if opt else 0.0, "grad_norm_opt_max": max(opt, default=0.0),
         "clip_frac": t and s["clipped"] / t, "ratio_mean": t and s["ratio"] / t,
         "entropy": s["ent"] / s["ent_n"] if s["ent_n"] else None,
         "logprob_gap": s["gap"] / s["gap_n"] if s["gap_n"] else None, "opt_steps": log.opt_steps[role]}
    if kl:
        r["kl"] = t and s["kl"] / t
    if log.damp.get(role):
        r["damp_cos"] = sum(c for c, _ in log.damp[role]) / len(log.damp[role])
        r["damp_scale"] = sum(s for _, s in log.damp[role]) / len(log.damp[role])
    return r


def summarise(policy, samples, live, old, ent, log, kl_of, comm=None) -> dict:
    """The step's metrics (every field is described in docs/RUNFOLDER.md).

    Per role: n, len, skipped (rows with zero gradient that did not run), trunc_frac,
    grad_norm (norm of the role's contribution summed over the step, before clipping),
    grad_share (that norm over the sum of every role's norm), grad_norm_opt / _max (mean / max
    over the optimizer steps that held the role of the norm of its part of that step's
    gradient, before damping and clipping), clip_frac, ratio_mean, entropy, logprob_gap
    (token means over the rows that ran), opt_steps, kl (when its coefficient is set),
    damp_cos / damp_scale (with the coherence intervention). Per slot: n, len, grad_norm.
    dominant_role (absent when no role had any gradient), cos_roles (pairs of roles on one
    adapter), slot_cos and coherence ||sum_k g_k|| / sum_k ||g_k|| for roles with several
    slots; adapters: {name: {n, opt_steps, grad_norm (mean pre-clip norm per step), lr}}.

    Memory of the diagnostics: per slot of an adapter, one fp32 vector the size of the adapter
    for the mini-batch and one for the step, plus two snapshots, held while that adapter's
    mini-batches run. For LoRA rank 64 on Qwen3-4B an adapter is ~130M numbers (~0.5 GB), so
    Voting under shared holds ~5 GB; with --isolation full they are the size of the model,
    which is why full copies are for small models only."""
    sums = [_role_sums(samples, [i for i, s in enumerate(samples) if s.role == role], live, old, ent, log, role)
            for role in policy.roles]
    slots = list(dict.fromkeys(s.slot for s in samples))
    if comm:
        slots = list(dict.fromkeys(s for ss in comm.gather(slots) for s in ss))
    slot_sums = [[sum(s.slot == k for s in samples), sum(len(s.completion_ids) for s in samples if s.slot == k)]
                 for k in slots]
    if comm:  # one collective for every number of the step
        flat = comm.sum([x for r in sums for x in r] + [x for r in slot_sums for x in r])
        sums = [flat[j * len(ROLE_SUMS):(j + 1) * len(ROLE_SUMS)] for j in range(len(sums))]
        rest = flat[len(sums) * len(ROLE_SUMS):]
        slot_sums = [rest[2 * j:2 * j + 2] for j in range(len(slots))]
    total_norm = sum(log.role_norm.values())
    roles = {role: _role_summary(dict(zip(ROLE_SUMS, s)), log, role, total_norm, bool(kl_of(role)))
             for role, s in zip(policy.roles, sums) if s[0]}
    out = {"roles": roles, "adapters": log.adapters,
           "slots": {k: {"n": int(n), "len": t / n, "grad_norm": log.slot_norm.get(k, 0.0)}
                     for k, (n, t) in zip(slots, slot_sums) if n},
           "lr": next(iter(log.adapters.values()))["lr"] if log.adapters else 0.0}
    if total_norm > 0:
        out["dominant_role"] = max(roles, key=lambda r: roles[r]["grad_share"])
    if log.cos_roles:
        out["cos_roles"] = log.cos_roles
    if log.coherence:
        out["coherence"] = log.coherence
    if any(log.slot_cos.values()):
        out["slot_cos"] = {k: v for k, v in log.slot_cos.items() if v}
    return out
