"""Shared test fixtures: tiny random Qwen3 models built from a config (never a download)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
