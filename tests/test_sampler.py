"""engine.generate against model.generate, the plain rollout.generate_simple, a teacher-forced
recompute, and itself: the engine's spec (engine.py's docstring names the invariants)."""
import itertools
from collections import Counter

import pytest
import torch

import engine
import rollout
import seeds
from conftest import tiny_qwen3


def uniforms(n, seed=0):
    """n float64 uniforms in [0, 1), one per row, as generate draws them."""
    return seeds.uniforms(seed, torch.arange(n), torch.zeros(n, dtype=torch.long))


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [20]]
STOP, PAD = [1, 2], 2


def test_greedy_matches_hf_generate_on_left_padded_batch():
    for seed in range(3):
        m = tiny_qwen3(seed=seed)
        g = engine.generate(m, PROMPTS, 12, stop_ids=STOP, pad_id=PAD, temperature=0)
        ids, mask = rollout.left_pad(PROMPTS, PAD, "cpu")
        ref = m.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                         pad_token_id=PAD, eos_token_id=STOP)[:, ids.shape[1]:]
        n = g.tokens.shape[1]
        assert torch.equal(g.tokens, ref[:, :n])
        assert (ref[:, n:] == PAD).all()  # hf may run on longer; only pad after our end


def test_prompt_alone_equals_prompt_in_padded_batch():
    m = tiny_qwen3(seed=1)
    batch = engine.generate(m, PROMPTS, 10, stop_ids=STOP, pad_id=PAD, temperature=0)
    for i, p in enumerate(PROMPTS):
        alone = engine.generate(m, [p], 10, stop_ids=STOP, pad_id=PAD, temperature=0)
        n = alone.tokens.shape[1]
        assert torch.equal(alone.tokens[0], batch.tokens[i, :n])
        assert torch.allclose(alone.logprobs[0], batch.logprobs[i, :n], atol=1e-5)


def teacher_forced_logprobs(m, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    logits = m(input_ids=ids).logits[0].float() / temperature  # (P+T, V)
    # the logprob of completion token t comes from the logits at position P-1+t
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_sampler_logprobs_equal_teacher_forced_recompute():
    m = tiny_qwen3(seed=2)
    g = engine.generate(m, PROMPTS, 10, stop_ids=STOP, pad_id=PAD, temperature=0.7, seed=0)
    for i, p in enumerate(PROMPTS):
        comp = g.tokens[i][g.mask[i]].tolist()
        ref = teacher_forced_logprobs(m, p, comp, 0.7)
        assert torch.allclose(g.logprobs[i][g.mask[i]], ref, atol=1e-5)


def test_stop_token_in_mask_then_pad_and_finished_flags():
    m = tiny_qwen3(seed=0)
    free = engine.generate(m, PROMPTS, 12, stop_ids=[63], pad_id=0, temperature=0)
    # a stop id that row 0 emits at step 3 but some other row never emits
    stop = int(free.tokens[0, 3])
    assert any(stop not in free.tokens[i].tolist() for i in range(1, len(PROMPTS)))
    g = engine.generate(m, PROMPTS, 12, stop_ids=[stop, 63], pad_id=0, temperature=0)
    kinds = set()
    for i in range(len(PROMPTS)):
        toks, mask = g.tokens[i], g.mask[i]
        is_stop = (toks == stop) & mask
        kinds.add(bool(g.finished[i]))
        if g.finished[i]:
            k = int(is_stop.nonzero()[0])        # first stop id
            assert mask[: k + 1].all()           # stop token kept in the mask
            assert not mask[k + 1 :].any() and (toks[k + 1 :] == 0).all()
            assert torch.equal(toks[: k + 1], free.tokens[i, : k + 1])
        else:
            assert mask.all() and not is_stop.any() and mask.numel() == 12
    assert kinds == {True, False}  # both a stopped and a truncated row were checked


def test_second_stop_id_also_stops():
    m = tiny_qwen3(seed=0)
    first = engine.generate(m, [PROMPTS[0]], 12, stop_ids=STOP, pad_id=PAD, temperature=0)
    tok = int(first.tokens[0, 1])  # make the 2nd generated token a stop id of its own
    g = engine.generate(m, [PROMPTS[0]], 12, stop_ids=[tok, 63], pad_id=0, temperature=0)
    assert g.finished[0] and g.mask[0].sum() <= 2


def test_same_seed_same_output_and_group_rows_differ():
    m = tiny_qwen3(seed=3)
    group = [PROMPTS[0]] * 16
    a = engine.generate(m, group, 8, STOP, PAD, temperature=1.0, seed=7)
    b = engine.generate(m, group, 8, STOP, PAD, temperature=1.0, seed=7)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert len(set(a.tokens[:, 0].tolist())) > 1  # each row samples its own first token


def test_prefix_sharing_gives_the_same_result_as_separate_prefill():
    m = tiny_qwen3(seed=4)
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 2 + [PROMPTS[0]]
    a = engine.generate(m, prompts, 8, STOP, PAD, temperature=0.7, seed=1)
    b = engine.generate(m, prompts, 8, STOP, PAD, temperature=0.7, seed=1,
                         share_prefix=False)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_top_p_restricts_to_the_nucleus_and_gives_the_logprob_of_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]] * 2000)
    ids, lp = rollout.sample_next(logits, 1.0, 0.5, uniforms(len(logits)))
    assert set(ids.tolist()) == {0}  # token 0 alone holds > 0.5 of the mass
    assert torch.allclose(lp, torch.zeros(len(logits)), atol=1e-6)   # the nucleus renormalised: p = 1
    # two tokens kept: each logprob is log p - log(p0 + p1), under what was sampled (issue 53's p_sampler)
    ids, lp = rollout.sample_next(logits, 1.0, 0.9, uniforms(len(logits)))
    p = torch.softmax(logits[0].double(), -1)
    assert set(ids.tolist()) == {0, 1}
    assert torch.allclose(lp.double(), torch.log(p[ids] / (p[0] + p[1])), atol=1e-6)
    ids, lp = rollout.sample_next(logits, 1.0, 1.0, uniforms(len(logits)))
    freq = torch.bincount(ids, minlength=4).float() / len(ids)
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1))


# ----------------------------------------------------------------------------- KV budget

# ten prompts, two of them twice, with limits of their own: more rows than the budgets below hold
MANY = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [20], [21, 22, 23, 24, 25],
        [12, 13], [26, 27, 28], [29, 30, 31, 32, 33, 34, 35, 36], [5, 6, 7, 8, 9, 10, 11], [37, 38]]
LIMITS = [9, 3, 14, 6, 1, 11, 7, 4, 12, 8]


def budget_for(model, rows, prompts=MANY, limits=LIMITS):
    """Bytes of `rows` rows of the call's longest need (prompt + limit, in whole pages) and the
    trash page: the rows in flight a budget guarantees (shorter rows fit more)."""
    page = engine.PAGE["cpu"]
    need = engine.pages_for(max(len(p) + t for p, t in zip(prompts, limits)), page)
    return (rows * need + 1) * page * engine.kv_bytes_per_token(model.config, model.dtype) + 1


def hf_alone(m, prompt, limit, stop=STOP):
    """model.generate on one prompt, cut at its first stop id."""
    out = m.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                     do_sample=False, max_new_tokens=limit, pad_token_id=PAD, eos_token_id=stop)[0, len(prompt):]
    hit = torch.isin(out, torch.tensor(stop)).nonzero()
    return out[: int(hit[0]) + 1] if len(hit) else out


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.3, bos_token_id=None, eos_token_id=STOP, pad_token_id=PAD)
    return LlamaForCausalLM(cfg).eval()


def test_greedy_in_a_small_budget_matches_hf_generate_alone():
    for m in [tiny_qwen3(seed=0), tiny_qwen3(seed=5), tiny_llama(seed=0)]:
        free = engine.generate(m, MANY, 14, stop_ids=[63], pad_id=PAD, temperature=0)
        stop = [int(free.tokens[0, 2]), 63]  # row 0 stops at step 2, others when they emit it
        stats = {}
        g = engine.generate(m, MANY, LIMITS, stop, PAD, temperature=0, kv_budget=budget_for(m, 3), stats=stats)
        assert stats["rows"] >= 3 and g.finished.any() and not g.finished.all()
        for i, (p, limit) in enumerate(zip(MANY, LIMITS)):
            ref = hf_alone(m, p, limit, stop)
            assert torch.equal(g.tokens[i][g.mask[i]], ref), i
            assert bool(g.finished[i]) == (int(ref[-1]) in stop)


def test_logprobs_in_a_small_budget_equal_teacher_forced_recompute():
    m = tiny_qwen3(seed=2)
    g = engine.generate(m, MANY, LIMITS, STOP, PAD, temperature=0.7, seed=0, kv_budget=budget_for(m, 4))
    for i, p in enumerate(MANY):
        comp = g.tokens[i][g.mask[i]].tolist()
        assert len(comp) >= 1
        ref = teacher_forced_logprobs(m, p, comp, 0.7)
        assert torch.allclose(g.logprobs[i][g.mask[i]], ref, atol=1e-5)
        assert (g.logprobs[i][~g.mask[i]] == 0).all()


def test_identical_prompts_prefilled_once_across_refills():
    m = tiny_qwen3(seed=3)
    prompts = [PROMPTS[k % 3] for k in [0, 1, 2, 0, 0, 2, 1, 1, 0, 2, 1, 0, 2, 2, 1]]  # 3 distinct x 5
    limits = [2 + (5 * k) % 9 for k in range(len(prompts))]                           # rows end apart
    budget = budget_for(m, 4, prompts, limits)
    runs = {}
    for share in (True, False):
        stats = {}
        runs[share] = engine.generate(m, prompts, limits, STOP, PAD, temperature=1.0, seed=1,
                                       share_prefix=share, kv_budget=budget, stats=stats)
        assert stats["rows"] >= 4
        # each distinct prompt once, again for a row preempted or a kept prompt let go for pages
        assert stats["prefill_rows"] == (3 if share else 15) + stats["preempted"] + stats["let_go"]
    assert torch.equal(runs[True].tokens, runs[False].tokens)
    assert torch.allclose(runs[True].logprobs, runs[False].logprobs, atol=1e-5)
    assert len(set(runs[True].tokens[:, 0].tolist())) > 1  # each copy samples its own first token


def test_per_row_limits_and_finished_flags_in_a_small_budget():
    m = tiny_qwen3(seed=0)
    free = engine.generate(m, MANY, 14, stop_ids=[63], pad_id=0, temperature=0)
    stop = int(free.tokens[0, 2])  # a stop id that row 0 emits at step 2 (some rows never do)
    g = engine.generate(m, MANY, LIMITS, [stop, 63], 0, temperature=0, kv_budget=budget_for(m, 3))
    kinds = set()
    for i, limit in enumerate(LIMITS):
        toks, mask = g.tokens[i], g.mask[i]
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any() and (toks[n:] == 0).all()
        seen = (free.tokens[i, :limit] == stop).nonzero()
        if len(seen):  # stopped at its first stop id, stop token kept
            assert g.finished[i] and n == int(seen[0]) + 1 and int(toks[n - 1]) == stop
        else:          # cut at its own limit
            assert not g.finished[i] and n == limit
        assert torch.equal(toks[:n], free.tokens[i, :n])
        kinds.add((bool(g.finished[i]), limit < 14))
    assert {(True, True), (False, True)} <= kinds


def kv_bytes_held(cache):
    """Bytes of every tensor the cache's layers hold, by storage (views counted once); written
    here again on purpose, so the test does not trust engine.cache_bytes, which it checks."""
    storages = {}
    for layer in cache.layers:
        for t in vars(layer).values():
            if torch.is_tensor(t):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def test_kv_memory_held_never_exceeds_the_budget():
    m = tiny_qwen3(seed=1)
    held = []

    def measure(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        held.append(kv_bytes_held(cache))
    hook = m.register_forward_pre_hook(measure, with_kwargs=True)
    try:
        for rows in (1, 3, 5):
            budget, stats = budget_for(m, rows), {}
            held.clear()
            engine.generate(m, MANY, LIMITS, STOP, PAD, temperature=0.7, kv_budget=budget, stats=stats,
                             seed=0)
            assert held and max(held) <= budget
            assert max(held) > budget * (rows - 1) / rows  # the budget is used, not wasted
            assert stats["kv_bytes"] == max(held) and stats["rows"] >= rows
    finally:
        hook.remove()


def test_a_budget_below_one_row_gives_one_clear_error():
    m = tiny_qwen3()
    bpt = engine.kv_bytes_per_token(m.config, m.dtype)
    need = max(len(p) + t for p, t in zip(MANY, LIMITS))
    with pytest.raises(ValueError) as e:
        engine.generate(m, MANY, LIMITS, STOP, PAD, kv_budget=need * bpt - 1)
    assert f"kv_budget {need * bpt - 1:,} B" in str(e.value) and f"{need * bpt:,} B" in str(e.value)
    assert f"{need} tokens" in str(e.value)


def test_kv_budget_helpers_at_the_real_shapes():
    from transformers import Qwen3Config
    shapes = {"0.6b": (28, 1024, 16, 114_688), "4b": (36, 2560, 32, 147_456)}  # bf16, from NOTES
    for layers, hidden, heads, want in shapes.values():
        cfg = Qwen3Config(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                          num_key_value_heads=8, head_dim=128)
        assert engine.kv_bytes_per_token(cfg, torch.bfloat16) == want
        assert engine.kv_bytes_per_token(cfg, torch.float32) == 2 * want
    assert engine.rows_that_fit(10 * 2**30, 114_688, 5320) == 17
    assert engine.rows_that_fit(10 * 2**30, 114_688, 5320, page=64) == 17       # 1,461 pages of 84 a row
    assert engine.rows_that_fit(10 * 2**30, 114_688, 5000, page=64) == 18       # 79 pages a row
    assert engine.default_kv_budget("cpu") == engine.CPU_KV_BUDGET
    assert engine.kv_budget_line(10 * 2**30, 114_688, 200, 5120) == \
        "KV budget 10.00 GiB in 1,462 pages of 64 tokens holds 17 rows of 200+5120 tokens"


def test_the_memory_plan_counts_an_embedded_solution_at_most_one_completion():
    """An aggregator's prompt embeds three earlier completions, each at most max_new_tokens long:
    with 48 new tokens (arith on SmolLM2) the plan assumes 3 x 48 + 512 prompt tokens, not the
    3 x 1,536 that --max-embed-tokens would allow."""
    import argparse

    import policies
    policy = policies.Policy(tiny_qwen3(), None, ("generator",), rank=2)
    args = argparse.Namespace(max_prompt_tokens=None, max_embed_tokens=1536, max_new_tokens=48, token_budget=1024,
                              kv_budget_gb=None)
    assert "rows of 656+48 tokens" in engine.memory_plan(policy, 2**30, args)
    args.max_new_tokens = 5120
    assert "rows of 5120+5120 tokens" in engine.memory_plan(policy, 2**30, args)
    args.max_prompt_tokens = 300
    assert "rows of 300+5120 tokens" in engine.memory_plan(policy, 2**30, args)


def test_the_memory_plan_adds_the_kept_decode_logits_to_what_fits_beside_the_cache():
    """On CUDA the plan sums what must fit beside the KV cache: AdamW, sampling and, per set of
    weights whose decode graphs are kept, its (rows, V) fp32 logits and hole buffers."""
    gib = 2**30
    line = engine.beside_cache(40 * gib, "0.85 of it", 34 * gib, 2**26, rows=1024, vocab=2**18, sets=4,
                               hole_bytes=2**18)
    assert "AdamW 1.00 GiB" in line and "kept decode logits and hole buffers 5.00 GiB" in line
    assert f"sampling {1024 * 2**18 * engine.SAMPLE_BYTES / gib:.2f} GiB" in line
    assert f"= {40 + 1024 * 2**18 * engine.SAMPLE_BYTES / gib:.2f} GiB" in line
    assert "kept decode logits and hole buffers 0.00 GiB" in engine.beside_cache(40 * gib, "x", gib, 0, 8, 16, sets=0)
    # Qwen3-0.6B's shape in bf16: 28 layers x 2 x (16 + 8) heads x 128 x 2 B = 336 KiB a row
    from transformers import Qwen3Config
    cfg = Qwen3Config(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    assert engine.hole_bytes_per_row(cfg, torch.bfloat16) == 336 * 1024


def test_top_p_exact_tie_keeps_only_the_smallest_prefix():
    # regression (issue 15 item 13): mass 0.5 is reached by token 0 alone, so token 1 must not
    # be drawn; with `cumsum - p > top_p` it was, about a third of the time
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 3000))
    ids, _ = rollout.sample_next(logits, 1.0, 0.5, uniforms(len(logits)))
    assert set(ids.tolist()) == {0}
    ids, _ = rollout.sample_next(logits, 1.0, 0.75, uniforms(len(logits)))
    assert set(ids.tolist()) == {0, 1}


def test_a_short_prompt_with_a_long_limit_beside_a_long_prompt():
    # the long prompt wants few tokens, the short one many: each row holds its own pages.
    # Prompts are written from column 0 whatever their prefill chunk's padding, so the short
    # prompt may share a chunk with the long one, and a later copy of it shares the kept
    # prompt's pages (one prefill per distinct prompt)
    m = tiny_qwen3(seed=6)
    long, short = list(range(20, 30)), [5, 6]
    for prompts, limits in [([long, short], [2, 20]), ([long, short, short, short], [2, 2, 20, 20])]:
        stats = {}
        g = engine.generate(m, prompts, limits, [63], PAD, temperature=0,
                             kv_budget=budget_for(m, 2, prompts, limits), stats=stats)
        assert stats["rows"] >= 2 and stats["prefill_rows"] == 2 + stats["preempted"] + stats["let_go"]
        for i, (p, limit) in enumerate(zip(prompts, limits)):
            assert torch.equal(g.tokens[i][g.mask[i]], hf_alone(m, p, limit, [63])), i


# ----------------------------------------------------------------------------- the reference sampler

def assert_same_generation(fast, simple, atol=1e-5):
    assert torch.equal(fast.tokens, simple.tokens)
    assert torch.equal(fast.mask, simple.mask) and torch.equal(fast.finished, simple.finished)
    assert torch.allclose(fast.logprobs, simple.logprobs, atol=atol, rtol=0), float((fast.logprobs - simple.logprobs).abs().max())


@pytest.mark.parametrize("build,seed", [(tiny_qwen3, 0), (tiny_qwen3, 5), (tiny_llama, 0)],
                         ids=["qwen3-0", "qwen3-5", "llama-0"])
def test_generate_equals_generate_simple_greedy_through_refills(build, seed):
    m = build(seed=seed)
    free = rollout.generate_simple(m, MANY, 14, stop_ids=[63], pad_id=PAD, temperature=0)
    stop = [int(free.tokens[0, 2]), 63]  # row 0 stops at step 2, others when they emit it
    simple = rollout.generate_simple(m, MANY, LIMITS, stop, PAD, temperature=0)
    n = simple.mask.sum(1)
    cut = ~simple.finished
    assert simple.finished.any() and cut.any()  # rows that hit a stop id and rows cut at their limit
    assert torch.equal(n[cut], torch.tensor(LIMITS)[cut])
    assert all(int(simple.tokens[i, n[i] - 1]) in stop for i in simple.finished.nonzero()[:, 0])
    for rows in (1, 3):  # ten prompts in the pages of one or three of the longest rows: the rows refill
        stats = {}
        fast = engine.generate(m, MANY, LIMITS, stop, PAD, temperature=0, kv_budget=budget_for(m, rows),
                                stats=stats)
        assert rows <= stats["rows"] < len(MANY)
        assert_same_generation(fast, simple)


def test_generate_simple_is_seeded_and_its_logprobs_equal_teacher_forced_recompute():
    m = tiny_qwen3(seed=2)
    a, b = (rollout.generate_simple(m, MANY, LIMITS, STOP, PAD, temperature=0.7,
                                    seed=0) for _ in range(2))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(a.mask, b.mask) and torch.equal(a.finished, b.finished)
    assert a.finished.any() and not a.finished.all()  # pad == a stop id here: the mask tells them apart
    for i, p in enumerate(MANY):
        comp = a.tokens[i][a.mask[i]].tolist()
        assert 1 <= len(comp) <= LIMITS[i]
        assert torch.allclose(a.logprobs[i][a.mask[i]], teacher_forced_logprobs(m, p, comp, 0.7), atol=1e-5)
        assert (a.logprobs[i][~a.mask[i]] == 0).all() and (a.tokens[i][~a.mask[i]] == PAD).all()


# ----------------------------------------------------------------------------- draws keyed by the row

@pytest.mark.parametrize("build,seed", [(tiny_qwen3, 0), (tiny_llama, 0)])
def test_sampling_equals_generate_simple_token_for_token_whatever_the_rows(build, seed):
    # temperature 0.7 and top-p 0.9: each row's draws are keyed by (seed, its key, position),
    # so neither the cache row a row gets, nor the refills, nor the rows beside it change a token
    m = build(seed=seed)
    keys = [seeds.key("problem", i // 2, i % 2) for i in range(len(MANY))]
    simple = rollout.generate_simple(m, MANY, LIMITS, STOP, PAD, temperature=0.7, top_p=0.9, seed=5, keys=keys)
    for rows in (1, 3, None):
        fast = engine.generate(m, MANY, LIMITS, STOP, PAD, temperature=0.7, top_p=0.9, seed=5, keys=keys,
                                kv_budget=None if rows is None else budget_for(m, rows))
        assert_same_generation(fast, simple)
    # a row alone, or among the others in another order, samples the same tokens
    order = list(reversed(range(len(MANY))))
    rev = engine.generate(m, [MANY[i] for i in order], [LIMITS[i] for i in order], STOP, PAD, temperature=0.7,
                           top_p=0.9, seed=5, keys=[keys[i] for i in order], kv_budget=budget_for(m, 2))
    for j, i in enumerate(order):
        n = int(simple.mask[i].sum())
        assert torch.equal(rev.tokens[j, :n], simple.tokens[i, :n])
    alone = engine.generate(m, [MANY[4]], [LIMITS[4]], STOP, PAD, temperature=0.7, top_p=0.9, seed=5, keys=[keys[4]])
    assert torch.equal(alone.tokens[0, :int(alone.mask[0].sum())], simple.tokens[4, :int(simple.mask[4].sum())])
    other = engine.generate(m, MANY, LIMITS, STOP, PAD, temperature=0.7, top_p=0.9, seed=6, keys=keys)
    assert not torch.equal(other.tokens, simple.tokens)   # the seed does change the draws


def test_the_integer_mixer_equals_its_plain_integer_version():
    import random
    xs = [random.Random(0).getrandbits(64) for _ in range(500)] + [0, 1, (1 << 64) - 1, 1 << 63]
    t = torch.tensor([x - (1 << 64) if x >= 1 << 63 else x for x in xs], dtype=torch.long)
    assert [v & seeds.M64 for v in seeds.splitmix64_t(t).tolist()] == [seeds.splitmix64(x) for x in xs]
    assert seeds.key("train", 3, "p", 0, 2) == seeds.key("train", 3, "p", 0, 2) != seeds.key("train", 3, "p", 0, 1)


def chi_square_p(observed, expected):
    """p-value of Pearson's chi-square statistic (Wilson-Hilferty's normal approximation of its
    distribution, good for the 50+ degrees of freedom used here)."""
    import math
    x2 = float(((observed - expected) ** 2 / expected).sum())
    k = len(observed) - 1
    z = ((x2 / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


V = 151_936   # Qwen3's vocabulary


def qwen_sized_logits(kind):
    g = torch.Generator().manual_seed(3)
    if kind == "flat":
        return torch.randn(V, generator=g) * 0.1
    logits = torch.randn(V, generator=g) * 2.0    # peaked: a few tokens hold most of the mass
    logits[torch.randperm(V, generator=g)[:5]] += 14.0
    return logits


def equal_mass_bins(p, n, least=20):
    """Consecutive runs of tokens, each expected at least `least` times in n draws: (start of
    each run, the mass of each run)."""
    starts, masses, acc = [0], [], 0.0
    for v, x in enumerate(p.tolist()):
        acc += x
        if acc * n >= least and v + 1 < len(p):
            starts.append(v + 1)
            masses.append(acc)
            acc = 0.0
    masses.append(acc)
    if masses[-1] * n < least:   # the last run joins the one before
        starts.pop()
        masses[-2:] = [masses[-2] + masses[-1]]
    return torch.tensor(starts), torch.tensor(masses, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["flat", "peaked"])
def test_the_draw_is_the_exact_distribution_over_a_qwen3_vocabulary(kind, monkeypatch):
    logits = qwen_sized_logits(kind)[None]                                    # (1, V) fp32
    exact = torch.softmax(logits.double() / 0.7, -1)[0]                       # the float64 softmax
    # the probabilities the draw implements, with its own arithmetic: token v is taken when
    # c[v-1] <= u c[-1] < c[v], c the cumulative masses sample_next hands to inverse_cdf
    seen, search = [], rollout.inverse_cdf
    monkeypatch.setattr(rollout, "inverse_cdf", lambda c, u: seen.append(c) or search(c, u))
    rollout.sample_next(logits, 0.7, 1.0, torch.full((1,), 0.5, dtype=torch.float64))
    monkeypatch.undo()
    c = seen[0]                                                                # (1, V)
    implemented = torch.diff(c[0], prepend=c.new_zeros(1)) / c[0, -1]
    assert float((implemented - exact).abs().max()) < 1e-12
    assert bool((implemented > 0).all())                                      # every token can be drawn
    # draws with the sampler's own uniforms, counted in runs of tokens of equal expected mass
    n = 100_000
    u = seeds.uniforms(11, torch.arange(n), torch.zeros(n, dtype=torch.long))
    ids = rollout.inverse_cdf(c, u[None])[0]                                  # (n,)
    starts, mass = equal_mass_bins(exact, n)
    observed = torch.bincount(torch.bucketize(ids, starts, right=True) - 1, minlength=len(starts)).double()
    p = chi_square_p(observed, mass * n)
    print(f"{kind}: chi-square p = {p:.3f} over {len(starts)} bins of {n} draws")
    assert p > 1e-3
    # the whole path: sample_next draws the same tokens, with the logprob of the scaled softmax
    ids2, lp = rollout.sample_next(logits.expand(200, V), 0.7, 1.0, u[:200])
    assert torch.equal(ids2, ids[:200])
    assert torch.allclose(lp, torch.log(exact[ids2]).float(), atol=1e-5)


@pytest.mark.parametrize("kind", ["flat", "peaked"])
def test_the_fp32_draw_is_the_exact_distribution_to_fp32_rounding(kind, monkeypatch):
    """CUDA's draw (rollout.SAMPLE_DTYPE): fp32 probabilities in blocks. Over a Qwen3 vocabulary
    a uniform picks the token that float64's inverse CDF picks, except within fp32 rounding of a
    boundary between two tokens; every token can be drawn (block and token mass positive); and
    draws pass the chi-square test. A row's draws depend on its uniform alone (row by row or in a
    batch, the same tokens)."""
    logits = qwen_sized_logits(kind)[None]                                    # (1, V) fp32
    exact = torch.softmax(logits.double() / 0.7, -1)                          # (1, V)
    c = exact.cumsum(-1)
    n = 100_000
    u = seeds.uniforms(11, torch.arange(n), torch.zeros(n, dtype=torch.long))  # (n,) float64
    probs = torch.softmax(logits / 0.7, -1)                                   # (1, V) fp32, as sample_next's
    ids = torch.cat([rollout._draw_blocks(probs, u[None, a:a + 5000])[0] for a in range(0, n, 5000)])   # (n,)
    ref = rollout.inverse_cdf(c, u[None])[0]                                   # float64's picks
    near = torch.minimum((u * c[0, -1] - c[0, ref - 1].where(ref > 0, torch.zeros(()))).abs(),
                         (c[0, ref] - u * c[0, -1]).abs())                    # u's distance to a boundary
    differ = ids != ref
    print(f"{kind}: {int(differ.sum())} of {n} draws differ from float64's, all within "
          f"{float(near[differ].max()) if differ.any() else 0:.1e} of a boundary")
    assert int(differ.sum()) <= n // 1000 and (near[differ] < 1e-6).all()
    # every token drawable: the fp32 probabilities are all positive and no block's mass rounds away
    assert bool((probs > 0).all())
    starts, mass = equal_mass_bins(exact[0], n)
    observed = torch.bincount(torch.bucketize(ids, starts, right=True) - 1, minlength=len(starts)).double()
    assert chi_square_p(observed, mass * n) > 1e-3
    # the whole path: sample_next on CUDA's type draws the same tokens, row by row or in a batch,
    # with the logprob of the scaled softmax
    monkeypatch.setitem(rollout.SAMPLE_DTYPE, "cpu", torch.float32)
    batch, lp = rollout.sample_next(logits.expand(100, V), 0.7, 1.0, u[:100])
    one = torch.cat([rollout.sample_next(logits, 0.7, 1.0, u[i:i + 1])[0] for i in range(20)])
    assert torch.equal(batch, ids[:100]) and torch.equal(one, ids[:20])
    assert torch.allclose(lp, torch.log(exact[0, batch]).float(), atol=1e-5)
    # the block a draw falls in holds a token of the smallest fp32 probability too: the draw of the
    # last token's own mass picks it
    last = torch.full((1, V), -30.0)
    last[0, 0], last[0, -1] = 10.0, -8.0                                       # p(last) ~ 1e-8, in the last block
    pl = torch.softmax(last.double(), -1)[0]
    u_last = ((1 - pl[-1] / 2) / pl.sum()).reshape(1)                          # inside the last token's mass
    assert int(rollout.sample_next(last, 1.0, 1.0, u_last)[0]) == V - 1


# ----------------------------------------------------------------------------- the decode step

class Step:
    """A decode step's numbers as _Writes.decode makes them: pages, their rows, their masks."""

    def __init__(self, n, pages, rows, valid, page):
        self.pages, self.rows = torch.tensor(pages), torch.tensor(rows)
        self.rows_q = self.rows.clamp(max=n - 1)
        self.mask = (torch.arange(page) < torch.tensor(valid)[:, None])[:, None, None]


def test_paged_attention_equals_transformers_sdpa_and_eager_attention():
    """Rows of 11, 9, 7, 4, 2 and 1 columns in pages of 3 scattered through a pool (one page
    shared by two rows, a pad page of row n): the same output as SDPA and eager attention over
    each row's own columns, and a row with no page gets zeros, not NaN."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward
    m = tiny_qwen3(hidden=64, heads=8, kv_heads=2)              # 4 query heads per KV head
    attn = m.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    n, W, D, page = 7, 11, attn.head_dim, 3
    q, k, v = (torch.randn(n, h, t, D, generator=g) for h, t in ((8, 1), (2, W), (2, W)))
    width = [11, 9, 7, 4, 2, 1, 0]                               # the last row holds no page (a free slot)
    k[1, :, :3], v[1, :, :3] = k[0, :, :3], v[0, :, :3]          # rows 0 and 1 share their first page
    pool_k, pool_v = torch.randn(2, 40, page, D, generator=g), torch.randn(2, 40, page, D, generator=g)
    free, pages, rows, valid, first = iter(torch.randperm(39, generator=g)[:30].add(1).tolist()), [], [], [], None
    for r, w in enumerate(width):
        for j in range(-(-w // page)):
            p = first if (r, j) == (1, 0) else next(free)        # row 1 reads row 0's first page
            first = p if (r, j) == (0, 0) else first
            cols = slice(j * page, min(w, (j + 1) * page))
            w_ = cols.stop - cols.start
            pool_k[:, p, :w_], pool_v[:, p, :w_] = k[r, :, cols], v[r, :, cols]
            pages.append(p), rows.append(r), valid.append(cols.stop - cols.start)
    pages.append(0), rows.append(n), valid.append(1)             # a pad page: row n, dropped
    ours = engine.paged_attention(q, pool_k, pool_v, Step(n, pages, rows, valid, page), attn.scaling)
    assert ours.shape == (n, 1, 8, D) and bool((ours[-1] == 0).all())
    mask = (torch.arange(W) < torch.tensor(width)[:, None])[:n - 1, None, None]   # (n-1, 1, 1, W)
    ref, _ = sdpa_attention_forward(attn, q[:-1], k[:-1], v[:-1], mask, scaling=attn.scaling)
    eager, _ = eager_attention_forward(attn, q[:-1], k[:-1], v[:-1],
                                       torch.zeros(mask.shape).masked_fill(~mask, float("-inf")), scaling=attn.scaling)
    assert float((ours[:-1] - ref).abs().max()) < 1e-6 and float((ours[:-1] - eager).abs().max()) < 1e-6


MIXED = MANY + [list(range(3, 40)), list(range(7, 25))]   # two long prompts among short ones
MIXED_LIMITS = LIMITS + [6, 13]


def test_paged_attention_on_bf16_rounds_only_its_output():
    """bf16 queries and pages, as a CUDA run has: the scores and each page's output are fp32
    products (engine.bmm32), so the output is as close to a float64 softmax over the same values
    as rounding that softmax to bf16 is (scores rounded to bf16 were 3x further off here)."""
    g = torch.Generator().manual_seed(0)
    n, H, gq, D, page, W = 4, 2, 2, 128, 8, 64
    P = W // page
    q = (3 * torch.randn(n, H * gq, 1, D, generator=g)).bfloat16()
    pool_k, pool_v = (torch.randn(H, n * P + 1, page, D, generator=g).bfloat16() for _ in range(2))
    pages, rows = [1 + r * P + j for r in range(n) for j in range(P)], [r for r in range(n) for _ in range(P)]
    out = engine.paged_attention(q, pool_k, pool_v, Step(n, pages, rows, [page] * len(pages), page), D ** -0.5)
    ref = torch.empty(n, 1, H * gq, D, dtype=torch.float64)
    for r in range(n):
        K, V = (pool[:, 1 + r * P:1 + (r + 1) * P].reshape(H, W, D).double().repeat_interleave(gq, 0)
                for pool in (pool_k, pool_v))
        ref[r] = (torch.softmax(q[r].double() @ K.transpose(1, 2) * D ** -0.5, -1) @ V).transpose(0, 1)
    err, rounding = ((x - ref).abs().max() / ref.abs().max() for x in (out.double(), ref.bfloat16().double()))
    assert out.dtype == torch.bfloat16 and err <= 1.2 * rounding


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_pages_of_any_size_sample_what_generate_simple_does(build, monkeypatch):
    # pages of 1, 3 and 8 tokens (rows cross page boundaries at every step, some, or seldom), attended
    # page by page (CUDA's paged_attention) or in rows (a CPU's row_attention), small budgets that
    # refill and keep prompts for later copies: greedy and keyed sampling must not notice
    m = build(seed=0)
    prompts, limits = MIXED + MIXED[:3], MIXED_LIMITS + MIXED_LIMITS[:3]   # some prompts twice
    keys = [seeds.key("mixed", i) for i in range(len(prompts))]
    for temperature, top_p in ((0, 1.0), (0.7, 0.9)):
        simple = rollout.generate_simple(m, prompts, limits, STOP, PAD, temperature=temperature, top_p=top_p,
                                         seed=3, keys=keys)
        for page, attend, rows in itertools.product((1, 3, 8), ("pages", "rows"), (1, 3, None)):
            monkeypatch.setitem(engine.PAGE, "cpu", page)
            monkeypatch.setitem(engine.ATTEND, "cpu", attend)
            stats = {}
            fast = engine.generate(m, prompts, limits, STOP, PAD, temperature=temperature, top_p=top_p, seed=3,
                                   keys=keys, stats=stats,
                                   kv_budget=None if rows is None else budget_for(m, rows, prompts, limits))
            assert_same_generation(fast, simple)
            assert stats["own_columns"] <= stats["attended_columns"]


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_rows_preempted_when_pages_run_out_sample_what_generate_simple_does(build, monkeypatch):
    # rows are admitted on the pages their prompts hold, so short prompts with long limits in a
    # budget of one row outgrow the pool: the latest is preempted and resumes later from its prompt
    # and tokens; with the CPU's stop check and CUDA's (a row may have stopped unseen when it is
    # preempted), rows that run to their limit (stop id 64: no token) or stop on STOP
    m = build(seed=0)
    prompts = [[5 + i, 6 + i, 7][:2 + i % 2] for i in range(8)] + [PROMPTS[0]]
    limits = [30 - 2 * i for i in range(len(prompts))]
    keys = [seeds.key("preempt", i) for i in range(len(prompts))]
    seen = []
    for stop, (temperature, top_p) in itertools.product(([64], STOP), ((0, 1.0), (0.7, 0.9))):
        simple = rollout.generate_simple(m, prompts, limits, stop, PAD, temperature=temperature, top_p=top_p,
                                         seed=5, keys=keys)
        for every in (1, 4):
            monkeypatch.setitem(engine.STOP_EVERY, "cpu", every)
            stats = {}
            fast = engine.generate(m, prompts, limits, stop, PAD, temperature=temperature, top_p=top_p, seed=5,
                                   keys=keys, kv_budget=budget_for(m, 1, prompts, limits), stats=stats)
            # a resumed row's K/V is prefilled again in one pass, not token by token: another
            # summation order, 1.3e-5 apart at two threads (tokens equal)
            assert_same_generation(fast, simple, atol=5e-5)
            assert stats["rows"] > 1
            seen.append(stats["preempted"])
    assert min(seen[:4]) > 0             # rows that run to their limit: preempted in every call


def test_a_long_prompt_among_short_ones_holds_about_its_rows_own_tokens():
    """One prompt of 2,000 tokens and 63 of 20, every row to its limit of 16: the call holds K/V
    for at most 1.2x the tokens its rows have at the end (a cache of rows sized for the longest
    would hold 64 x 2,016), and all 64 rows run at once in a budget of 1.2x their tokens."""
    m = tiny_qwen3(seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (2000 if i == 0 else 20,), generator=g).tolist() for i in range(64)]
    new, bpt = 16, engine.kv_bytes_per_token(m.config, m.dtype)
    own = sum(len(p) + new for p in prompts)                   # tokens the rows have at the end
    for budget in (None, int(1.2 * own * bpt)):
        stats = {}
        out = engine.generate(m, prompts, new, [64], PAD, temperature=0, kv_budget=budget, stats=stats)
        assert bool(out.mask.all())                            # every row ran to its limit (64: no token)
        ratio = stats["kv_bytes"] / (own * bpt)
        print(f"budget {budget}: K/V held {stats['kv_bytes']:,} B for {own:,} tokens of {bpt} B: {ratio:.3f}x; "
              f"{stats['rows']} rows at once")
        assert 1.0 <= ratio <= 1.2 and stats["rows"] == 64


def test_every_row_runs_at_once_when_the_pool_holds_every_row(monkeypatch):
    """Without a budget the pool holds every row's prompt and limit; rows that already hold
    their last page (here all, in CUDA's pages of 64) need no page kept for their growth, so
    all start at once (a page kept for each row in flight let 2 of 5 run)."""
    monkeypatch.setitem(engine.PAGE, "cpu", 64)
    m = tiny_qwen3(seed=0)
    prompts = [[5 + i, 6, 7] for i in range(5)]
    for limits in (4, [4, 4, 70, 4, 4]):            # one row crosses into a second page
        stats = {}
        out = engine.generate(m, prompts, limits, STOP, PAD, temperature=0.7, seed=1, stats=stats)
        assert stats["rows"] == 5 and stats["preempted"] == 0
        assert_same_generation(out, rollout.generate_simple(m, prompts, limits, STOP, PAD, temperature=0.7, seed=1))


def test_prefill_chunks_are_the_cheapest_cut_within_the_token_cap(monkeypatch):
    """Prompts longest first, every one in one chunk; a forward costs PREFILL_CALL padded tokens:
    a cheap one splits where the length falls most, a dear one never; PREFILL_TOKENS still caps
    a chunk's padded tokens."""
    lens = [10, 100, 9, 98, 8, 99]                                   # two lengths, shuffled
    for call, want in ((50, [[1, 5, 3], [0, 2, 4]]),                  # 2 x 50 + 300 + 30 against 50 + 600
                       (1000, [[1, 5, 3, 0, 2, 4]])):                 # one forward of 6 x 100
        monkeypatch.setitem(engine.PREFILL_CALL, "cpu", call)
        assert engine._prefill_chunks(lens, "cpu") == want
    monkeypatch.setattr(engine, "PREFILL_TOKENS", 200)                # at most 2 x 100 padded tokens
    chunks = engine._prefill_chunks(lens, "cpu")
    assert sorted(u for c in chunks for u in c) == list(range(6))
    assert all(len(c) * lens[c[0]] <= 200 or len(c) == 1 for c in chunks)
    assert all(lens[a] >= lens[b] for c in chunks for a, b in zip(c, c[1:]))


def test_prompts_prefilled_in_several_chunks_sample_what_generate_simple_does(monkeypatch):
    monkeypatch.setitem(engine.PREFILL_CALL, "cpu", 0)               # a forward costs nothing: a chunk a length
    m = tiny_qwen3(seed=0)
    keys = [seeds.key("mixed", i) for i in range(len(MIXED))]
    simple = rollout.generate_simple(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3, keys=keys)
    assert len(engine._prefill_chunks([len(p) for p in MIXED], "cpu")) >= 3
    assert_same_generation(engine.generate(m, MIXED, MIXED_LIMITS, STOP, PAD, temperature=0.7, seed=3, keys=keys),
                           simple)


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_right_padded_causal_prefill_samples_what_generate_simple_does(build, monkeypatch):
    # CUDA's prefill on a CPU: right-padded chunks through the causal kernel with no mask, each
    # row's first logits read at its own last position; prompts of several lengths in one chunk
    # (padded), or a chunk a length, with prefix sharing and refills in a small budget
    monkeypatch.setitem(engine.PREFILL_CAUSAL, "cpu", True)
    seen, real = [], engine._last_logits
    monkeypatch.setattr(engine, "_last_logits", lambda *a: seen.append({len(p) for p in a[2]}) or real(*a))
    m = build(seed=0)
    prompts, limits = MIXED + MIXED[:4], MIXED_LIMITS + MIXED_LIMITS[:4]   # some prompts twice
    keys = [seeds.key("causal", i) for i in range(len(prompts))]
    for temperature, top_p in ((0, 1.0), (0.7, 0.9)):
        simple = rollout.generate_simple(m, prompts, limits, STOP, PAD, temperature=temperature, top_p=top_p,
                                         seed=2, keys=keys)
        for rows, call in ((3, 0), (None, 0), (None, 64)):
            monkeypatch.setitem(engine.PREFILL_CALL, "cpu", call)   # 0: a forward costs nothing, a chunk a length
            fast = engine.generate(m, prompts, limits, STOP, PAD, temperature=temperature, top_p=top_p, seed=2, keys=keys,
                                   kv_budget=None if rows is None else budget_for(m, rows, prompts, limits))
            assert_same_generation(fast, simple)
    assert len(seen) >= 6 and max(map(len, seen)) >= 3     # several chunks, one of several lengths


SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def test_no_host_sync_inside_a_decode_step_and_the_stop_check_read_once_every_4_steps(monkeypatch):
    monkeypatch.setitem(engine.STOP_EVERY, "cpu", engine.STOP_EVERY["cuda"])   # the schedule of a GPU
    m = tiny_qwen3(seed=2)
    count, where = Counter(), ["loop"]
    for name in SYNCS:
        def counted(self, *a, _real=getattr(torch.Tensor, name), **k):
            count[where[0]] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    for owner, name in ((engine._Decoder, "forward"), (engine, "_sample")):
        def inside(*a, _real=getattr(owner, name), **k):
            where[0] = "step"
            try:
                return _real(*a, **k)
            finally:
                where[0] = "loop"
        monkeypatch.setattr(owner, name, inside)
    stats = {}
    engine.generate(m, MIXED * 2, MIXED_LIMITS * 2, STOP, PAD, temperature=0.7, seed=0,
                     kv_budget=budget_for(m, 2, MIXED, MIXED_LIMITS), stats=stats)
    monkeypatch.undo()
    steps = stats["decode_steps"]
    assert steps >= 40 and 2 <= stats["rows"] < 2 * len(MIXED)
    assert count["step"] == 0                          # sampling, the forward and the counters
    # the stop check's reads, the output's length, and a preempted row's state (.cpu, .tolist)
    assert count["loop"] <= steps // 4 + 1 + 1 + 2 * stats["preempted"]


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_the_cuda_stop_check_period_samples_what_generate_simple_does(build, monkeypatch):
    # CUDA's schedule on a CPU: the host learns of a stop id from a copy read every 4 steps, so
    # a row that stopped runs on (its tokens discarded) for up to 8 steps and its cache row is
    # refilled later; what each row keeps must not change, greedy or keyed, through refills
    assert engine.STOP_EVERY["cuda"] == 4
    m = build(seed=0)
    keys = [seeds.key("stop-every", i) for i in range(len(MIXED))]
    for temperature, top_p in ((0, 1.0), (0.7, 0.9)):
        free = rollout.generate_simple(m, MIXED, 14, [63], PAD, temperature=temperature, top_p=top_p, seed=4, keys=keys)
        stop = [int(free.tokens[0, 2]), 63]     # row 0 stops at step 2, others when they emit it
        simple = rollout.generate_simple(m, MIXED, MIXED_LIMITS, stop, PAD, temperature=temperature, top_p=top_p,
                                         seed=4, keys=keys)
        assert simple.finished.sum() >= 2 and not simple.finished.all()   # rows that stop by id, and rows cut
        for rows in (1, 2, None):
            budget, steps = None if rows is None else budget_for(m, rows, MIXED, MIXED_LIMITS), {}
            for every in (1, 4):   # the CPU's period, then CUDA's
                monkeypatch.setitem(engine.STOP_EVERY, "cpu", every)
                stats = {}
                fast = engine.generate(m, MIXED, MIXED_LIMITS, stop, PAD, temperature=temperature, top_p=top_p, seed=4,
                                       keys=keys, kv_budget=budget, stats=stats)
                assert_same_generation(fast, simple)
                steps[every] = stats["decode_steps"], stats["rows"]
            assert steps[4][0] >= steps[1][0]              # rows ran on: never fewer steps
            assert steps[1][1] < len(MIXED) or rows is None   # in a budget, rows waited for pages: refills


def test_no_repeat_kv_in_a_decode_step_on_any_transformers_version(monkeypatch):
    # transformers 5.17's SDPA path repeats each KV head for its query heads in decode
    # (repeat_kv); generate's decode attention folds the query heads instead
    import importlib
    calls, where = Counter(), ["other"]
    for name in ("transformers.integrations.sdpa_attention", "transformers.models.qwen3.modeling_qwen3",
                 "transformers.models.llama.modeling_llama"):
        mod = importlib.import_module(name)
        if hasattr(mod, "repeat_kv"):
            real = mod.repeat_kv
            monkeypatch.setattr(mod, "repeat_kv", lambda *a, _r=real, **k: calls.update([where[0]]) or _r(*a, **k))
    forward = engine._Decoder.forward

    def decoding(*a, **k):
        where[0] = "decode"
        try:
            return forward(*a, **k)
        finally:
            where[0] = "other"
    monkeypatch.setattr(engine._Decoder, "forward", decoding)
    for m in (tiny_qwen3(seed=1), tiny_llama(seed=1)):
        engine.generate(m, MANY, LIMITS, STOP, PAD, temperature=0.7, kv_budget=budget_for(m, 3))
        m.config._attn_implementation = "eager"          # the patch does see a repeat_kv call
        m(input_ids=torch.tensor([[3, 4]]))
    assert calls["decode"] == 0 and calls["other"] >= 2


def test_make_llm_fast_and_simple_samplers_give_the_same_calls(tmp_path):
    import functools

    import policies
    from conftest import save_tiny_toy_model
    model, tok = policies.load(save_tiny_toy_model(tmp_path / "m"))
    pol = policies.Policy(model, tok, ("generator",), "shared", rank=4, alpha=8)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in pol.parameters_of("shared"):
            p.normal_(0, 0.1)
    msgs = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((1, 2), (3, 45), (67, 8), (1, 2))]
    keys = [("p", i) for i in range(len(msgs))]
    bpt = engine.kv_bytes_per_token(model.config, model.dtype)
    samplers = {"fast": functools.partial(engine.generate, kv_budget=2 * 60 * bpt), "simple": rollout.generate_simple}
    calls = {s: rollout.make_llm(pol, sampler=f, temperature=0.7, max_new_tokens=9)(
        "generator", ["generator"] * len(msgs), msgs, keys=keys) for s, f in samplers.items()}
    for a, b in zip(calls["fast"], calls["simple"]):
        assert a.completion_ids == b.completion_ids and a.finished == b.finished and a.text == b.text
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    with pytest.raises(ValueError, match="sampler"):
        rollout.make_llm(pol, sampler="vllm")
    with pytest.raises(ValueError, match=r"needs keys=, one per row"):   # draws by call order: not on resume
        rollout.make_llm(pol)("generator", ["generator"], msgs[:1])


def test_host_outputs_are_the_calls_four_tensors_copied_once(monkeypatch):
    # make_llm reads every row's ids, logprobs and flag: on CUDA each read waits for the device,
    # so train.py's and eval.py's fast sampler (host=True) hands it the call's four tensors
    # copied to the host once, after the loop
    m = tiny_qwen3(seed=0)
    ref = engine.generate(m, PROMPTS, 5, STOP, PAD, temperature=0.7)
    moved, real_cpu = [], torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: moved.append(tuple(self.shape)) or real_cpu(self, *a, **k))
    gen = engine.generate(m, PROMPTS, 5, STOP, PAD, temperature=0.7, host=True)
    monkeypatch.undo()
    assert_same_generation(gen, ref)
    assert all(t.device.type == "cpu" for t in (gen.tokens, gen.logprobs, gen.mask, gen.finished))
    assert moved[-4:] == [tuple(gen.tokens.shape)] * 3 + [(len(PROMPTS),)]     # the last copies: one per tensor
