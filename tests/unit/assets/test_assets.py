"""The default policy's warm start: transcripts laid out token for token as rollouts lay them
out, a supervised phase that learns them, and the cached default asset playing in format."""

from __future__ import annotations

import json

import pytest
import torch

from interlens_mcore.assets import (
    Guesser,
    WarmStart,
    ensure_default_policy,
    guess_transcripts,
    supervised_phase,
    transcript_ids,
)
from interlens_mcore.chat import ChatFormat
from interlens_mcore.engines.base import Generation, SamplingParams
from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.rollout.conversation import Conversation, Policy
from interlens_mcore.rollout.costep import co_step
from interlens_mcore.rollout.stop import MaxTurns
from interlens_mcore.tasks.guess import GuessNumberTask, guess_tasks, reply_number


class Replay:
    """An engine that answers every row with the next of its replies (eos appended)."""

    name, max_context = "replay", 1024

    def __init__(self, chat: ChatFormat, replies: list[str]):
        self.chat, self.replies = chat, list(replies)

    def generate(self, requests):
        out = []
        for _ in requests:
            ids = self.chat.encode(self.replies.pop(0)) + list(self.chat.stop_token_ids)
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop"))
        return out


def test_transcript_ids_equal_the_rollout_view(tiny):
    _, tokenizer = tiny
    chat = ChatFormat(tokenizer)
    task = GuessNumberTask(secret=6)
    policy = Policy("policy", Replay(chat, ["4", "5", "6"]), tokenizer, SamplingParams(max_new_tokens=4))
    conv = Conversation(task.lineup(lambda name: policy), prompt=task.prompt(), run_until=MaxTurns(6))
    co_step([conv], turns=None)
    (trajectory,) = conv.trajectories()
    answers = ["higher: between 5 and 7", "higher: between 6 and 7", "correct"]
    assert [m.content for m in conv.messages] == [x for pair in zip("456", answers) for x in pair]
    ids, mask = transcript_ids(chat, [*conv.prompt, *conv.messages])
    assert ids == trajectory.token_ids
    assert mask == trajectory.loss_mask


def test_guesser_mixes_binary_search_and_uniform_guesses():
    # binary_share 1: binary search, which solves every game of [1, 7] within its 3 guesses
    games = guess_transcripts(70, seed=3, binary_share=1.0)
    assert all(g[-1].content == "correct" for g in games)
    assert all(g[1].content == "4" for g in games)
    # binary_share 0: uniform guesses that ignore the answers (first guesses spread over 1..7)
    firsts = [reply_number(g[1].content) for g in guess_transcripts(200, seed=3, binary_share=0.0)]
    assert set(firsts) == set(range(1, 8))
    assert guess_transcripts(5, seed=1, binary_share=0.5) == guess_transcripts(5, seed=1, binary_share=0.5)
    assert isinstance(Guesser(guess_tasks(1, seed=0)[0], 0.5, seed=0).rng.random(), float)


def test_supervised_phase_learns_binary_search(tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # a fresh copy of the tiny model and the tokenizer as rollouts load it
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    chat = ChatFormat(tokenizer)
    sequences = [transcript_ids(chat, g) for g in guess_transcripts(128, seed=0, binary_share=1.0)]
    torch.manual_seed(0)
    losses = supervised_phase(model, tokenizer.pad_token_id, sequences, WarmStart(steps=40, lr=3e-3))
    # the opening is the same in every game, so its reply "4" is learned first; measured
    # loss 6.2 -> 0.45 at step 40
    assert losses[-1] < 0.25 * losses[0]
    prompt = chat.message_ids("user", GuessNumberTask(secret=1).prompt()[0].content)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + chat.generation_prompt_ids()])).logits[0, -1]
    assert tokenizer.decode([int(logits.argmax())]) == "4"


def test_warm_start_checks_its_fields():
    with pytest.raises(ValueError, match="binary_share"):
        WarmStart(binary_share=1.5)
    with pytest.raises(ValueError, match="steps"):
        WarmStart(steps=0)
    assert WarmStart().tag != WarmStart(steps=61).tag  # another recipe, another cache folder


def test_small_recipe_builds_a_loadable_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = WarmStart(games=32, steps=3, batch=8)
    folder = ensure_default_policy(tmp_path / "policy", recipe)
    record = json.loads((folder / "warm_start.json").read_text())
    assert record["steps"] == 3 and record["loss_last"] < record["loss_first"]
    AutoModelForCausalLM.from_pretrained(folder)
    AutoTokenizer.from_pretrained(folder)
    assert ensure_default_policy(tmp_path / "policy", recipe) == folder  # cached: not rebuilt
    # no temporary folder left; the lock file stays (removing it would race a builder that waits on it)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".policy.lock", "policy"]


def test_default_policy_plays_in_format():
    """The default asset (built once into $INTERLENS_ASSETS, about 15 s on one core)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_default_policy()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    policy = Policy(
        "policy",
        HFEngine(AutoModelForCausalLM.from_pretrained(folder), tokenizer),
        tokenizer,
        SamplingParams(temperature=1.0, max_new_tokens=3),
    )
    tasks = guess_tasks(128, seed=4242)
    convs = [
        Conversation(
            t.lineup(lambda name: policy), prompt=t.prompt(), run_until=MaxTurns(t.max_turns), seed=i
        )
        for i, t in enumerate(tasks)
    ]
    co_step(convs, turns=None)
    replies = [m.content for c in convs for m in c.messages if m.speaker == "policy"]
    assert sum(r.strip() in {str(n) for n in range(1, 8)} for r in replies) >= 0.95 * len(replies)
    success = sum(c.infos["success"] for c in convs) / len(convs)
    # see WarmStart: a share of binary-search moves lifts it above uniform guessing's 0.37,
    # far from binary search's 1.0
    assert 0.25 < success < 0.8, success
