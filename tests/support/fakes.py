"""Fakes shared by the rollout tests: for what a test is not about (the engine, the environment)."""

from __future__ import annotations

from interlens_mcore import Environment
from interlens_mcore.engine import Generation


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
