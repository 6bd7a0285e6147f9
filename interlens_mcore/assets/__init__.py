"""Models built locally for tests, examples and the default run; nothing comes from a model hub.

- `tiny`: a BPE tokenizer with a chat template and a random tiny Qwen2 / Llama (`load_tiny`),
  and a tiny Qwen2 sequence classifier, the reward model of tests (`ensure_tiny_classifier`);
- `warm_start`: the default policy, that model after a short supervised phase on
  guess-a-number transcripts (`ensure_default_policy`);
- `smollm2`: SmolLM2-135M-Instruct from the GGUF file in a package of the registry.
"""

from ..tasks.guess import Guesser, guess_transcripts  # the transcripts' player, beside its game
from .smollm2 import AssetUnavailable, ensure_smollm2
from .tiny import (
    build_classifier,
    build_model,
    build_tokenizer,
    default_asset_dir,
    ensure_tiny_classifier,
    ensure_tiny_model,
    load_tiny,
)
from .warm_start import (
    WarmStart,
    ensure_default_policy,
    supervised_phase,
    transcript_ids,
)

__all__ = [
    "AssetUnavailable",
    "Guesser",
    "WarmStart",
    "build_classifier",
    "build_model",
    "build_tokenizer",
    "default_asset_dir",
    "ensure_default_policy",
    "ensure_smollm2",
    "ensure_tiny_classifier",
    "ensure_tiny_model",
    "guess_transcripts",
    "load_tiny",
    "supervised_phase",
    "transcript_ids",
]
