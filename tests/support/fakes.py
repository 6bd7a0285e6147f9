"""Fakes shared by the tests: for what a test is not about (the engine, the environment)."""

from __future__ import annotations

from interlens_mcore import Environment
from interlens_mcore.distributed import ParallelGroups
from interlens_mcore.engines.base import Generation
from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.rollout.mixin import RolloutConfig, RolloutMixin


class Feedback(Environment):
    """Answers every policy turn with a fixed line that names the conversation's secret."""

    def __init__(self, secret: int, name: str = "env"):
        self.secret, self.name = secret, name

    def respond(self, conv):
        return f"number {self.secret} is higher"


class Recording:
    """Wraps a real engine and records every call's rows (a spy, not a fake)."""

    def __init__(self, engine, name: str | None = None):
        self.engine, self.calls = engine, []
        self.name, self.max_context = name or engine.name, engine.max_context

    def generate(self, requests):
        self.calls.append(list(requests))
        return self.engine.generate(requests)


class Endless:
    """A fake engine that never samples a stop token: token 7 forever (the test is about caps)."""

    def __init__(self, name: str = "endless", max_context: int = 10_000):
        self.name, self.max_context = name, max_context
        self.calls: list[list[int]] = []

    def generate(self, requests):
        self.calls.append([r.max_new_tokens for r in requests])
        return [
            Generation(
                token_ids=[7] * r.max_new_tokens, logprobs=[-1.0] * r.max_new_tokens, finish_reason="length"
            )
            for r in requests
        ]


class ScriptEngine:
    """Answers each conversation's turns with scripted texts (tokenized), in order."""

    name, max_context = "script", 1 << 15  # the tiny tokenizer spells a tools preamble out in ~4k tokens

    def __init__(self, tok, replies: dict[str, list[str]]):
        self.tok, self.replies, self.calls = tok, {k: list(v) for k, v in replies.items()}, 0

    def generate(self, requests):
        out = []
        for r in requests:
            text = self.replies[r.tag].pop(0)
            ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            out.append(Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
        return out


class ForeignTrainer(RolloutMixin):
    """A trainer that is not ours, with this package's rollouts mixed in: an HF model, one process."""

    def __init__(self, model, tokenizer, **rollout):
        self.engine = HFEngine(model, tokenizer)
        self.tokenizer = tokenizer
        self.groups = ParallelGroups(rank=0, world_size=1)
        self.rollout_config = RolloutConfig(**{"max_new_tokens": 4, **rollout})


class Says:
    """A fake engine that answers every row with the same ids, ending at a stop (the test is
    about what surrounds a turn, not what is in it)."""

    def __init__(self, token_ids: list[int], name: str = "says", max_context: int = 10_000):
        self.token_ids, self.name, self.max_context = list(token_ids), name, max_context
        self.calls: list[list] = []

    def generate(self, requests):
        self.calls.append(list(requests))
        return [
            Generation(
                token_ids=list(self.token_ids), logprobs=[-1.0] * len(self.token_ids), finish_reason="stop"
            )
            for _ in requests
        ]
