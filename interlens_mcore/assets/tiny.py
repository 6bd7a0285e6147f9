"""Tiny local assets: a BPE tokenizer with a chat template, a random causal LM, and the default
policy (that model after a short supervised phase on guess-a-number transcripts).

All are saved with `save_pretrained` and loaded back through `from_pretrained`, so the real
loading path runs; nothing is downloaded. (SmolLM2, which is, lives in `assets_smollm2`.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .chat import ChatFormat
from .conversation import Conversation, Environment
from .costep import co_step
from .envs.guess import GuessNumberTask, game_state, guess_tasks, reply_number
from .stop import MaxTurns
from .trajectory import Message

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def publish(built: Path, path: Path) -> None:
    """Move a finished asset folder into place; another process that finished first wins."""
    try:
        os.rename(built, path)
    except OSError:
        if not (path / "config.json").exists():
            raise


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
    fast.save_pretrained(path)
    return fast


def build_model(path: Path, tokenizer, *, arch: str = "qwen2", seed: int = 0, **overrides):
    """A tiny randomly initialised causal LM (Qwen2 or Llama) saved to `path`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

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
    """Build the tiny model + tokenizer folder once (atomically) and return its path."""
    if path is None:
        suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        path = default_asset_dir() / (f"tiny-{arch}" + (f"-{suffix}" if suffix else ""))
    path = Path(path)
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        tokenizer = build_tokenizer(tmp)
        build_model(tmp, tokenizer, arch=arch, **overrides)
        publish(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_tiny(path: str | Path | None = None, **kwargs):
    """(model, tokenizer) loaded through AutoModelForCausalLM / AutoTokenizer.from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_tiny_model(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    return model, tokenizer


# -- the default policy: the tiny model after a short supervised phase on game transcripts --------
# bumped whenever the transcripts change for the same recipe (the game's answers, the guesser)
WARM_START_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class WarmStart:
    """The supervised phase that turns the random tiny model into the default run's starting policy."""

    games: int = 1024  # transcripts of a `Guesser`
    binary_share: float = 0.25  # how often the transcripts' guesser plays the binary-search move
    steps: int = 200
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("games", "steps", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"WarmStart.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"WarmStart.lr must be > 0, got {self.lr}")
        if not 0.0 <= self.binary_share <= 1.0:
            raise ValueError(f"WarmStart.binary_share must lie in [0, 1], got {self.binary_share}")

    @property
    def tag(self) -> str:
        """The cache folder's name: another recipe builds another folder."""
        return (
            f"guess-policy-v{WARM_START_VERSION}-g{self.games}-p{self.binary_share:g}-s{self.steps}"
            f"-b{self.batch}-lr{self.lr:g}-seed{self.seed}"
        )


class Guesser(Environment):
    """Plays the policy's seat of guess-a-number from a script: the binary-search move with
    probability `binary_share`, else a uniformly random number of the range (answers ignored)."""

    name, role = "policy", "assistant"

    def __init__(self, task: GuessNumberTask, binary_share: float, *, seed: int):
        self.task, self.binary_share, self.rng = task, binary_share, random.Random(seed)

    def respond(self, conv: Conversation) -> str:
        t = self.task
        if self.rng.random() >= self.binary_share:
            return str(self.rng.randint(t.low, t.high))
        state = game_state(t, [reply_number(m.content) for m in conv.messages if m.speaker == self.name])
        return str((state.low + state.high) // 2)


def guess_transcripts(n: int, *, seed: int, binary_share: float) -> list[list[Message]]:
    """`n` games of guess-a-number played by a `Guesser`, as message lists (prompt included)."""
    convs = []
    for i, task in enumerate(guess_tasks(n, seed=seed)):
        lineup = [Guesser(task, binary_share, seed=seed * 1_000_003 + i), task.environment()]
        convs.append(Conversation(lineup, prompt=task.prompt(), run_until=MaxTurns(task.max_turns)))
    co_step(convs, turns=None)
    return [[*c.prompt, *c.messages] for c in convs]


def transcript_ids(chat: ChatFormat, messages: list[Message]) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a transcript as a policy's view holds it; 1 on the policy's tokens.

    A policy turn is laid out as a rollout samples it: the generation prompt, the reply's ids
    and eos (the sampled part, trained), then what the template closes a turn with.
    """
    ids = chat.preamble_ids(messages[0].role) if messages else []
    mask = [0] * len(ids)
    for m in messages:
        if m.role == "assistant":
            head, tail = chat.generation_prompt_ids(), chat.close_ids("stop")
            said = chat.encode(m.content) + list(chat.stop_token_ids)
            ids += head + said + tail
            mask += [0] * len(head) + [1] * len(said) + [0] * len(tail)
        else:
            piece = chat.message_ids(m.role, m.content)
            ids += piece
            mask += [0] * len(piece)
    return ids, mask


def supervised_phase(
    model, pad_id: int, sequences: list[tuple[list[int], list[int]]], recipe: WarmStart
) -> list[float]:
    """Next-token cross-entropy on the masked tokens of `sequences`; returns the loss of each step."""
    import torch

    gen = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    model.train()
    losses = []
    threads = torch.get_num_threads()
    # one thread: the same reduction order on every build (a deterministic result), and ranks
    # of a launch that build it side by side do not oversubscribe the cores (two threads on a
    # busy 2-core machine ran this loop 10x slower than one)
    torch.set_num_threads(1)
    try:
        for _ in range(recipe.steps):
            losses.append(_supervised_step(model, optimizer, sequences, pad_id, recipe.batch, gen))
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return losses


def _supervised_step(model, optimizer, sequences, pad_id: int, batch: int, gen) -> float:
    import torch

    pick = torch.randint(len(sequences), (batch,), generator=gen).tolist()
    width = max(len(sequences[i][0]) for i in pick)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)  # [B, T], right-padded
    labels = torch.full((batch, width), -100, dtype=torch.long)  # [B, T], -100: no loss
    for row, i in enumerate(pick):
        seq, mask = sequences[i]
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, : len(seq)] = torch.tensor([t if m else -100 for t, m in zip(seq, mask)])
    loss = model(input_ids=ids, labels=labels).loss  # the model shifts the labels by one
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def ensure_default_policy(path: str | Path | None = None, recipe: WarmStart = WarmStart()) -> Path:
    """The default run's starting model: the tiny Qwen2 model after `recipe`'s supervised phase.

    Real RL starts from a model that already follows the task's format; this is the tiny
    model's version of that. Its transcripts come from a `Guesser` that plays the binary-search
    move a quarter of the time and a uniformly random number otherwise, so the model learns to
    answer with a bare number of the range and leans a little toward the right move. At
    temperature 1 it solves about a third of the games (binary search solves all of them),
    which leaves the strategy to reinforcement learning. Built once (atomically; 15 to 60 s on
    one core), cached under `default_asset_dir()` in a folder named after the recipe.
    """
    from transformers import AutoTokenizer

    path = Path(path) if path is not None else default_asset_dir() / recipe.tag
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        model = build_model(tmp, build_tokenizer(tmp), seed=recipe.seed)
        # the tokenizer as every later user loads it: next to a Qwen2 config, AutoTokenizer
        # gives a Qwen2 tokenizer, whose pre-tokenizer splits numbers into single digits
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        chat = ChatFormat(tokenizer)
        games = guess_transcripts(recipe.games, seed=recipe.seed, binary_share=recipe.binary_share)
        sequences = [transcript_ids(chat, g) for g in games]
        losses = supervised_phase(model, tokenizer.pad_token_id, sequences, recipe)
        model.save_pretrained(tmp)
        record = {**asdict(recipe), "loss_first": losses[0], "loss_last": losses[-1]}
        (tmp / "warm_start.json").write_text(json.dumps(record, indent=2))
        publish(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
