"""Named model sizes. Parameter counts depend on the vocabulary, so each line gives the count
with a byte vocabulary (256) and with a GPT-2-sized one (50,257), tied embeddings:

    preset  d_model layers heads   bytes     50k vocab
    micro        64      2     2   ~0.11M    ~3.3M     CPU experiments: many runs per hour
    tiny        128      4     4   ~0.84M    ~7.2M     trains in minutes on a 2-core CPU
    small       320      8     5   ~10M      ~26M
    16m         256      4     4   ~3.2M     ~16M      the paper's smallest model
    125m        768     12    12   ~85M      ~124M
    360m       1024     24    16   ~302M     ~353M
    720m       1536     24    16   ~680M     ~757M
"""

from __future__ import annotations

from mtdao.model.llama import ModelConfig

MODEL_PRESETS = ("micro", "tiny", "small", "16m", "125m", "360m", "720m")

_SHAPES = {
    "micro": dict(d_model=64, n_layers=2, n_heads=2),
    "tiny": dict(d_model=128, n_layers=4, n_heads=4),
    "small": dict(d_model=320, n_layers=8, n_heads=5),
    "16m": dict(d_model=256, n_layers=4, n_heads=4),
    "125m": dict(d_model=768, n_layers=12, n_heads=12),
    "360m": dict(d_model=1024, n_layers=24, n_heads=16),
    "720m": dict(d_model=1536, n_layers=24, n_heads=16),
}


def model_config(preset: str, vocab_size: int, max_seq_len: int) -> ModelConfig:
    """The ModelConfig of a named size; the vocabulary and context come from the data side."""
    if preset not in _SHAPES:
        raise ValueError(f"unknown model preset {preset!r}; valid: {', '.join(MODEL_PRESETS)}")
    return ModelConfig(vocab_size=vocab_size, max_seq_len=max_seq_len, **_SHAPES[preset])
