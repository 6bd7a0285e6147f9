"""Tiny local assets: a BPE tokenizer with a chat template and a random causal LM.

Both are saved with `save_pretrained` and loaded back through `from_pretrained`, so the real
loading path runs; nothing is downloaded. `ensure_tiny_classifier` builds a tiny sequence
classifier (a reward model for tests) with the same tokenizer. (The default policy, that model after a short
supervised phase, is in `warm_start`; SmolLM2, which is downloaded, in `smollm2`.)
"""

from __future__ import annotations

import os
from pathlib import Path

from . import folder
from .chat_templates import with_tool_template

# the template the folders were first built with; a build saves its tool-capable form (`chat_templates`)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def default_asset_dir() -> Path:
    """Where built assets are cached: $INTERLENS_ASSETS, else ~/.cache/interlens_mcore."""
    root = os.environ.get("INTERLENS_ASSETS") or Path.home() / ".cache" / "interlens_mcore"
    return Path(root)


def _corpus() -> list[str]:
    words = (
        "guess the number between one and hundred higher lower correct wrong answer tool "
        "result call add sum total question reply agent user system you are a helpful "
        "assistant what is your next move yes no done think step first second third"
    ).split()
    lines = [" ".join(words[i : i + 7]) for i in range(0, len(words), 3)]
    lines += [f"{a} + {b} = {a + b}" for a in range(0, 60, 7) for b in range(0, 40, 3)]
    lines += [f"My guess is {n}. It is {'higher' if n % 2 else 'lower'}." for n in range(101)]
    return lines * 4


def build_tokenizer(path: Path, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer, wrap it as a fast tokenizer and save it to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    with_tool_template(fast).save_pretrained(path)
    return fast


def build_model(path: Path, tokenizer, *, arch: str = "qwen2", seed: int = 0, **overrides):
    """A tiny randomly initialised causal LM (Qwen2 or Llama) saved to `path`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(overrides)
    config: PretrainedConfig
    if arch == "qwen2":
        config = Qwen2Config(**kwargs)
    elif arch == "llama":
        config = LlamaConfig(**kwargs)
    else:
        raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def ensure_tiny_model(path: str | Path | None = None, *, arch: str = "qwen2", **overrides) -> Path:
    """Build the tiny model + tokenizer folder once (atomically; rebuilt if damaged) and return its path."""
    if path is None:
        suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        path = default_asset_dir() / (f"tiny-{arch}" + (f"-{suffix}" if suffix else ""))

    def build(tmp: Path) -> None:
        build_model(tmp, build_tokenizer(tmp), arch=arch, **overrides)

    return folder.ensure(Path(path), build)


def build_classifier(path: Path, tokenizer, *, seed: int = 0):
    """A tiny randomly initialised Qwen2 sequence classifier (one label: a reward model) saved to `path`."""
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.num_labels = 1  # one logit: the reward
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def ensure_tiny_classifier(path: str | Path | None = None) -> Path:
    """Build the tiny reward model + tokenizer folder once (atomically; rebuilt if damaged); its path."""
    path = Path(path) if path is not None else default_asset_dir() / "tiny-reward-qwen2"

    def build(tmp: Path) -> None:
        build_classifier(tmp, build_tokenizer(tmp))

    return folder.ensure(path, build)


def load_tiny(path: str | Path | None = None, **kwargs):
    """(model, tokenizer) loaded through AutoModelForCausalLM / AutoTokenizer.from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    built = ensure_tiny_model(path, **kwargs)
    tokenizer = with_tool_template(AutoTokenizer.from_pretrained(built))  # a folder cached before it
    model = AutoModelForCausalLM.from_pretrained(built)
    return model, tokenizer
