"""Role-level gradient dynamics of one training step: the numbers the paper explains its results
with, measured through grpo's Probe seam without an extra backward. A probe only reads: the
weights are the same with or without it.

    dyn = RoleDynamics(policy, comm=None, damp=None)
    grpo.update(policy, optimizers, schedulers, samples, hp, shuffle, probe=dyn)
    metrics = dyn.summary()          # the step's per-role, per-slot and per-adapter fields

How the parts are read (`SlotParts`): inside a mini-batch the update runs its micro-batches
grouped by role and, within a role, by slot, and calls `slot_done` after each slot; the
flattened gradient is read there, and the difference from the previous reading is that slot's
contribution (it carries the slot's share of the loss normalisation, so it is not weighted
again). Under data parallelism (`comm`) the parts are summed over the ranks here, by the probe
itself and only when it is on, so every norm, share, cosine and coherence is that of the
global gradient (the update sums the gradient itself). Summed over the step's mini-batches the
parts give the per-slot and per-role gradients (`grad_norm`); the norm of a role's part of each
optimizer step gives `grad_norm_opt`, the figure that compares roles taking different numbers
of steps; each adapter's weights before and after the step give its `displacement`. With
coherence damping (damping.py, which reads the parts the same way through grpo's Intervention
seam) the damper's cosines and scales are reported here. Every field: docs/RUNFOLDER.md.

Memory: per slot of an adapter, one fp32 vector the size of the adapter for the mini-batch and
one for the step, plus two readings of the gradient and a copy of the adapter's weights, held
while that adapter's mini-batches run. For LoRA rank 64 on Qwen3-4B an adapter is ~130M numbers
(~0.5 GB), so Voting under shared holds ~5 GB; with --isolation full they are the size of the
model, which is why full copies are for small models only.
"""
from collections import defaultdict

import torch

import grpo


def flat_grad(params) -> torch.Tensor:
    """(N,) fp32 concatenation of the parameters' gradients (zeros where there is none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in params])


def flat_params(params) -> torch.Tensor:
    """(N,) fp32 copy of the parameters' values, in flat_grad's order."""
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def set_flat_grad(params, vec) -> None:
    """Write the (N,) vector back into the parameters' .grad, in flat_grad's order."""
    k = 0
    for p in params:
        n = p.numel()
        p.grad = vec[k:k + n].view_as(p).to(p.dtype).clone()
        k += n


def cosine(a, b):
    """cos(a, b) as a float, None when either is zero."""
    na, nb = float(a.norm()), float(b.norm())
    return None if na == 0 or nb == 0 else float(a @ b) / (na * nb)


class SlotParts:
    """Each (role, slot)'s part of an optimizer step's gradient, read without an extra backward:
    `update` runs a mini-batch's micro-batches slot by slot, so the difference between two
    readings of .grad is one slot's contribution (with the slot's share of the loss
    normalisation). Under data parallelism (`comm`) `take` sums every part over the ranks, so
    the parts are those of the global gradient; they sum to it within rounding."""

    def __init__(self, comm=None):
        self.comm, self.parts, self.last = comm, {}, None

    def read(self, role, slot, params) -> None:
        now = flat_grad(params)                   # (N,) this process's gradient so far
        self.parts[role, slot] = now if self.last is None else now - self.last
        self.last = now

    def take(self) -> dict:
        """{(role, slot): (N,) part} of the optimizer step, then start the next one. Every rank
        holds the same keys in the same order, since every rank walks the same global mini-batch."""
        parts, self.parts, self.last = self.parts, {}, None
        if self.comm and parts:
            keys = list(parts)
            stack = self.comm.all_reduce_(torch.stack([parts[k] for k in keys]))   # (K, N)
            parts = {k: stack[j] for j, k in enumerate(keys)}
        return parts


def by_role(parts) -> dict:
    """{role: the sum of its slots' parts}."""
    out = defaultdict(list)
    for (role, _), v in parts.items():
        out[role].append(v)
    return {role: torch.stack(vs).sum(0) if len(vs) > 1 else vs[0] for role, vs in out.items()}


class RoleDynamics(grpo.Probe):
    """Per-role and per-slot gradient norms, shares, cosines and coherence of one step, each
    adapter's displacement, and the token statistics of the objective; `summary()` gives them as
    the step's metrics. With `damp` (the damping.CoherenceDamp the update is given) it also
    reports the damping's cosines and scales."""

    entropy = True   # the old logprobs' entropies are logged (`entropy`)

    def __init__(self, policy, comm=None, damp=None):
        self.policy, self.comm, self.damp = policy, comm, damp
        self.stats = defaultdict(float)        # (role, field) -> token counts and sums
        self.opt_norms = defaultdict(list)     # role -> norm of its part of each optimizer step
        self.opt_steps = defaultdict(int)      # role -> optimizer steps whose mini-batch held it
        self.role_norm, self.slot_norm, self.adapters = {}, {}, {}
        self.coherence, self.slot_cos, self.cos_roles, self.move_cos = {}, {}, {}, {}
        self.reader = SlotParts(comm)          # the (role, slot) parts of the optimizer step
        self.step_parts = {}                   # (role, slot) -> its parts summed over the step
        self.norms = []                        # pre-clip norm of each of the adapter's steps

    # ------------------------------------------------------------------ the hooks

    def begin(self, samples, runs):
        self.samples, self.runs, self.old, self.ent = samples, runs, {}, {}
        # every adapter's weights before its first step: the step's displacement is measured from here
        self.before = {name: flat_params(self.policy.parameters_of(name)) for name in self.policy.names}

    def old_logprobs(self, old):
        for i, (lp, ent) in old.items():
            self.old[i], self.ent[i] = lp, ent

    def tokens(self, role, mask, ratio, clipped, k3):
        with torch.no_grad():
            self.stats[role, "tokens"] += float(mask.sum())
            self.stats[role, "clipped"] += float(clipped.sum())
            self.stats[role, "ratio"] += float((ratio * mask).sum())
            if k3 is not None:
                self.stats[role, "kl"] += float((k3 * mask).sum())

    def slot_done(self, name, role, slot, params):
        self.reader.read(role, slot, params)

    def before_step(self, name, params):
        parts = self.reader.take()
        for role, g in by_role(parts).items():
            self.opt_norms[role].append(float(g.norm()))              # before damping and clipping
            self.opt_steps[role] += 1
        for k, v in parts.items():
            self.step_parts[k] = self.step_parts[k].add_(v) if k in self.step_parts else v

    def after_step(self, name, norm):
        self.norms.append(norm)

    def adapter_done(self, name, rows, lr):
        n = len(self.norms)
        move = flat_params(self.policy.parameters_of(name)) - self.before.pop(name)   # (N,) the step's move
        self.adapters[name] = {"n": rows, "opt_steps": n, "grad_norm": sum(self.norms) / n if n else 0.0, "lr": lr,
                               "displacement": float(move.norm())}
        self._reduce(self.step_parts, move)
        self.step_parts, self.norms = {}, []

    # ------------------------------------------------------------------ reductions

    def _reduce(self, parts, move) -> None:
        """Per-role and per-slot norms, slot cosines, coherence and role cosines of one adapter's
        step contributions, and each role's alignment with the adapter's `move` (the step's
        displacement), as floats (the vectors are freed after)."""
        roles_here = sorted({r for r, _ in parts}, key=self.policy.roles.index)
        rvec = {}
        for role in roles_here:
            keys = sorted(k for k in parts if k[0] == role)
            rvec[role] = sum(parts[k] for k in keys)
            self.role_norm[role] = float(rvec[role].norm())
            self.move_cos[role] = cosine(-rvec[role], move)   # > 0: the weights moved down the role's gradient
            for k in keys:
                self.slot_norm[k[1]] = float(parts[k].norm())
            if len(keys) > 1:
                total = sum(self.slot_norm[k[1]] for k in keys)
                if total > 0:
                    self.coherence[role] = self.role_norm[role] / total
                pairs = {f"{a[1]}|{b[1]}": cosine(parts[a], parts[b]) for i, a in enumerate(keys) for b in keys[i + 1:]}
                self.slot_cos[role] = {k: c for k, c in pairs.items() if c is not None}
        for i, a in enumerate(roles_here):
            for b in roles_here[i + 1:]:
                c = cosine(rvec[a], rvec[b])
                if c is not None:
                    self.cos_roles[f"{a}|{b}"] = c

    # ------------------------------------------------------------------ the step's metrics

    TOKEN_SUMS = ("skipped", "ent", "ent_n", "gap", "gap_max", "gap_kl", "gap_out", "gap_n", "tokens", "clipped",
                  "ratio", "kl")

    def _token_sums(self, idx, role, cap) -> list:
        """One role's additive numbers over the rows that ran here, in TOKEN_SUMS order (gap_max
        is a max, taken over ranks apart)."""
        s, old, ent = self.samples, self.old, self.ent
        ran = [i for i in idx if self.runs[i]]
        gap = [0.0, 0.0, 0.0, 0, 0]   # grpo.drift's sums
        for i in ran:
            if len(s[i].sampler_logprobs) == len(s[i].completion_ids):  # skip rows without sampler logprobs
                g = grpo.drift(old[i], grpo.sampler_logprobs(s[i], old[i]), cap)
                gap = [max(a, b) if k == 1 else a + b for k, (a, b) in enumerate(zip(gap, g))]
        return [sum(s[i].here for i in idx) - len(ran), float(sum(ent[i].sum() for i in ran)),
                sum(len(ent[i]) for i in ran), *gap,
                *(self.stats[role, k] for k in ("tokens", "clipped", "ratio", "kl"))]

    def _role_summary(self, idx, t: dict, role, total_norm, kl: bool) -> dict:
        """The role's metrics; a token statistic of a role none of whose rows ran (every
        advantage 0) is None, not 0."""
        s = self.samples
        n, tok = len(idx), t["tokens"] or None
        norm, opt = self.role_norm.get(role, 0.0), self.opt_norms.get(role, [])
        r = {"n": n, "len": sum(len(s[i].completion_ids) for i in idx) / n, "skipped": int(t["skipped"]),
             "trunc_frac": sum(not s[i].finished for i in idx) / n,
             "grad_norm": norm, "grad_share": norm / total_norm if total_norm > 0 else 0.0,
             "grad_norm_opt": sum(opt) / len(opt) if opt else 0.0, "grad_norm_opt_max": max(opt, default=0.0),
             "clip_frac": tok and t["clipped"] / tok, "ratio_mean": tok and t["ratio"] / tok,
             "entropy": t["ent"] / t["ent_n"] if t["ent_n"] else None,
             "logprob_gap": t["gap"] / t["gap_n"] if t["gap_n"] else None,
             "logprob_gap_max": t["gap_max"] if t["gap_n"] else None,
             "logprob_gap_kl": t["gap_kl"] / t["gap_n"] if t["gap_n"] else None,
             "logprob_gap_out": t["gap_out"] / t["gap_n"] if t["gap_n"] else None, "opt_steps": self.opt_steps[role],
             "displacement": self.adapters.get(self.policy.adapter(role), {}).get("displacement", 0.0),
             "move_cos": self.move_cos.get(role)}
        if kl:
            r["kl"] = tok and t["kl"] / tok
        log = self.damp.log.get(role) if self.damp is not None else None
        if log:
            r["damp_cos"] = sum(c for c, _ in log) / len(log)
            r["damp_scale"] = sum(x for _, x in log) / len(log)
        return r

    def summary(self, hp=None) -> dict:
        """The step's metrics (every field is described in docs/RUNFOLDER.md): per role n, len,
        skipped, trunc_frac, grad_norm, grad_share, grad_norm_opt / _max, clip_frac,
        ratio_mean, entropy, logprob_gap / _max / _kl / _out (the sampler's drift, grpo.drift), opt_steps, displacement, move_cos, kl (when the
        grpo.Hyper `hp` gives the role a KL coefficient), damp_cos / damp_scale (with damping);
        per slot n, len, grad_norm; dominant_role, cos_roles, slot_cos, coherence; adapters
        {name: {n, opt_steps, grad_norm, lr, displacement}}; lr. Under data parallelism every
        count and sum is over all ranks."""
        samples, roles = self.samples, self.policy.roles
        idx = {role: [i for i, s in enumerate(samples) if s.role == role] for role in roles}
        cap = hp.drift_cap if hp else grpo.DRIFT_CAP
        sums = [self._token_sums(idx[role], role, cap) for role in roles]
        if self.comm:   # one collective for every token statistic of the step, and one for the maxima
            j_max = self.TOKEN_SUMS.index("gap_max")
            maxima = [max(r) for r in zip(*self.comm.gather([r[j_max] for r in sums]))]
            flat = self.comm.sum([x for r in sums for x in r])
            k = len(self.TOKEN_SUMS)
            sums = [flat[j * k:(j + 1) * k] for j in range(len(roles))]
            for r, m in zip(sums, maxima):
                r[j_max] = m
        total_norm = sum(self.role_norm.values())
        out_roles = {role: self._role_summary(idx[role], dict(zip(self.TOKEN_SUMS, t)), role, total_norm,
                                              bool(hp and hp.kl(role)))
                     for role, t in zip(roles, sums) if idx[role]}
        slots = list(dict.fromkeys(s.slot for s in samples))
        out = {"roles": out_roles, "adapters": self.adapters,
               "slots": {k: {"n": n, "len": sum(len(s.completion_ids) for s in samples if s.slot == k) / n,
                             "grad_norm": self.slot_norm.get(k, 0.0)}
                         for k in slots if (n := sum(s.slot == k for s in samples))},
               "lr": next(iter(self.adapters.values()))["lr"] if self.adapters else 0.0}
        if total_norm > 0:
            out["dominant_role"] = max(out_roles, key=lambda r: out_roles[r]["grad_share"])
        for key in ("cos_roles", "coherence"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if any(self.slot_cos.values()):
            out["slot_cos"] = {k: v for k, v in self.slot_cos.items() if v}
        return out
