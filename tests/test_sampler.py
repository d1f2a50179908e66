"""rollout.generate against model.generate, a teacher-forced recompute, and itself."""
import torch

import rollout
from conftest import tiny_qwen3

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [20]]
STOP, PAD = [1, 2], 2


def test_greedy_matches_hf_generate_on_left_padded_batch():
    for seed in range(3):
        m = tiny_qwen3(seed=seed)
        g = rollout.generate(m, PROMPTS, 12, stop_ids=STOP, pad_id=PAD, temperature=0)
        ids, mask = rollout.left_pad(PROMPTS, PAD, "cpu")
        ref = m.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                         pad_token_id=PAD, eos_token_id=STOP)[:, ids.shape[1]:]
        n = g.tokens.shape[1]
        assert torch.equal(g.tokens, ref[:, :n])
        assert (ref[:, n:] == PAD).all()  # hf may run on longer; only pad after our end


def test_prompt_alone_equals_prompt_in_padded_batch():
    m = tiny_qwen3(seed=1)
    batch = rollout.generate(m, PROMPTS, 10, stop_ids=STOP, pad_id=PAD, temperature=0)
    for i, p in enumerate(PROMPTS):
        alone = rollout.generate(m, [p], 10, stop_ids=STOP, pad_id=PAD, temperature=0)
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
    gen = torch.Generator().manual_seed(0)
    g = rollout.generate(m, PROMPTS, 10, stop_ids=STOP, pad_id=PAD, temperature=0.7, generator=gen)
    for i, p in enumerate(PROMPTS):
        comp = g.tokens[i][g.mask[i]].tolist()
        ref = teacher_forced_logprobs(m, p, comp, 0.7)
        assert torch.allclose(g.logprobs[i][g.mask[i]], ref, atol=1e-5)


def test_stop_token_in_mask_then_pad_and_finished_flags():
    m = tiny_qwen3(seed=0)
    free = rollout.generate(m, PROMPTS, 12, stop_ids=[63], pad_id=0, temperature=0)
    # a stop id that row 0 emits at step 3 but some other row never emits
    stop = int(free.tokens[0, 3])
    assert any(stop not in free.tokens[i].tolist() for i in range(1, len(PROMPTS)))
    g = rollout.generate(m, PROMPTS, 12, stop_ids=[stop, 63], pad_id=0, temperature=0)
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
    first = rollout.generate(m, [PROMPTS[0]], 12, stop_ids=STOP, pad_id=PAD, temperature=0)
    tok = int(first.tokens[0, 1])  # make the 2nd generated token a stop id of its own
    g = rollout.generate(m, [PROMPTS[0]], 12, stop_ids=[tok, 63], pad_id=0, temperature=0)
    assert g.finished[0] and g.mask[0].sum() <= 2


def test_same_seed_same_output_and_group_rows_differ():
    m = tiny_qwen3(seed=3)
    group = [PROMPTS[0]] * 16
    a = rollout.generate(m, group, 8, STOP, PAD, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b = rollout.generate(m, group, 8, STOP, PAD, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert len(set(a.tokens[:, 0].tolist())) > 1  # each row samples its own first token


def test_prefix_sharing_gives_the_same_result_as_separate_prefill():
    m = tiny_qwen3(seed=4)
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 2 + [PROMPTS[0]]
    a = rollout.generate(m, prompts, 8, STOP, PAD, temperature=0.7, generator=torch.Generator().manual_seed(1))
    b = rollout.generate(m, prompts, 8, STOP, PAD, temperature=0.7, generator=torch.Generator().manual_seed(1),
                         share_prefix=False)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_top_p_restricts_to_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]] * 2000)
    ids, _ = rollout.sample_next(logits, 1.0, 0.5, torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {0}  # token 0 alone holds > 0.5 of the mass
    ids, lp = rollout.sample_next(logits, 1.0, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(ids, minlength=4).float() / len(ids)
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1))


def test_top_p_exact_tie_keeps_only_the_smallest_prefix():
    # regression (issue 15 item 13): mass 0.5 is reached by token 0 alone, so token 1 must not
    # be drawn; with `cumsum - p > top_p` it was, about a third of the time
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 3000))
    ids, _ = rollout.sample_next(logits, 1.0, 0.5, torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {0}
    ids, _ = rollout.sample_next(logits, 1.0, 0.75, torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {0, 1}
