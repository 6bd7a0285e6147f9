"""What reward functions receive is one contract (`rewards.inputs`), checked across every
convention and every source: the prompt, the completion, the columns and the transcript each
convention is handed agree with the sample's logged conversation (its token ids, decoded as
completions.jsonl logs them) and with the row it came from.

Each source's rollout runs once, in-process, with a scripted engine over the tiny tokenizer
(sampling is not what this is about), through the source's own `run` as the trainer calls it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.fakes import Says
from support.verifiers_envs import write

from interlens_mcore.assets import ensure_tiny_classifier
from interlens_mcore.compat.swift import MultiTurnScheduler as SwiftScheduler
from interlens_mcore.compat.swift import SwiftTaskSource
from interlens_mcore.distributed import ParallelGroups
from interlens_mcore.grpo.rewards import WeightedRewards
from interlens_mcore.rewards import adapt
from interlens_mcore.rewards.inputs import RESERVED, HasColumns
from interlens_mcore.rewards.judge import Judge, Template
from interlens_mcore.rewards.model import RewardModel
from interlens_mcore.rollout.rollouter import RolloutConfig, Rollouter
from interlens_mcore.tasks import dataset as ds_tasks
from interlens_mcore.tasks.families import make_source
from interlens_mcore.tasks.registry import resolve_task
from interlens_mcore.tasks.toy import GuessTasks
from interlens_mcore.types import Status

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

QUESTIONS = ["What is 1 + 1?", "What is 2 + 2?"]


class SwiftAnswer(SwiftScheduler):
    """One turn; the reward says whether the reply holds the row's solution."""

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        right = infer_request.data_dict["solution"] in (response_choice.message.content or "")
        return {"done": True, "rollout_infos": {"reward": float(right)}}


async def ask(client, row):
    """An --agent: asks the row's question once, in its own words."""
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
    )
    return {"reward": float("2" in (reply.choices[0].message.content or ""))}


def _dataset(folder, chat: bool):
    path = folder / ("chat.jsonl" if chat else "text.jsonl")
    rows = [
        {"prompt": [{"role": "user", "content": q}] if chat else q, "solution": str(2 * (i + 1)), "level": i}
        for i, q in enumerate(QUESTIONS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ds_tasks.source(str(path), eval_fraction=0.0)


def _swift_rows():
    return [
        {"messages": [{"role": "user", "content": q}], "solution": str(2 * (i + 1))}
        for i, q in enumerate(QUESTIONS)
    ]


def _sources(folder):
    from interlens_mcore.agents.task import AgentTasks

    return {
        "guess": GuessTasks(),
        "dataset-text": _dataset(folder, chat=False),
        "dataset-chat": _dataset(folder, chat=True),
        "reasoning-gym": make_source("reasoning_gym:basic_arithmetic", max_attempts=1),
        "gymnasium": make_source("gym:FrozenLake-v1", max_steps=2),
        "textarena": make_source("textarena:TicTacToe-v0", max_moves=2),
        "scheduler": SwiftTaskSource(SwiftAnswer(max_turns=1), _swift_rows()),
        "agent": AgentTasks(ask, _dataset(folder, chat=False), round_wait_s=0.05),
        "verifiers": resolve_task(f"verifiers:{write(folder)}", {"num_rows": 4}),
    }


def _expected_prompt(name, row, t):
    """The row's prompt as that source's own row states it (not read back from the trajectory)."""
    if name == "scheduler":
        return [dict(m) for m in row["messages"]]
    if name == "agent":  # of a text dataset: TRL's rule makes it text; the agent sent it as a message
        return row.columns["prompt"]
    if name == "verifiers":
        return [{"role": m["role"], "content": m["content"]} for m in row.columns["prompt"]]
    if name == "dataset-text":
        return row.columns["prompt"]  # TRL: a text dataset's prompt is the text
    opening = [{"role": m.role, "content": m.content} for m in row.prompt()]
    if not opening:  # textarena: the game's first word, said before the seat's first move
        first = next(i for i, m in enumerate(t.infos.messages) if m["role"] == "assistant")
        opening = [{"role": m["role"], "content": m["content"]} for m in t.infos.messages[:first]]
        assert opening and "Tic" in opening[0]["content"]  # the rules, not an empty prompt
    return opening


def _expected_columns(row):
    if isinstance(row, dict):
        return dict(row)
    if isinstance(row, HasColumns):
        return dict(row.columns)
    return {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}


def _squash(text: str) -> str:
    return "".join(text.split())


def _in_order(parts, text):
    """Every part occurs in `text`, each after the one before (whitespace aside)."""
    text, at = _squash(text), 0
    for p in parts:
        found = text.find(_squash(p), at)
        assert found >= 0, f"{p!r} not in the logged conversation {text[at:][:300]!r}"
        at = found + len(_squash(p))


@pytest.fixture(scope="module")
def rollouts(tiny, tmp_path_factory):
    _, tok = tiny
    folder = tmp_path_factory.mktemp("inputs")
    says = Says(tok.encode("4", add_special_tokens=False) + [tok.eos_token_id])
    config = RolloutConfig(num_generations=2, max_new_tokens=4, seed=3)
    rollouter = Rollouter(
        engine=says, tokenizer=tok, groups=ParallelGroups(rank=0, world_size=1), config=config
    )
    out = {}
    for name, source in _sources(folder).items():
        rollout = source.run(rollouter, source.rows(2, seed=0), 0)
        # a seat that never spoke (a game the other seat's invalid move ended) has nothing to score
        live = [
            (t, r)
            for t, r in zip(rollout.trajectories, rollout.rows)
            if t.status is not Status.FAILED and t.turns
        ]
        assert live, name
        out[name] = live
    return out


SOURCES = ["guess", "dataset-text", "dataset-chat", "reasoning-gym", "gymnasium", "textarena", "scheduler",
           "agent", "verifiers"]  # fmt: skip


def _as_messages(expected):
    """A text prompt as the one user message a transcript holds it in."""
    return [{"role": "user", "content": expected}] if isinstance(expected, str) else expected


def _check_transcript(name, t, expected, prompt, completion, tok):
    """`prompt` is the `expected` one, and it and the completion are the sample's logged
    conversation, in order."""
    assert prompt == expected, name
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    texts += [completion] if isinstance(completion, str) else [m["content"] for m in completion]
    _in_order([x for x in texts if x], tok.decode(t.token_ids))
    last = (
        completion
        if isinstance(completion, str)
        else next(m["content"] for m in reversed(completion) if m["role"] == "assistant")
    )
    assert last == t.infos.completion == "4", name


@pytest.mark.parametrize("name", SOURCES)
def test_trl_functions_get_the_rows_prompt_the_completion_and_every_column(rollouts, tiny, name):
    seen = {}

    def spy(prompts, completions, completion_ids, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, kwargs=kwargs)
        return [0.0] * len(prompts)

    pairs = rollouts[name]
    WeightedRewards([adapt(spy, what="--reward spy")]).score([t for t, _ in pairs], [r for _, r in pairs])
    for i, (t, row) in enumerate(pairs):
        expected = _expected_prompt(name, row, t)
        _check_transcript(name, t, expected, seen["prompts"][i], seen["completions"][i], tiny[1])
        assert seen["ids"][i] == tiny[1].encode("4", add_special_tokens=False) + [tiny[1].eos_token_id]
        columns = {k: v for k, v in _expected_columns(row).items() if k not in RESERVED}
        assert {k: seen["kwargs"][k][i] for k in columns} == columns, name
    assert "trainer_state" in seen["kwargs"]


@pytest.mark.parametrize("name", SOURCES)
def test_an_ms_swift_orm_gets_the_whole_conversation_as_messages(rollouts, tiny, name):
    seen = {}

    class Spy:
        def __call__(self, completions, messages, **kwargs):
            seen.update(completions=completions, messages=messages, kwargs=kwargs)
            return [0.0] * len(completions)

    pairs = rollouts[name]
    WeightedRewards([adapt(Spy, what="--reward Spy")]).score([t for t, _ in pairs], [r for _, r in pairs])
    for i, (t, row) in enumerate(pairs):
        messages = seen["messages"][i]
        expected = _as_messages(_expected_prompt(name, row, t))
        n = len(expected)
        _check_transcript(name, t, expected, messages[:n], messages[n:], tiny[1])
        assert seen["completions"][i] == "4"
        for k, v in _expected_columns(row).items():
            if k not in (*RESERVED, "messages"):
                assert seen["kwargs"][k][i] == v, (name, k)


@pytest.mark.parametrize("name", SOURCES)
def test_our_functions_read_the_same_transcript_in_infos(rollouts, tiny, name):
    for t, row in rollouts[name]:
        messages = [{"role": m["role"], "content": m["content"]} for m in t.infos.messages]
        expected = _as_messages(_expected_prompt(name, row, t))
        n = len(expected)
        assert t.infos.opening in (None, n), name
        _check_transcript(name, t, expected, messages[:n], messages[n:], tiny[1])


@pytest.fixture(scope="module")
def classifier():
    """The reward model under test, and the same folder loaded apart to score by hand."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = ensure_tiny_classifier()
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    return RewardModel(path), model, AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("name", SOURCES)
def test_a_reward_model_scores_the_whole_conversation(rollouts, classifier, name):
    """The logged score equals the classifier's own score of the conversation rendered by its
    chat template: the row's prompt, then the completion (docs/reward-models.md)."""
    reward_model, model, tok = classifier
    pairs = rollouts[name]
    scores = reward_model([t for t, _ in pairs], [r for _, r in pairs])
    assert tok.chat_template  # the documented rendering is the template's
    for (t, row), score in zip(pairs, scores, strict=True):
        prompt = _as_messages(_expected_prompt(name, row, t))
        after = [{"role": m["role"], "content": m["content"]} for m in t.infos.messages][len(prompt) :]
        text = tok.apply_chat_template([*prompt, *after], tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            alone = float(model(input_ids=ids).logits[0, -1])
        assert score == pytest.approx(alone, abs=1e-5), name


class ScriptedJudge:
    """A judge engine answering every call with one score, recording the prompts it was sent."""

    name, max_context = "judge", 4096

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []

    def generate(self, requests):
        from interlens_mcore.engines.base import Generation

        ids = self.tokenizer.encode("score: 1", add_special_tokens=False)
        self.prompts += [self.tokenizer.decode(r.prompt_ids) for r in requests]
        return [Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop") for _ in requests]


@pytest.mark.parametrize("name", SOURCES)
def test_the_judges_prompt_holds_the_question(rollouts, tiny, tiny_path, tmp_path, name):
    (tmp_path / "judge.txt").write_text("Q: {prompt}\nA: {completion}\nscore:")
    judge = Judge(tiny_path, Template.read(tmp_path / "judge.txt"))
    judge._engine = engine = ScriptedJudge(tiny[1])
    pairs = rollouts[name]
    assert judge([t for t, _ in pairs], [r for _, r in pairs]) == [1.0] * len(pairs)
    for (t, row), sent in zip(pairs, engine.prompts, strict=True):
        expected = _expected_prompt(name, row, t)
        question = expected if isinstance(expected, str) else expected[-1]["content"]
        _in_order(["Q:", question, "A:", "4"], sent)
