"""GRPO: advantages, the objective against a naive reference, the update's routing and steps,
and the role-level gradient diagnostics, on tiny random Qwen3 models (CPU, offline)."""
import math

import pytest
import torch

import damping
import dynamics
import grpo
import policies
import engine
from conftest import tiny_qwen3
from workflows import Call, Episode

TEMP = 0.7
STOP, PAD = [1, 2], 2


def make_policy(roles, sharing, seed=0):
    pol = policies.Policy(tiny_qwen3(seed=seed), None, roles, sharing, rank=4, alpha=8)
    torch.manual_seed(seed + 1)
    with torch.no_grad():  # B != 0, so gradients reach A as well
        for name in pol.names:
            for p in pol.parameters_of(name):
                p.normal_(0, 0.1)
    return pol


def sampled(pol, rows, seed=0, max_new=6):
    """rows: (role, slot, prompt, advantage) -> Samples with completions drawn by engine.generate."""
    out = []
    for k, (role, slot, prompt, adv) in enumerate(rows):
        with torch.no_grad(), pol.using(pol.adapter(role)) as m:
            gen = engine.generate(m, [prompt], max_new, STOP, PAD, temperature=TEMP, seed=seed, keys=[k])
        n = int(gen.mask[0].sum())
        out.append(grpo.Sample(role, slot, "p0", list(prompt), gen.tokens[0, :n].tolist(),
                               gen.logprobs[0, :n].tolist(), bool(gen.finished[0]), 1.0, adv))
    return out


def step(pol, opts, scheds, S, generator=None, damp=None, probe=None, **hp):
    """One grpo.update of the samples S with the role-level dynamics measured (dynamics.py, or
    the given probe): the step's metrics."""
    h = grpo.Hyper(temperature=TEMP, **hp)
    dyn = probe or dynamics.RoleDynamics(pol, damp=damp)
    grpo.update(pol, opts, scheds, S, h, shuffle=generator, probe=dyn, intervention=damp)
    return dyn.summary(h)


def snapshot(module_params):
    return [p.detach().clone() for p in module_params]


def changed(before, params):
    return [not torch.equal(b, p) for b, p in zip(before, params)]


# ----------------------------------------------------------------------------- advantages

def test_group_advantages_on_hand_tables():
    rewards = [1, 0, 1, 1, 1, 0, 1, 0, 1]
    keys = ["a", "a", "z", "z", "z", "s", "a", "a", "t"]
    adv = grpo.group_advantages(rewards, keys)
    k = 0.5 / math.sqrt(1 / 3)  # group a: mean 0.5, unbiased std sqrt(1/3)
    expect = [k, -k, 0, 0, 0, 0, k, -k, 1]  # z: zero variance; s, t: singletons (A = R)
    assert adv == pytest.approx(expect, abs=1e-5)
    with pytest.raises(ValueError):
        grpo.group_advantages([1, 0], ["a"])


def _episode(pid, reward, rollout_idx, calls):
    ep = Episode(problem={"id": pid}, rollout=rollout_idx, reward=reward)
    ep.calls = [Call(role, slot, [], prompt_ids=[5, 6], completion_ids=comp, logprobs=[-0.5] * len(comp),
                     finished=fin) for role, slot, comp, fin in calls]
    return ep


def _voting_calls(empty_aggregator=False):
    return [("generator", f"generator{k}", [7, 8, 1], True) for k in range(3)] + \
           [("aggregator", "aggregator", [] if empty_aggregator else [9, 1], False)]


def test_samples_from_episodes_slot_and_role_groups():
    eps = [_episode("p", 1.0, 0, _voting_calls()), _episode("p", 0.0, 1, _voting_calls()),
           _episode("q", 1.0, 0, _voting_calls(empty_aggregator=True))]
    s = grpo.samples_from_episodes(eps, group_by="slot")
    assert len(s) == 11  # the empty aggregator completion is dropped
    assert [x.reward for x in s] == [1.0] * 4 + [0.0] * 4 + [1.0] * 3  # rewards stay rewards
    assert all(x.problem_id in ("p", "q") and x.prompt_ids == [5, 6] for x in s)
    assert s[3].finished is False and s[0].sampler_logprobs == [-0.5] * 3
    k = 0.5 / math.sqrt(0.5)  # every slot of p: rewards (1, 0)
    assert [x.advantage for x in s[:8]] == pytest.approx([k] * 4 + [-k] * 4, abs=1e-5)
    assert [x.advantage for x in s[8:]] == pytest.approx([1.0] * 3)  # q: singletons, A = R

    r = grpo.samples_from_episodes(eps, group_by="role")
    k6 = 0.5 / math.sqrt(6 * 0.25 / 5)  # p's 6 generator calls pooled: 3 ones, 3 zeros
    assert [x.advantage for x in r[:3]] == pytest.approx([k6] * 3, abs=1e-5)
    assert [x.advantage for x in r[4:7]] == pytest.approx([-k6] * 3, abs=1e-5)
    assert r[3].advantage == pytest.approx(k, abs=1e-5)  # the aggregator group is unchanged
    # q's 3 generator calls share one role group with identical rewards: zero variance
    assert [x.advantage for x in r[8:]] == pytest.approx([0.0] * 3)
    with pytest.raises(ValueError):
        grpo.samples_from_episodes(eps, group_by="episode")


# ----------------------------------------------------------------------------- objective

def _naive(lp, old, adv, mask, ref, beta, norm, cl=0.2, ch=0.28, c=3.0, tis=None):
    """Per-token Python floats: loss, d loss / d logp, number of clipped tokens; `tis` the
    truncated importance weights of the policy term (None: 1)."""
    B, T = len(lp), len(lp[0])
    n_tok = sum(map(sum, mask))
    loss, grad, n_clip = 0.0, [[0.0] * T for _ in range(B)], 0
    for i in range(B):
        n_i = sum(mask[i])
        for t in range(T):
            if not mask[i][t]:
                continue
            w = 1.0 / (n_i * B) if norm == "seq" else 1.0 / n_tok
            A, r = adv[i], math.exp(lp[i][t] - old[i][t])
            surr, sc = -A * r, -A * min(max(r, 1 - cl), 1 + ch)
            l, g = max(surr, sc), -A * r
            if A < 0 and l > c * abs(A):      # dual clip
                l, g, n_clip = c * abs(A), 0.0, n_clip + 1
            elif sc > surr:                   # clip-low / clip-high
                g, n_clip = 0.0, n_clip + 1
            if tis is not None:
                l, g = tis[i][t] * l, tis[i][t] * g
            if beta:
                d = ref[i][t] - lp[i][t]
                l += beta * (math.exp(d) - d - 1)
                g += beta * (1 - math.exp(d))
            loss += w * l
            grad[i][t] = w * g
    return loss, grad, n_clip


@pytest.mark.parametrize("norm", ["seq", "token"])
@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_objective_equals_naive_reference(norm, beta):
    g = torch.Generator().manual_seed(1)
    B, T = 6, 8
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # log-ratios spread over every region: below 1-eps_low, inside, above 1+eps_high, above c
    log_r = torch.tensor([-1.0, -0.4, -0.1, 0.05, 0.2, 0.5, 1.3, 2.0], dtype=torch.float64)
    log_r = log_r[torch.randperm(T * B, generator=g) % T].view(B, T)
    old = logp - log_r
    ref = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.tensor([1.3, -0.7, 0.0, -2.0, 0.4, -1.1], dtype=torch.float64)
    lengths = [8, 1, 5, 8, 3, 6]
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    x = logp.clone().requires_grad_(True)
    denom = B if norm == "seq" else int(mask.sum())
    loss, _, ratio, clipped, _ = grpo.objective(x, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0,
                                                loss_norm=norm, denom=denom, ref_logp=ref, kl_coef=beta)
    loss.backward()
    n_loss, n_grad, n_clip = _naive(logp.tolist(), old.tolist(), adv.tolist(), mask.int().tolist(),
                                    ref.tolist(), beta, norm)
    assert loss.item() == pytest.approx(n_loss, rel=1e-10)
    assert torch.allclose(x.grad, torch.tensor(n_grad, dtype=torch.float64), atol=1e-12)
    assert int(clipped.sum()) == n_clip and 0 < n_clip < int(mask.sum())
    # every region is exercised: a dual-clipped token (A < 0, r > c) is among them
    assert bool(((adv[:, None] < 0) & (ratio > 3.0) & mask).any())
    # accumulation: the two micro-batches' parts sum to the mini-batch loss
    parts = [grpo.objective(logp[s], old[s], adv[s], mask[s], clip_low=0.2, clip_high=0.28, clip_c=3.0,
                            loss_norm=norm, denom=denom, ref_logp=ref[s], kl_coef=beta)[0]
             for s in (slice(0, 2), slice(2, B))]
    assert float(sum(parts)) == pytest.approx(n_loss, rel=1e-10)


@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_tis_weighted_loss_equals_hand_computation(beta):
    """--tis C: each token's policy term times min(exp(old - sampler), C), the KL term unweighted."""
    g = torch.Generator().manual_seed(2)
    B, T, C = 4, 5, 2.0
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp - torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    sampler = old - torch.tensor([-2.0, -0.5, 0.0, 0.3, 1.5], dtype=torch.float64)   # ratios e^-2 .. e^1.5
    ref = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.tensor([1.1, -0.6, -1.7, 0.4], dtype=torch.float64)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 2, 4, 5])[:, None]
    w = grpo.tis_weights(old, sampler, C)
    hand = [[min(math.exp(o - s), C) for o, s in zip(ro, rs)] for ro, rs in zip(old.tolist(), sampler.tolist())]
    assert torch.allclose(w, torch.tensor(hand, dtype=torch.float64), rtol=1e-12)
    assert float(w.max()) == pytest.approx(C) and float(w.min()) == pytest.approx(math.exp(-2.0))
    x = logp.clone().requires_grad_(True)
    loss = grpo.objective(x, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0, loss_norm="seq",
                          denom=B, ref_logp=ref, kl_coef=beta, tis=w)[0]
    loss.backward()
    n_loss, n_grad, _ = _naive(logp.tolist(), old.tolist(), adv.tolist(), mask.int().tolist(), ref.tolist(),
                               beta, "seq", tis=hand)
    assert loss.item() == pytest.approx(n_loss, rel=1e-10)
    assert torch.allclose(x.grad, torch.tensor(n_grad, dtype=torch.float64), atol=1e-12)
    plain = grpo.objective(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0, loss_norm="seq",
                           denom=B, ref_logp=ref, kl_coef=beta)[0]
    assert plain.item() != pytest.approx(n_loss, rel=1e-3)   # the weights did something


def test_micro_loss_weights_tokens_by_the_sampler_ratio():
    """The update's wiring of --tis: the sampler's stored logprobs against the old ones."""
    pol = make_policy(("generator",), "shared")
    S = sampled(pol, [("generator", "generator0", [3, 4, 5], 1.0), ("generator", "generator1", [6, 7], -1.0)])
    S[0].sampler_logprobs = [x - 0.4 for x in S[0].sampler_logprobs]    # p_old / p_sampler = e^0.4
    S[1].sampler_logprobs = [x + 3.0 for x in S[1].sampler_logprobs]    # e^-3
    hp = grpo.Hyper(temperature=TEMP, tis=1.3)
    with pol.using("shared") as m:
        loss, _, used = grpo.micro_loss(m, S, [0, 1], {}, {}, hp, 2)
        logp, _, mask = grpo.batch_logprobs(m, [s.prompt_ids for s in S], [s.completion_ids for s in S], TEMP)
    T = logp.shape[1]
    old = grpo._padded([used[i][0] for i in (0, 1)], T, logp.device)
    w = torch.tensor([[1.3], [math.exp(-3.0)]]).expand(2, T)     # e^0.4 = 1.49 is capped at 1.3
    want = grpo.objective(logp, old, torch.tensor([1.0, -1.0]), mask, clip_low=0.2, clip_high=0.28, clip_c=3.0,
                          loss_norm="seq", denom=2, tis=w)[0]
    assert loss.item() == pytest.approx(want.item(), rel=1e-4)
    plain = grpo.micro_loss(pol.model, S, [0, 1], {}, {}, grpo.Hyper(temperature=TEMP), 2)[0]
    assert loss.item() != pytest.approx(plain.item(), rel=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_drift_and_tis_weights_by_dtype(dtype):
    """bf16 on a CPU: the sampler's incremental decode and the trainer's whole-row forward round
    differently, so the gap is not 0 and the weights need their cap; fp32: weights 1."""
    pol = make_policy(("generator",), "shared")
    pol.model.to(dtype)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18]] * 2
    with torch.no_grad(), pol.using("shared") as m:
        gen = engine.generate(m, prompts, 24, STOP, PAD, temperature=TEMP, seed=5)
        S = [grpo.Sample("generator", "g", "p", p, gen.tokens[i, :n].tolist(), gen.logprobs[i, :n].tolist(), True,
                         1.0, 1.0) for i, (p, n) in enumerate(zip(prompts, gen.mask.sum(1).tolist()))]
        old, _ = grpo.sequence_logprobs(m, S, TEMP)
    C = 1.02
    gaps = [grpo.drift(o, grpo.sampler_logprobs(s, o), C) for o, s in zip(old, S)]
    w = torch.cat([grpo.tis_weights(o, grpo.sampler_logprobs(s, o), C) for o, s in zip(old, S)])
    largest = max(g[1] for g in gaps)
    assert float(w.max()) <= C * (1 + 1e-6)
    if dtype == torch.float32:
        assert largest < 1e-4 and torch.allclose(w, torch.ones_like(w), atol=1e-4)
        assert sum(g[3] for g in gaps) == 0
    else:
        assert largest > 1e-3 and sum(g[2] for g in gaps) > 0          # a gap, and a KL estimate above 0
        assert float((w - 1).abs().max()) > 1e-3


def test_token_logprobs_chunked_equals_log_softmax(monkeypatch):
    monkeypatch.setattr(grpo, "CHUNK_ELEMS", 3 * 50)  # 3 rows a chunk: several chunks
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 50, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 50, (10,), generator=g)
    w = torch.randn(10, generator=g, dtype=torch.float64)
    lp = grpo.token_logprobs(logits, tokens, TEMP)
    (lp * w).sum().backward()
    ref_x = logits.detach().clone().requires_grad_(True)
    ref = torch.log_softmax(ref_x.float() / TEMP, -1).gather(-1, tokens[:, None]).squeeze(-1)
    (ref * w.float()).sum().backward()
    assert lp.dtype == torch.float32 and torch.allclose(lp, ref, atol=1e-6)
    assert torch.allclose(logits.grad.float(), ref_x.grad.float(), atol=1e-6)
    p = torch.softmax(logits.detach().float() / TEMP, -1)
    assert torch.allclose(grpo.token_entropy(logits.detach(), TEMP), -(p * p.log()).sum(-1), atol=1e-5)


def test_micro_batches_respect_the_token_budget():
    S = [grpo.Sample("g", "g", "p", [3] * p, [4] * t, [], True, 0.0, 0.0)
         for p, t in [(5, 3), (2, 9), (7, 7), (1, 1), (4, 4), (30, 10)]]
    mbs = grpo.forward_batches(S, list(range(len(S))), token_budget=20)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(S)))
    for mb in mbs:
        P = max(len(S[i].prompt_ids) for i in mb)
        T = max(len(S[i].completion_ids) for i in mb)
        assert len(mb) * (P + T) <= 20 or len(mb) == 1  # an over-long row goes alone


def test_recomputed_logprobs_equal_sampler_logprobs():
    pol = make_policy(("generator",), "shared")
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13], [14, 15, 16, 17], [3, 4, 5]]
    with torch.no_grad(), pol.using("shared") as m:
        gen = engine.generate(m, prompts, 12, STOP, PAD, temperature=TEMP, seed=3)
    lens = gen.mask.sum(1).tolist()
    assert len(set(lens)) > 1  # some rows stopped early: right padding is exercised
    S = [grpo.Sample("generator", "generator", "p", p, gen.tokens[i, :n].tolist(), gen.logprobs[i, :n].tolist(),
                     bool(gen.finished[i]), 0.0, 0.0) for i, (p, n) in enumerate(zip(prompts, lens))]
    for budget in (10_000, 25):  # one micro-batch, and several with different padding
        with torch.no_grad(), pol.using("shared") as m:
            lps, ents = grpo.sequence_logprobs(m, S, TEMP, token_budget=budget)
        for s, lp, e in zip(S, lps, ents):
            assert lp.shape == (len(s.completion_ids),) and lp.dtype == torch.float32
            assert torch.allclose(lp, torch.tensor(s.sampler_logprobs), atol=1e-5)
            assert bool((e > 0).all())


@pytest.mark.parametrize("isolation", ["lora", "full"])
def test_packed_forward_equals_the_padded_one(monkeypatch, isolation):
    """packed.logprobs (no pad token, the head only at completion positions, in chunks) against
    grpo.batch_logprobs (the plain layout): logprobs, entropies and the trainable weights'
    gradients, with runs of equal-length rows and rows alone; a trainable head (full copies)
    takes the backward that rebuilds its logits."""
    import packed
    monkeypatch.setattr(packed, "CHUNK_ELEMS", 64 * 5)   # 5 rows a chunk: several chunks
    pol = make_policy(("generator",), "shared") if isolation == "lora" else policies.Policy(
        tiny_qwen3(), None, ("generator",), "shared", isolation="full")
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21], [22]]
    comps = [[30, 31, 32], [33, 34, 35, 36, 37, 38], [39, 40, 41, 42, 43, 44], [45, 46, 47, 48, 49, 50], [51], [52, 53]]
    params = pol.parameters_of("shared")
    out = []
    for path in ("padded", "packed"):
        for p in params:
            p.grad = None
        with pol.using("shared") as m:
            if path == "padded":
                lp, ent, mask = grpo.batch_logprobs(m, prompts, comps, TEMP, entropy=True)
            else:
                lp, ent, mask = grpo.row_logprobs(m, prompts, comps, TEMP, entropy=True)
            w = torch.linspace(-1, 1, lp.numel()).view_as(lp)
            (lp * w * mask).sum().backward()
        out.append((lp.detach(), ent, mask, [p.grad.clone() for p in params if p.grad is not None]))
    (lp0, e0, m0, g0), (lp1, e1, m1, g1) = out
    assert torch.equal(m0, m1) and packed.row_runs([4, 4, 7, 7, 7, 2]) == ((0, 2, 4), (8, 3, 7), (29, 1, 2))
    assert torch.allclose(lp0, lp1, atol=2e-5) and torch.allclose(e0, e1, atol=2e-5)
    assert len(g0) == len(g1) and len(g0) > 0
    for a, b in zip(g0, g1):   # elementwise, fp32 rounding of sums in another order
        assert float((a - b).norm()) <= 1e-5 * float(a.norm()) + 1e-7
    if isolation == "full":   # the head's own gradient went through the rebuilding backward
        head = pol.copies["shared"].get_output_embeddings().weight
        assert head.grad is not None and float(head.grad.norm()) > 0


def test_packed_attention_repeats_grouped_heads_where_sdpa_has_no_gqa_kernel(monkeypatch):
    """fp32 on CUDA: SDPA's efficient kernel takes no grouped K/V heads, so packed_attention
    repeats them (the math kernel would keep (Hq, L, L) scores); the same output and gradients
    as SDPA's own grouping, checked on a CPU by forcing that path."""
    import packed
    assert packed.gqa_kernel("cpu", torch.float32) and packed.gqa_kernel("cuda", torch.bfloat16)
    assert not packed.gqa_kernel("cuda:1", torch.float32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 11, 8, generator=g, requires_grad=True) for h in (6, 2, 2))
    runs = packed.row_runs([3, 3, 5])
    out = []
    for grouped in (True, False):
        monkeypatch.setattr(packed, "gqa_kernel", lambda device, dtype, _g=grouped: _g)
        o = packed.packed_attention(None, q, k, v, None, scaling=0.3, packed_rows=runs)[0]
        grads = torch.autograd.grad((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum(), (q, k, v))
        out.append((o.detach(), grads))
    (o0, g0), (o1, g1) = out
    assert o0.shape == (1, 11, 6, 8) and torch.allclose(o0, o1, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g0, g1))


def test_packed_micro_batches_count_their_own_tokens():
    S = [grpo.Sample("g", "g", "p", [3] * p, [4] * t, [], True, 0.0, 0.0)
         for p, t in [(5, 3), (2, 9), (7, 7), (1, 1), (4, 4), (30, 10)]]
    mbs = grpo.forward_batches(S, list(range(len(S))), token_budget=20, packing=True)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(S)))
    for mb in mbs:
        assert sum(len(S[i].prompt_ids) + len(S[i].completion_ids) for i in mb) <= 20 or len(mb) == 1
    assert len(mbs) < len(grpo.forward_batches(S, list(range(len(S))), token_budget=20))


@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_the_update_runs_only_the_passes_grpo_needs(kl):
    """Reference forward only with a KL coefficient; a no-grad (old-logprob) forward only for the
    rows after the first mini-batch; entropies only for a probe that logs them."""
    pol = make_policy(("generator", "aggregator"), "shared")
    S = sampled(pol, ROWS)
    seen = []   # (adapter active, grad on, positions) of every forward
    pol.model.get_input_embeddings().register_forward_hook(
        lambda m, i, o: seen.append((pol.lora.active, torch.is_grad_enabled(), i[0].numel())))

    class Reads(grpo.Probe):
        def begin(self, samples, runs):
            self.old = {}

        def old_logprobs(self, old):
            self.old.update(old)
    probe = Reads()
    opts, scheds = grpo.make_optimizers(pol, lr=1e-3, warmup_steps=0, total_steps=10)
    h = grpo.Hyper(temperature=TEMP, mini_batch=3, kl_coef=kl)   # 5 rows: mini-batches of 2 and 3
    shuffle = torch.Generator().manual_seed(0)
    first = grpo.optimizer_batches(grpo.adapter_rows(pol, S, "shared", torch.Generator().manual_seed(0)), 3)[0]
    grpo.update(pol, opts, scheds, S, h, shuffle=shuffle, probe=probe)
    own = lambda rows: sum(len(S[i].prompt_ids) + len(S[i].completion_ids) - 1 for i in rows)   # noqa: E731
    later = own(set(range(len(S))) - set(first))
    # no grad: the old logprobs of the later rows (adapter folded, so no adapter active), and
    # with KL the reference forward of every row
    assert sum(n for a, g, n in seen if not g) == later + (own(range(len(S))) if kl else 0)
    assert sum(n for a, g, n in seen if g) == own(range(len(S)))   # one training forward a row
    assert set(probe.old) == set(range(len(S))) and all(e is None for _, e in probe.old.values())


def test_the_packed_update_equals_the_padded_one():
    """A whole update, packed or through the plain layout, from the same weights: the same
    weights after, within fp32 rounding (the toy run's samples do not move: its report)."""
    after = []
    for packing in (False, True):
        pol = make_policy(("generator", "aggregator"), "shared")
        S = sampled(pol, ROWS)
        opts, scheds = grpo.make_optimizers(pol, lr=1e-2, warmup_steps=0, total_steps=10)
        step(pol, opts, scheds, S, mini_batch=2, token_budget=16, packing=packing)
        after.append(snapshot(pol.parameters_of("shared")))
    assert any(not torch.equal(a, b) for a, b in zip(after[0], snapshot(make_policy(("generator", "aggregator"),
                                                                                 "shared").parameters_of("shared"))))
    for a, b in zip(*after):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- the update

ROWS = [("generator", "generator0", [3, 4, 5], 1.0), ("generator", "generator1", [3, 4, 5], -1.0),
        ("generator", "generator2", [6, 7], 0.5), ("aggregator", "aggregator", [8, 9, 10, 11], -0.8),
        ("aggregator", "aggregator", [8, 9, 12], 1.2)]


def test_lr_zero_changes_nothing_ratio_one_no_clipping():
    pol = make_policy(("generator", "aggregator"), "shared")
    S = sampled(pol, ROWS)
    before = snapshot(pol.parameters())
    opts, scheds = grpo.make_optimizers(pol, lr=0.0, warmup_steps=1, total_steps=10)
    out = step(pol, opts, scheds, S, mini_batch=2, token_budget=16)
    assert not any(changed(before, pol.parameters()))
    assert out["adapters"]["shared"]["opt_steps"] == 3
    for role, r in out["roles"].items():
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert r["clip_frac"] == 0.0
        assert r["grad_norm"] > 0 and r["logprob_gap"] < 1e-5


def test_isolated_only_roles_with_samples_change_base_never():
    roles = ("generator", "aggregator", "evaluator")
    pol = make_policy(roles, "isolated")
    S = sampled(pol, ROWS)  # no evaluator sample
    adapter = {n: snapshot(pol.parameters_of(n)) for n in pol.names}
    base = snapshot(pol.model.parameters())
    opts, scheds = grpo.make_optimizers(pol, lr=1e-3, warmup_steps=0, total_steps=10)
    step(pol, opts, scheds, S, mini_batch=8)
    assert all(changed(adapter["generator"], pol.parameters_of("generator")))
    assert all(changed(adapter["aggregator"], pol.parameters_of("aggregator")))
    assert not any(changed(adapter["evaluator"], pol.parameters_of("evaluator")))
    assert not any(changed(base, pol.model.parameters()))


def test_shared_the_one_adapter_changes_base_never():
    pol = make_policy(("generator", "aggregator"), "shared")
    S = sampled(pol, ROWS)
    adapter, base = snapshot(pol.parameters_of("shared")), snapshot(pol.model.parameters())
    opts, scheds = grpo.make_optimizers(pol, lr=1e-3, warmup_steps=0, total_steps=10)
    out = step(pol, opts, scheds, S, kl_coef_role={"aggregator": 0.1})
    assert all(changed(adapter, pol.parameters_of("shared")))
    assert not any(changed(base, pol.model.parameters()))
    assert "kl" in out["roles"]["aggregator"] and "kl" not in out["roles"]["generator"]


@pytest.mark.parametrize("sharing,steps", [("isolated", {"generator": 3, "aggregator": 1, "evaluator": 0}),
                                           ("shared", {"shared": 4})])
def test_optimizer_steps_follow_ceil_n_over_mini_batch(sharing, steps):
    roles = ("generator", "aggregator", "evaluator")
    pol = make_policy(roles, sharing)
    rows = [("generator", f"generator{k % 3}", [3 + k, 4], 1.0 - k % 2) for k in range(5)]
    rows += [("aggregator", "aggregator", [9, 10 + k], 0.5 - k) for k in range(2)]
    S = sampled(pol, rows)
    opts, scheds = grpo.make_optimizers(pol, lr=1e-3, warmup_steps=2, total_steps=10)
    out = step(pol, opts, scheds, S, mini_batch=2,
                      generator=torch.Generator().manual_seed(0))
    for name, n in steps.items():
        state = [opts[name].state[p] for p in pol.parameters_of(name)]
        assert all(int(s["step"]) == n for s in state) if n else all(not s for s in state)
        assert out["adapters"][name]["opt_steps"] == n
        assert scheds[name].last_epoch == 1  # every scheduler steps once per training step
    if sharing == "isolated":
        assert out["roles"]["generator"]["opt_steps"] == 3 and out["roles"]["aggregator"]["opt_steps"] == 1
        assert "cos_roles" not in out  # roles on different adapters are not compared


def test_lr_role_zero_freezes_the_role_bit_for_bit_over_two_steps():
    pol = make_policy(("generator", "aggregator"), "isolated")
    S = sampled(pol, ROWS)
    before = {n: snapshot(pol.parameters_of(n)) for n in pol.names}
    # weight decay on: a frozen role must not even decay
    opts, scheds = grpo.make_optimizers(pol, lr=1e-2, warmup_steps=0, total_steps=10, weight_decay=0.1,
                                        lr_role={"aggregator": 0.0, "generator": 5e-3})
    assert opts["generator"].param_groups[0]["lr"] == 5e-3
    for _ in range(2):
        out = step(pol, opts, scheds, S, mini_batch=2)
    assert all(torch.equal(b, p) for b, p in zip(before["aggregator"], pol.parameters_of("aggregator")))
    assert all(changed(before["generator"], pol.parameters_of("generator")))
    assert not any(opts["aggregator"].state[p] for p in pol.parameters_of("aggregator"))   # not one AdamW step
    assert "aggregator" not in out["adapters"]
    agg = out["roles"]["aggregator"]
    assert agg["skipped"] == 2 and agg["grad_norm"] == 0.0 and agg["displacement"] == 0.0 and agg["entropy"] is None
    assert out["roles"]["generator"]["displacement"] > 0


@pytest.mark.parametrize("sharing", ["shared", "isolated"])
def test_displacement_is_the_parameter_difference_over_the_whole_step(sharing):
    pol = make_policy(("generator", "aggregator"), sharing)
    S = sampled(pol, ROWS)
    before = {n: torch.cat([p.detach().reshape(-1).clone() for p in pol.parameters_of(n)]) for n in pol.names}
    opts, scheds = grpo.make_optimizers(pol, lr=1e-3, warmup_steps=0, total_steps=10)
    out = step(pol, opts, scheds, S, mini_batch=1)   # several optimizer steps per adapter
    for n in pol.names:
        after = torch.cat([p.detach().reshape(-1) for p in pol.parameters_of(n)])
        assert out["adapters"][n]["opt_steps"] > 1
        assert out["adapters"][n]["displacement"] == pytest.approx(float((after - before[n]).norm()), rel=1e-6)
    for role, r in out["roles"].items():
        assert r["displacement"] == out["adapters"][pol.adapter(role)]["displacement"]
        assert -1.0 <= r["move_cos"] <= 1.0


def test_lr_schedule_warmup_then_cosine_to_zero():
    f = [grpo.lr_factor(s, 3, 10) for s in range(11)]
    assert f[:3] == pytest.approx([1 / 3, 2 / 3, 1.0]) and f[3] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[3:], f[4:])) and f[10] == pytest.approx(0.0, abs=1e-12)


# ----------------------------------------------------------------------------- diagnostics

def test_identical_slots_have_cosine_one_and_coherence_one():
    pol = make_policy(("generator", "aggregator"), "shared")
    gen = sampled(pol, [("generator", "generator0", [3, 4, 5], 1.0)])[0]
    S = [grpo.Sample(gen.role, f"generator{k}", gen.problem_id, gen.prompt_ids, gen.completion_ids,
                     gen.sampler_logprobs, gen.finished, 1.0, 1.0) for k in range(2)]
    S += sampled(pol, [("aggregator", "aggregator", [8, 9], -0.5)])
    opts, scheds = grpo.make_optimizers(pol, lr=1e-3, warmup_steps=0, total_steps=10)
    out = step(pol, opts, scheds, S)
    assert out["slot_cos"]["generator"]["generator0|generator1"] == pytest.approx(1.0, abs=1e-5)
    assert out["coherence"]["generator"] == pytest.approx(1.0, abs=1e-5)
    assert out["slots"]["generator0"]["grad_norm"] == pytest.approx(out["slots"]["generator1"]["grad_norm"], rel=1e-5)
    assert "generator|aggregator" in out["cos_roles"]
    shares = {r: v["grad_share"] for r, v in out["roles"].items()}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert out["dominant_role"] == max(shares, key=shares.get)


class Captured(dynamics.RoleDynamics):
    """RoleDynamics that also keeps, for every optimizer step, its (role, slot) parts and the
    whole gradient in .grad just before the step."""

    def __init__(self, pol):
        super().__init__(pol)
        self.seen = []

    def before_step(self, name, params):
        self.seen.append(({k: v.clone() for k, v in self.reader.parts.items()}, dynamics.flat_grad(params)))
        super().before_step(name, params)


def test_role_and_slot_contributions_sum_to_the_total_gradient():
    grads = []
    for budget in (12, 10_000):   # several micro-batches per slot, then one
        pol = make_policy(("generator", "aggregator"), "shared")
        S = sampled(pol, ROWS)
        opts, scheds = grpo.make_optimizers(pol, lr=0.0, warmup_steps=0, total_steps=10)
        cap = Captured(pol)
        step(pol, opts, scheds, S, mini_batch=len(S), token_budget=budget, probe=cap)
        (parts, total), = cap.seen
        assert set(parts) == {(r, s) for r, s, _, _ in ROWS}
        assert torch.allclose(sum(parts.values()), total, atol=1e-6)
        per_role = {r: sum(v for k, v in parts.items() if k[0] == r) for r in ("generator", "aggregator")}
        assert torch.allclose(per_role["generator"] + per_role["aggregator"], total, atol=1e-6)
        assert all(float(v.norm()) > 0 for v in per_role.values())
        grads.append(total)
    # micro-batching changes nothing: one big micro-batch gives the same accumulated gradient
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_step_diagnostics_sum_over_mini_batches():
    # with lr 0 the weights stay put, so one mini-batch per sample (each its own token mean)
    # must give exactly n times the gradient of one mini-batch of all n samples (mean over n)
    pol = make_policy(("generator", "aggregator"), "shared")
    S = sampled(pol, ROWS)
    opts, scheds = grpo.make_optimizers(pol, lr=0.0, warmup_steps=0, total_steps=10)
    one = step(pol, opts, scheds, S, mini_batch=len(S))
    each = step(pol, opts, scheds, S, mini_batch=1)
    assert each["adapters"]["shared"]["opt_steps"] == len(S)
    for role in ("generator", "aggregator"):
        assert each["roles"][role]["grad_norm"] == pytest.approx(len(S) * one["roles"][role]["grad_norm"], rel=1e-4)
    for slot in ("generator0", "aggregator"):
        assert each["slots"][slot]["grad_norm"] == pytest.approx(len(S) * one["slots"][slot]["grad_norm"], rel=1e-4)
    assert each["cos_roles"]["generator|aggregator"] == pytest.approx(one["cos_roles"]["generator|aggregator"], abs=1e-4)


# ----------------------------------------------------------------------------- skipping, step norms, damping

def _voting_like(pol, seed=0):
    """Generator slots on two problems (one of them with all-equal rewards: A = 0) and an
    aggregator whose groups are half zero, as in a real step."""
    rows = [("generator", f"generator{k}", [3 + p, 4, 5 + k], adv)
            for p, adv in ((0, 0.0), (1, 1.0), (2, -1.0)) for k in range(3)]
    rows += [("aggregator", "aggregator", [8, 9 + k], a) for k, a in enumerate((0.0, 0.7, -0.7, 0.0))]
    return sampled(pol, rows, seed=seed)


def record_applied(opts, params_of):
    """Wrap each optimizer's step to record the flattened gradient it applies: {name: [vec]}."""
    seen = {n: [] for n in opts}
    for name, o in opts.items():
        o.register_step_pre_hook(lambda opt, args, kwargs, _name=name:
                                 seen[_name].append(dynamics.flat_grad(params_of(_name)).clone()))
    return seen


def _state(pol):
    return {n: [p.detach().clone() for p in pol.parameters_of(n)] for n in pol.names}


@pytest.mark.parametrize("sharing", ["shared", "isolated"])
def test_skipping_zero_advantage_rows_changes_no_gradient_and_no_diagnostic(sharing):
    outs, states, grads = [], [], []
    for skip in (False, True):
        pol = make_policy(("generator", "aggregator"), sharing)
        S = _voting_like(pol)
        opts, scheds = grpo.make_optimizers(pol, lr=1e-3, warmup_steps=0, total_steps=10)
        seen = record_applied(opts, pol.parameters_of)
        outs.append(step(pol, opts, scheds, S, mini_batch=5, skip_zero=skip,
                                kl_coef_role={"aggregator": 0.05}, generator=torch.Generator().manual_seed(0)))
        states.append(_state(pol))
        grads.append([v for n in sorted(seen) for v in seen[n]])
    full, skipped = outs
    assert skipped["roles"]["generator"]["skipped"] == 3 and full["roles"]["generator"]["skipped"] == 0
    assert skipped["roles"]["aggregator"]["skipped"] == 0  # its KL term has a gradient at A = 0
    assert len(grads[0]) == len(grads[1]) > 1
    for a, b in zip(*grads):
        # the skip changes which rows share a micro-batch, and with several threads a matmul's
        # rounding depends on its batch: the same gradient to fp32 rounding (measured 1.3e-6)
        assert float((a - b).norm() / a.norm()) < 1e-5
    for n in states[0]:
        a, b = (torch.cat([p.flatten() for p in st[n]]) for st in states)
        assert float((a - b).norm() / a.norm()) < 1e-6     # measured 2.5e-8
    for role in ("generator", "aggregator"):
        for key in ("grad_norm", "grad_share", "grad_norm_opt", "grad_norm_opt_max", "opt_steps"):
            assert skipped["roles"][role][key] == pytest.approx(full["roles"][role][key], rel=1e-6)
    for slot in full["slots"]:
        assert skipped["slots"][slot]["grad_norm"] == pytest.approx(full["slots"][slot]["grad_norm"], rel=1e-6, abs=1e-12)
    for key in ("coherence", "cos_roles"):
        for k, v in full.get(key, {}).items():
            assert skipped[key][k] == pytest.approx(v, rel=1e-6)
    for role, pairs in full["slot_cos"].items():
        for k, v in pairs.items():   # a cosine near 0 (-0.006 here) is judged on its [-1, 1] scale
            assert skipped["slot_cos"][role][k] == pytest.approx(v, rel=1e-5, abs=1e-6)


def test_per_optimizer_step_norm_is_the_norm_of_the_applied_gradient():
    pol = make_policy(("generator", "aggregator"), "isolated")
    S = _voting_like(pol)
    opts, scheds = grpo.make_optimizers(pol, lr=1e-3, warmup_steps=0, total_steps=10)
    seen = record_applied(opts, pol.parameters_of)
    # no clipping, so the applied gradient is the pre-clip one
    out = step(pol, opts, scheds, S, mini_batch=3, max_grad_norm=0.0,
                      generator=torch.Generator().manual_seed(1))
    for role in ("generator", "aggregator"):
        r, applied = out["roles"][role], [float(v.norm()) for v in seen[role]]
        assert r["opt_steps"] == len(applied) > 1
        assert r["grad_norm_opt"] == pytest.approx(sum(applied) / len(applied), rel=1e-5)
        assert r["grad_norm_opt_max"] == pytest.approx(max(applied), rel=1e-5)


def test_coherence_damp_lambda_zero_is_exactly_the_plain_update():
    states = []
    for damp in (None, damping.CoherenceDamp({"generator": 0.0, "aggregator": 0.0}, window=3)):
        pol = make_policy(("generator", "aggregator"), "shared")
        S = _voting_like(pol)
        opts, scheds = grpo.make_optimizers(pol, lr=1e-3, warmup_steps=0, total_steps=10)
        for _ in range(2):
            out = step(pol, opts, scheds, S, mini_batch=4, damp=damp,
                              generator=torch.Generator().manual_seed(2))
        states.append(_state(pol))
    assert all(torch.equal(a, b) for a, b in zip(states[0]["shared"], states[1]["shared"]))
    assert out["roles"]["generator"]["damp_scale"] == 1.0 and "damp_cos" in out["roles"]["generator"]


def test_coherence_damp_scales_a_repeated_gradient_by_one_minus_lambda():
    d = damping.CoherenceDamp({"generator": 0.4}, window=4)
    g = torch.tensor([1.0, -2.0, 0.5])
    assert d("generator", g.clone()) == (1.0, None)            # no history yet
    scale, cos = d("generator", g.clone())
    assert cos == pytest.approx(1.0) and scale == pytest.approx(0.6)
    assert d("worker", g) == (1.0, None)                       # an undamped role
    assert d("generator", -g)[0] == 1.0                        # opposite direction: no damping
    # the EMA moved toward the scaled gradient: m = 0.75 g + 0.25 * 0.6 g after two steps
    restored = damping.CoherenceDamp({"generator": 0.4}, window=4)
    restored.load_state_dict(d.state_dict())
    assert torch.equal(restored.ema["generator"], d.ema["generator"])
    # through the update: two steps with the same samples at lr 0 give the same gradient twice
    pol = make_policy(("generator", "aggregator"), "isolated")
    S = _voting_like(pol)
    opts, scheds = grpo.make_optimizers(pol, lr=0.0, warmup_steps=0, total_steps=10)
    damp = damping.CoherenceDamp({"aggregator": 0.5}, window=2)
    step(pol, opts, scheds, S, mini_batch=len(S), damp=damp)
    out = step(pol, opts, scheds, S, mini_batch=len(S), damp=damp)
    assert out["roles"]["aggregator"]["damp_scale"] == pytest.approx(0.5, abs=1e-5)
    assert "damp_scale" not in out["roles"]["generator"]


def test_a_step_with_no_gradient_has_no_dominant_role():
    pol = make_policy(("generator", "aggregator"), "shared")
    S = sampled(pol, [(r, s, p, 0.0) for r, s, p, _ in ROWS])  # every reward equal: A = 0
    before = snapshot(pol.parameters_of("shared"))
    opts, scheds = grpo.make_optimizers(pol, lr=1e-3, warmup_steps=0, total_steps=10)
    out = step(pol, opts, scheds, S)
    assert "dominant_role" not in out
    assert all(r["skipped"] == r["n"] and r["grad_norm"] == 0.0 for r in out["roles"].values())
    assert not any(changed(before, pol.parameters_of("shared")))   # zero gradient, fresh AdamW


def test_layer_checkpointing_gives_the_same_lora_gradients_bit_for_bit():
    """It recomputes the same forward in the backward, so on a CPU the gradient is the same to
    the last bit (analysis.SAME_RUN counts runs differing only in it as seeds of one cell)."""
    grads = []
    for ckpt in (False, True):
        pol = make_policy(("generator", "aggregator"), "shared")
        if ckpt:
            policies.checkpoint_layers(pol.model)
        S = _voting_like(pol)
        opts, scheds = grpo.make_optimizers(pol, lr=0.0, warmup_steps=0, total_steps=10)
        cap = Captured(pol)
        step(pol, opts, scheds, S, mini_batch=len(S), token_budget=32, probe=cap)
        grads.append(cap.seen[0][1])
    assert float(grads[0].norm()) > 0
    assert torch.equal(grads[0], grads[1])


# ----------------------------------------------------------------------------- credit (--credit)

def _trainable(ep):
    """A scripted episode's calls as if sampled: one completion token each (a call without one
    is not a training row)."""
    for c in ep.calls:
        c.prompt_ids, c.completion_ids, c.logprobs = [3], [1], [0.0]
    return ep

def _voting_episode(voter_texts, pick):
    """One scored Voting episode of problem m0 (answer 5) whose aggregator picks `pick` (1-based)."""
    import taskkinds
    import workflows
    from test_workflows import MATH, FakeLLM
    ep = Episode(problem=MATH[0])
    llm = FakeLLM(generator=list(voter_texts), aggregator=f"\\boxed{{{pick}}}")
    workflows.run_workflow("voting", [ep], llm, "math", n_voters=len(voter_texts))
    grade = lambda texts, problems: taskkinds.score(texts, problems, "math")   # noqa: E731
    ep.reward = grade([ep.final_text], [ep.problem])[0]
    return _trainable(ep), grade


@pytest.mark.parametrize("pick, paid", [(2, [1.0, 0.0, 0.0]),    # right voter, wrong pick: the voter is paid 1
                                        (1, [1.0, 0.0, 1.0])])   # right pick: the wrong voter is paid 0
def test_credit_own_pays_each_voter_its_own_grade_and_the_aggregator_the_final(pick, paid, tmp_path):
    import json

    import runfolder
    import workflows
    ep, grade = _voting_episode(["\\boxed{5}", "\\boxed{4}"], pick)
    assert ep.reward == float(pick == 1)
    workflows.pay([ep], "own", grade)
    samples = grpo.samples_from_episodes([ep])
    assert [s.reward for s in samples] == paid   # generator0, generator1, aggregator
    assert [s.slot for s in samples] == ["generator0", "generator1", "aggregator"]
    runfolder.log_transcripts(tmp_path / "samples.jsonl", 1, [ep], samples)   # the transcript says what was paid
    assert [json.loads(line)["reward"] for line in open(tmp_path / "samples.jsonl")] == paid


@pytest.mark.parametrize("pick", [1, 2])
def test_credit_final_pays_every_call_of_an_episode_the_same(pick):
    import workflows
    ep, grade = _voting_episode(["\\boxed{5}", "\\boxed{4}"], pick)
    workflows.pay([ep], "final", grade)
    assert [s.reward for s in grpo.samples_from_episodes([ep])] == [ep.reward] * 3
    with pytest.raises(ValueError, match="credit must be one of"):
        workflows.pay([ep], "mine", grade)


def test_credit_own_pays_each_eval_opt_attempt_its_own_grade():
    import taskkinds
    import workflows
    from test_workflows import MATH, FakeLLM
    ep = Episode(problem=MATH[0])
    llm = FakeLLM(generator=["\\boxed{4}", "\\boxed{5}", "\\boxed{6}"], evaluator="\\boxed{Incorrect}")
    workflows.run_workflow("eval_opt", [ep], llm, "math", max_rounds=2)
    grade = lambda texts, problems: taskkinds.score(texts, problems, "math")   # noqa: E731
    ep.reward = grade([ep.final_text], [ep.problem])[0]   # the last attempt, 6: wrong
    _trainable(ep)
    workflows.pay([ep], "own", grade)
    got = [(s.role, s.reward) for s in grpo.samples_from_episodes([ep])]
    assert got == [("generator", 0.0), ("evaluator", 0.0), ("generator", 1.0), ("evaluator", 0.0), ("generator", 0.0)]
