"""The model shapes the bench scripts build (random weights: neither speed nor memory depends on
them): small ones for a CPU, and the published Qwen3 ones. Imported by every bench script, and
importing nothing of the project, so a script can measure another checkout's code with it."""

CONFIGS = {  # small shapes, and the published Qwen3 ones (random weights: speed does not depend on them)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
    "toy": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,  # toy.py's
                num_key_value_heads=2, head_dim=32, vocab_size=512),  # shape (its vocabulary is 143)
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, vocab_size=4096),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
}
