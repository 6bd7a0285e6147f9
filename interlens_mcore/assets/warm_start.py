"""The default policy: the tiny model after a short supervised phase on guess-a-number transcripts.

A scripted `Guesser` plays the games (`co_step`, no model), the transcripts are laid out token
for token as a rollout lays them out, and a few hundred steps of next-token cross-entropy on
the policy's tokens give the starting policy of the default run. Built once, cached.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..chat import ChatFormat
from ..tasks.guess import guess_transcripts
from ..types import Message
from . import folder
from .tiny import build_model, build_tokenizer, default_asset_dir

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
    which leaves the strategy to reinforcement learning. Built once (atomically, rebuilt if
    damaged; 15 to 60 s on one core), cached under `default_asset_dir()` in a folder named after the recipe.
    """
    from transformers import AutoTokenizer

    path = Path(path) if path is not None else default_asset_dir() / recipe.tag

    def build(tmp: Path) -> None:
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

    return folder.ensure(path, build, (*folder.MODEL_FILES, "warm_start.json"))
