"""GRPO for workflows: the paper's update, and only that.

Objective minimised at each optimizer step, over the mini-batch M of one optimizer:

    L = mean_{i in M} mean_{t < |o_i|} l_it                                     (--loss-norm seq)
    l_it = w_it min*( max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high)) ) + beta_role k3_it
    r_it = exp(logp_theta(o_it) - logp_old(o_it)),   min*(x) = min(x, c |A_i|) if A_i < 0 else x
    w_it = min(exp(logp_old(o_it) - logp_sampler(o_it)), C) with --tis C, else 1 (no weight at all)
    k3_it = exp(logp_ref - logp_theta) - (logp_ref - logp_theta) - 1
    A_i  = (R_i - mean_g R) / (std_g R + 1e-6)  over the group g of i (unbiased std; a group of
           one has mean 0 and std 1, so A = R)

Each choice and the train.py flag that sets it (the flags fill a `Hyper`, fields of the same names):
- group g = (problem, slot) (`--adv-group slot`, the paper), or (problem, role) with every
  same-role slot pooled (`--adv-group role`). R_i: the episode's 0/1 reward, copied to each call
  (`--credit final`, the paper), or for a solution role's call the grade of its own text
  (`--credit own`, workflows.pay).
- eps_low / eps_high: `--clip-low 0.2 --clip-high 0.28` (clip-higher); c: `--clip-c 3.0` (dual
  clip: for A < 0 a token's loss is capped at c |A|, so a huge ratio cannot blow up the step).
- normalisation: `--loss-norm seq` (mean over sequences of each sequence's token mean, paper) or
  `--loss-norm token` (sum over every token of the mini-batch / their number).
- KL: beta_role = `--kl-coef` (0, off, as in the paper), overridden per role by
  `--kl-coef-role ROLE=VALUE`; the reference is the base model (`policy.using(None)`: for LoRA,
  the adapter switched off). No entropy bonus.
- logp_old comes from the trainer's own forward at the weights the rollout used, never from
  the sampler (whose logprobs differ numerically even at equal weights; the gap is logged):
  `old_logprobs` recomputes it once, before the first optimizer step, for the rows after each
  adapter's first mini-batch (a no-grad forward through `policy.inference`, which on an fp32
  base folds the adapter into the base weights, equal to the hooked forward within fp32
  rounding); the first mini-batch runs at those same weights, so `micro_loss` takes its rows'
  own logprobs, detached, as theirs and returns them. On CUDA "within fp32 rounding" is within
  TF32's (policies.cuda_settings), and in bf16 the recompute batches rows otherwise than the
  training forward, so a later mini-batch's ratio at unchanged weights is 1 only to bf16
  rounding (about 1e-2 in a token's logp), where the first one's is exactly 1.
- w_it, the sampler's drift corrected (`--tis C`, default 0: off, as in the paper): the
  sampler's logprobs differ from the trainer's at equal weights (another kernel, in bf16
  another rounding), so `tis_weights` reweights each token by p_old / p_sampler, capped at C.
  On fp32 (the toy, every CPU run) the weights are 1 within rounding; on bf16 at the paper's
  lengths turn it on. The drift is logged every step either way (`drift`).
- one epoch; each optimizer's n samples are shuffled and cut into ceil(n / `--mini-batch`)
  mini-batches of near-equal size (512 each at the paper's settings), one AdamW step (betas 0.9,
  0.999; `--weight-decay` 0) per mini-batch (so a role with more calls takes more steps under
  isolated), gradients accumulated over micro-batches of about `--token-budget` tokens
  (`forward_batches`), clipped to `--max-grad-norm` per optimizer step; lr `--lr` with
  `--warmup-steps` of linear warm-up then cosine to 0 over `--steps`; under isolated a role's
  own lr with `--lr-role ROLE=VALUE`, where 0 freezes the role.

Devices that keep memory and time bounded without changing the gradient (beyond fp32 rounding):
- the packed forward (packed.py, `row_logprobs`), used wherever the model allows (a decoder and
  a plain linear head; `Hyper.packing`, on): no pad token, each row's attention over its own
  keys only, the head only at completion positions, in chunks, with no (N, V) tensor;
- `forward_batches`: rows of alike length cut into micro-batches of `--token-budget` tokens
  (their own tokens when packed, rows x padded length otherwise);
- `rows_to_run`: a row with advantage exactly 0 and no KL has a loss of -0 * ratio, so no
  gradient: it skips the old-logprob recompute and the training forward and backward, and
  still counts in the denominators;
- only the passes the loss needs: the reference forward only for rows whose role has a KL
  coefficient, old logprobs only after the first mini-batch (above), in the training
  forward's layout, and entropies only for a probe that logs them (`Probe.entropy`).

The plain layout, `batch_logprobs` (what rollout.generate_simple does; the reference the
packed forward is tested against): prompts left-padded to P, completions right after them (so
every completion starts at column P) and right-padded to T; position_ids = cumsum(mask) - 1;
the attention mask is always passed; the logprob of completion token t is read from the logits
at position P-1+t, chunk by chunk by `token_logprobs` (no (B, T, V) fp32 tensor held).

Under torchrun each optimizer step's gradient is summed over the ranks inside `update`, by the
`reduce` it is given (parallel.Comm.reduce_grads), so N ranks take the steps one process holding
every row would. What observes the update plugs in through a `Probe`, which only reads
(dynamics.RoleDynamics: the role-level gradient dynamics); the one thing that may change a
gradient, coherence damping (damping.py), plugs in through an `Intervention`. Both base classes
do nothing, so `update(..., probe=None, intervention=None)` is the plain method.
Micro-batches hold one slot each (rows of one (role, slot), packed by length), so a probe or
an intervention splits the gradient by slot by reading .grad between them, without an extra
backward.

Run the tests: `python -m pytest -q tests/test_grpo.py`.
"""
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch

import packed


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
    reward: float              # what the call is paid: its episode's reward, or its own (--credit own)
    advantage: float           # group-normalised reward
    rollout: int = 0           # which of the problem's G episodes (for logs)
    call: int = 0              # index of the call within its episode (for logs)
    here: bool = True          # False: another rank's row, a stand-in (no prompt) its rank runs; counted here


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
    """Every sampled call of every (scored) episode as a Sample, with its group's advantage (a
    call never sampled, its prompt over the length limit, is left out of its group).

    Reads only attributes: episode.problem_id, .rollout, .reward, .calls; call.role, .slot,
    .prompt_ids, .completion_ids, .logprobs, .finished, and .reward where it is set (what the
    call is paid under --credit own, workflows.pay) instead of the episode's."""
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
                                  bool(c.finished), float(_paid(ep, c)), 0.0, ep.rollout, i))
    keys = [(s.problem_id, s.slot if group_by == "slot" else s.role) for s in samples]
    for s, a in zip(samples, group_advantages([s.reward for s in samples], keys)):
        s.advantage = a
    return samples


def _paid(episode, call) -> float:
    """The call's own reward where one was set (workflows.pay), else its episode's."""
    own = getattr(call, "reward", None)
    return episode.reward if own is None else own


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


def token_logprobs(logits, tokens, temperature: float):
    """fp32 logprob (N,) of `tokens` (N,) under softmax(logits / temperature), with logits
    (N, V) in the model's dtype; differentiable, with no (N, V) fp32 tensor kept."""
    return _TokenLogprob.apply(logits, tokens, float(temperature))


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


def forward_batches(samples: list, rows: list, token_budget: int, packing: bool = False) -> list:
    """The micro-batches of one forward and backward each: `rows` (indices into samples) split
    into lists whose tokens fit token_budget: rows x padded length (longest prompt + longest
    completion), or with `packing` the rows' own tokens; sorted by length so rows of a batch
    are alike. A row longer than the budget gets a micro-batch of its own."""
    order = sorted(rows, key=lambda i: (len(samples[i].prompt_ids) + len(samples[i].completion_ids),
                                        len(samples[i].prompt_ids)), reverse=True)
    out, cur, P, T, own = [], [], 0, 0, 0
    for i in order:
        p, t = max(P, len(samples[i].prompt_ids)), max(T, len(samples[i].completion_ids))
        own += len(samples[i].prompt_ids) + len(samples[i].completion_ids)
        if cur and (own if packing else (len(cur) + 1) * (p + t)) > token_budget:
            out.append(cur)
            cur, p, t = [], len(samples[i].prompt_ids), len(samples[i].completion_ids)
            own = p + t
        cur.append(i)
        P, T = p, t
    if cur:
        out.append(cur)
    return out


def row_logprobs(model, prompts: list, completions: list, temperature: float, entropy: bool = False,
                 packing: bool = True):
    """(logp (B, T), entropy (B, T) or None, mask (B, T)) of a micro-batch, as batch_logprobs
    returns them, through the packed forward (packed.py: no pad token, the head only at
    completion positions) where `packing` and the model allow, else through batch_logprobs."""
    if not packed.used(model, packing):
        return batch_logprobs(model, prompts, completions, temperature, entropy=entropy)
    lp, ent = packed.logprobs(model, prompts, completions, temperature, entropy=entropy)   # (n,) each
    n = torch.tensor([len(c) for c in completions], device=lp.device)                     # (B,)
    mask = torch.arange(int(n.max()), device=lp.device)[None, :] < n[:, None]               # (B, T)
    return (lp.new_zeros(mask.shape).masked_scatter(mask, lp),
            ent.new_zeros(mask.shape).masked_scatter(mask, ent) if ent is not None else None, mask)


def sequence_logprobs(model, samples: list, temperature: float, token_budget: int = 8192, entropy: bool = True,
                      packing: bool = True):
    """Per-sample fp32 logprobs of the completion tokens (list of 1-D tensors, in the order of
    `samples`) and their entropies (same shape, no grad; None each without `entropy`). Grad
    flows if grad is enabled."""
    lps, ents = [None] * len(samples), [None] * len(samples)
    for mb in forward_batches(samples, list(range(len(samples))), token_budget, packing):
        lp, ent, _ = row_logprobs(model, [samples[i].prompt_ids for i in mb], [samples[i].completion_ids for i in mb],
                                  temperature, entropy=entropy, packing=packing)
        for r, i in enumerate(mb):
            n = len(samples[i].completion_ids)
            lps[i], ents[i] = lp[r, :n], ent[r, :n] if ent is not None else None
    return lps, ents


# ----------------------------------------------------------------------------- objective

def objective(logp, old_logp, adv, mask, *, clip_low: float, clip_high: float, clip_c: float,
              loss_norm: str, denom: float, ref_logp=None, kl_coef: float = 0.0, tis=None):
    """This micro-batch's part of the mini-batch loss (the parts sum to the mini-batch loss).

    logp, old_logp, ref_logp, mask: (B, T); adv: (B,). `denom` is the mini-batch's number of
    sequences (loss_norm "seq") or of completion tokens ("token"). `tis` (B, T), detached: each
    token's policy term is weighted by it (`tis_weights`); None weighs nothing, not even by 1.
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
    if tis is not None:   # the policy term only, as verl does; the KL-to-base term keeps its own estimator
        tok = tok * tis
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


def tis_weights(old_logp, sampler_logp, cap: float):
    """min(p_old / p_sampler, cap) per token (B, T), no grad: truncated importance sampling at the
    token level, as verl and TRL do (2 is verl's usual cap). The tokens were drawn by the sampler,
    whose numbers differ from the trainer's (compounding over long completions); the ratio
    reweights the loss's expectation to the trainer's old policy, and the cap bounds the variance
    a token whose sampler logprob is far too low could add. With `--top-p` < 1 the sampler's
    logprob is the nucleus's (p / the mass kept) and logp_old the full softmax's, so the weight
    would be the mass kept, not a drift: flags.py refuses the pair."""
    with torch.no_grad():
        return torch.exp((old_logp - sampler_logp).clamp(max=math.log(cap)))


def drift(old_logp, sampler_logp, cap: float) -> list:
    """The sampler's drift from the trainer over one row's tokens (1-D each), as additive sums
    and one max: [sum |d|, max |d|, sum k3, tokens whose ratio p_old / p_sampler leaves
    [1/cap, cap], tokens], d = logp_old - logp_sampler. k3 = exp(d) - d - 1 estimates
    KL(sampler || trainer) from the sampler's own draws (>= 0, unbiased). Logged every step,
    corrected or not, with cap = --tis or DRIFT_CAP (`Hyper.drift_cap`)."""
    d = (old_logp - sampler_logp).double()
    if not len(d):
        return [0.0, 0.0, 0.0, 0, 0]
    return [float(d.abs().sum()), float(d.abs().max()), float((d.exp() - d - 1).sum()),
            int((d.abs() > math.log(cap)).sum()), len(d)]


# ----------------------------------------------------------------------------- optimizers

def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base lr for the training step after `step` scheduler steps: linear
    warm-up (step+1)/warmup, then cosine from 1 down to 0 at step == total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizers(policy, lr: float, warmup_steps: int, total_steps: int,
                    weight_decay: float = 0.0, betas=(0.9, 0.999), lr_role: dict | None = None):
    """One AdamW per adapter name of the policy, and one LambdaLR per AdamW.

    `lr_role` {role: lr} sets the base lr of the adapter that role trains (one role per adapter
    under isolated); an adapter whose base lr is 0 is frozen (`frozen`).
    The schedulers are stepped once per training step, every one of them, however many
    mini-batches (optimizer steps) its adapter took: so every role follows the same lr curve in
    training steps, and a role that makes more calls takes more steps, not a faster-decaying lr."""
    lr_of = {policy.adapter(role): v for role, v in (lr_role or {}).items()}
    opts, scheds = {}, {}
    for name in policy.names:
        opts[name] = torch.optim.AdamW(policy.parameters_of(name), lr=lr_of.get(name, lr), betas=betas,
                                       weight_decay=weight_decay)
        opts[name].param_groups[0]["frozen"] = lr_of.get(name) == 0   # saved with the optimizer's state
        scheds[name] = torch.optim.lr_scheduler.LambdaLR(
            opts[name], lambda s: lr_factor(s, warmup_steps, total_steps))
    return opts, scheds


def frozen(optimizer) -> bool:
    """The optimizer of a role given lr 0 (`--lr-role ROLE=0`): its adapter takes no step at all, so
    not even AdamW's weight decay moves it, and its rows run no forward. (A global `--lr 0` is
    not a freeze: every step still runs, at lr 0.)"""
    return bool(optimizer.param_groups[0].get("frozen", False))


def step_schedulers(schedulers) -> None:
    for sched in schedulers.values():
        with warnings.catch_warnings():
            # an adapter without samples this step took no optimizer step; torch's order warning
            # does not apply, since the schedule counts training steps, not optimizer steps
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            sched.step()


# ----------------------------------------------------------------------------- the update

DRIFT_CAP = 2.0   # the share of tokens whose sampler/trainer ratio leaves [1/2, 2] is logged without --tis


@dataclass
class Hyper:
    """The update's hyper-parameters; train.py fills them from its flags of the same names."""
    temperature: float = 0.7
    mini_batch: int = 512           # at most this many sequences per optimizer step
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 3.0             # dual clip
    loss_norm: str = "seq"          # "seq" or "token"
    kl_coef: float = 0.0
    kl_coef_role: dict = field(default_factory=dict)   # {role: coefficient}, overrides kl_coef
    max_grad_norm: float = 1.0      # 0: no clipping
    token_budget: int = 8192        # tokens per micro-batch (forward_batches)
    skip_zero: bool = True          # skip rows with no gradient (see rows_to_run)
    packing: bool = True            # the packed forward (packed.py) where the model allows
    tis: float = 0.0                # cap C of the tokens' truncated importance weights; 0: none

    @property
    def drift_cap(self) -> float:
        """C of the drift's out-of-range share: the --tis cap, else DRIFT_CAP."""
        return self.tis or DRIFT_CAP

    def __post_init__(self):
        if self.loss_norm not in ("seq", "token"):
            raise ValueError(f"loss_norm must be seq or token, got {self.loss_norm!r}")
        if self.mini_batch < 1:
            raise ValueError("mini_batch must be >= 1")
        if self.tis and self.tis <= 1:
            raise ValueError(f"tis must be 0 (off) or a cap above 1, got {self.tis}")

    def kl(self, role: str) -> float:
        return float(self.kl_coef_role.get(role, self.kl_coef))


class Probe:
    """The seam through which diagnostics read the update; a probe only reads (removing it
    leaves the same weights). `update` calls these hooks in this order; every one does nothing
    here. `entropy`: whether the old logprobs it reads come with their entropies (None each
    without; they cost a softmax pass over the vocabulary)."""
    entropy = False

    def begin(self, samples, runs):
        """Before the first adapter: the rows and which of them run."""

    def old_logprobs(self, old):
        """{row: (old logprob, entropy)} as they become known: the recomputed ones before the
        first adapter, then each first mini-batch's own."""

    def tokens(self, role, mask, ratio, clipped, k3):
        """After a micro-batch's loss: its per-token tensors, (B, T) each (k3 may be None)."""

    def slot_done(self, name, role, slot, params):
        """After the backward of a slot's micro-batches in the mini-batch: .grad holds this
        process's gradient so far."""

    def before_step(self, name, params):
        """.grad holds the mini-batch's whole gradient, summed over the ranks, before any
        intervention and clipping."""

    def after_step(self, name, norm):
        """After the optimizer step; `norm` is the gradient's norm before clipping."""

    def adapter_done(self, name, rows, lr):
        """After the adapter's last step: the number of its rows and the lr it used."""


class Intervention:
    """The seam of what may change a gradient before the optimizer takes it (coherence damping,
    damping.py). `update` calls `begin` once, `slot_done` after each slot's backward (so the
    gradient can be split by role, as a Probe does) and `adjust` once per optimizer step, after
    the cross-rank sum and the probe's reading, before clipping. Here it changes nothing."""

    def begin(self):
        """Before the first adapter of a training step."""

    def slot_done(self, name, role, slot, params):
        """As Probe.slot_done."""

    def adjust(self, name, params):
        """May rewrite .grad (the global gradient of the optimizer step)."""


def rows_to_run(samples, hp: Hyper) -> list:
    """Which rows run a forward here: those that can move the weights (with A = 0 the policy
    term is -0 * ratio, so a row whose role has no KL coefficient has exactly zero gradient)
    and that this process holds."""
    return [s.here and (not hp.skip_zero or s.advantage != 0.0 or hp.kl(s.role) != 0.0) for s in samples]


@torch.no_grad()
def old_logprobs(policy, samples, rows: list, hp: Hyper, entropy: bool = True) -> dict:
    """{i: (old logprob, entropy or None)}, 1-D tensors, of rows `rows`: a no-grad forward under
    each row's adapter before any parameter moves (which rows: logp_old in the module docstring),
    laid out as the training forward lays them out (hp.packing)."""
    by_name = defaultdict(list)
    for i in rows:
        by_name[policy.adapter(samples[i].role)].append(i)
    out = {}
    for name, idx in by_name.items():
        with policy.inference(name) as model:
            lps, ents = sequence_logprobs(model, [samples[i] for i in idx], hp.temperature, hp.token_budget,
                                          entropy, hp.packing)
        out.update((i, (lp, e)) for i, lp, e in zip(idx, lps, ents))
    return out


@torch.no_grad()
def base_logprobs(policy, samples, rows: list, hp: Hyper) -> dict:
    """{i: logprob} under the frozen base model (the KL reference) of rows `rows` (those that
    run and whose role has a KL coefficient)."""
    if not rows:
        return {}
    with policy.inference(None) as model:
        lps, _ = sequence_logprobs(model, [samples[i] for i in rows], hp.temperature, hp.token_budget, False,
                                   hp.packing)
    return dict(zip(rows, lps))


def adapter_rows(policy, samples, name, shuffle=None) -> list:
    """The rows that train adapter `name`, shuffled with the torch.Generator `shuffle` (None: in
    order)."""
    rows = [i for i, s in enumerate(samples) if policy.adapter(s.role) == name]
    if shuffle is not None and rows:
        rows = [rows[j] for j in torch.randperm(len(rows), generator=shuffle).tolist()]
    return rows


def optimizer_batches(rows: list, size: int) -> list:
    """The mini-batches of one optimizer step each: ceil(n / size) contiguous pieces of `rows`,
    their sizes differing by at most one."""
    n = len(rows)
    k = math.ceil(n / size)
    return [rows[j * n // k:(j + 1) * n // k] for j in range(k)]


def denominator(samples, rows, loss_norm: str) -> int:
    """Sequences (seq) or completion tokens (token) of a mini-batch: what its loss divides by."""
    return len(rows) if loss_norm == "seq" else sum(len(samples[i].completion_ids) for i in rows)


def by_slot(samples, rows, roles) -> list:
    """[((role, slot), rows)] of a mini-batch, roles in the workflow's order, then slots."""
    groups = defaultdict(list)
    for i in rows:
        groups[samples[i].role, samples[i].slot].append(i)
    return sorted(groups.items(), key=lambda kv: (roles.index(kv[0][0]), kv[0][1]))


def _padded(ts, T, dev):
    """Per-sample 1-D tensors -> (B, T), zeros past each completion."""
    out = torch.zeros((len(ts), T), device=dev)
    for r, t in enumerate(ts):
        out[r, :len(t)] = t
    return out


def micro_loss(model, samples, rows, old: dict, base: dict, hp: Hyper, denom, entropy: bool = True):
    """The loss of one micro-batch (one slot, so one role) as its part of the mini-batch loss,
    its per-token (mask, ratio, clipped, k3), and the old logprobs and entropies it used, per
    row: `old`'s {i: (logprob, entropy)}, or for a row not in it its own, detached (logp_old in
    the module docstring), with its entropy if `entropy`. `base` {i: logprob}: the KL reference."""
    beta = hp.kl(samples[rows[0]].role)
    first = rows[0] not in old     # no logp_old yet: a row of its adapter's first mini-batch
    logp, ent, mask = row_logprobs(model, [samples[i].prompt_ids for i in rows],
                                   [samples[i].completion_ids for i in rows], hp.temperature,
                                   entropy=first and entropy, packing=hp.packing)                # (B, T)
    n = [len(samples[i].completion_ids) for i in rows]
    used = ({i: (logp[r, :n[r]].detach(), ent[r, :n[r]] if ent is not None else None) for r, i in enumerate(rows)}
            if first else {i: old[i] for i in rows})
    T, dev = logp.shape[1], logp.device
    adv = torch.tensor([samples[i].advantage for i in rows], device=dev, dtype=torch.float32)   # (B,)
    old_logp = _padded([used[i][0] for i in rows], T, dev)                                      # (B, T)
    tis = tis_weights(old_logp, _padded([sampler_logprobs(samples[i], used[i][0]) for i in rows], T, dev),
                      hp.tis) if hp.tis else None                                               # (B, T)
    loss, _, ratio, clipped, k3 = objective(
        logp, old_logp, adv, mask, clip_low=hp.clip_low, clip_high=hp.clip_high, clip_c=hp.clip_c,
        loss_norm=hp.loss_norm, denom=denom, ref_logp=_padded([base[i] for i in rows], T, dev) if beta else None,
        kl_coef=beta, tis=tis)
    return loss, (mask, ratio, clipped, k3), used


def sampler_logprobs(sample, old_logp):
    """The sampler's logprobs of a row's tokens as a tensor like `old_logp` (1-D); a row that
    carries none (a sampler that does not record them) gets `old_logp` itself: weight 1."""
    if len(sample.sampler_logprobs) != len(sample.completion_ids):
        return old_logp
    return torch.tensor(sample.sampler_logprobs, dtype=old_logp.dtype, device=old_logp.device)


def update(policy, optimizers, schedulers, samples, hp: Hyper, shuffle=None, reduce=None, probe=None,
           intervention=None) -> None:
    """One training step over `samples`: every adapter's rows shuffled with the torch.Generator
    `shuffle` (None: in order) and cut into mini-batches; the old logprobs (logp_old in the
    module docstring); one optimizer step per mini-batch, of the gradient summed over the
    data-parallel ranks by `reduce(params)` (parallel.Comm.reduce_grads; None in one process);
    then every scheduler steps once. A frozen adapter (`frozen`) takes no step and its rows run
    nothing."""
    probe, intervention = probe or Probe(), intervention or Intervention()
    if set(hp.kl_coef_role) - set(policy.roles):
        raise KeyError(f"kl_coef_role names roles {sorted(set(hp.kl_coef_role) - set(policy.roles))} not in {policy.roles}")
    names = [name for name in policy.names if not frozen(optimizers[name])]
    runs = [r and policy.adapter(s.role) in names for r, s in zip(rows_to_run(samples, hp), samples)]
    plan = {name: optimizer_batches(adapter_rows(policy, samples, name, shuffle), hp.mini_batch) for name in names}
    # an adapter's first mini-batch runs at the rollout's weights, so its own forward, detached, is
    # its logp_old (micro_loss); only the later mini-batches' rows need theirs now, before any step
    recompute = sorted(i for mbs in plan.values() for mb in mbs[1:] for i in mb if runs[i])   # samples' order
    old = old_logprobs(policy, samples, recompute, hp, probe.entropy)
    base = base_logprobs(policy, samples, [i for i, s in enumerate(samples) if runs[i] and hp.kl(s.role)], hp)
    probe.begin(samples, runs)
    probe.old_logprobs(old)
    intervention.begin()
    for name in names:
        opt, params = optimizers[name], policy.parameters_of(name)
        for mb in plan[name]:
            denom = denominator(samples, mb, hp.loss_norm)
            for p in params:  # zeros, not None: a mini-batch with nothing to run still steps AdamW
                p.grad = torch.zeros_like(p)
            for (role, slot), slot_rows in by_slot(samples, mb, policy.roles):
                for micro in forward_batches(samples, [i for i in slot_rows if runs[i]], hp.token_budget, hp.packing):
                    # the backward runs under the adapter and the packed attention too: checkpointed
                    # layers recompute in it
                    with policy.using(name) as model, packed.attention(model, hp.packing):
                        loss, per_token, used = micro_loss(model, samples, micro, old, base, hp, denom, probe.entropy)
                        loss.backward()
                    if micro[0] not in old:       # the first mini-batch's, from its own forward
                        old.update(used)
                        probe.old_logprobs(used)
                    probe.tokens(role, *per_token)
                probe.slot_done(name, role, slot, params)
                intervention.slot_done(name, role, slot, params)
            if reduce is not None:
                reduce(params)                # .grad: the global gradient of the mini-batch
            probe.before_step(name, params)
            intervention.adjust(name, params)
            norm = torch.nn.utils.clip_grad_norm_(params, hp.max_grad_norm or math.inf)
            opt.step()
            probe.after_step(name, float(norm))
        opt.zero_grad(set_to_none=True)
        probe.adapter_done(name, sum(map(len, plan[name])), opt.param_groups[0]["lr"])
    step_schedulers(schedulers)
