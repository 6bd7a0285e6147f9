"""ms-swift schedulers through compat.swift: written as ms-swift users write them (mutating
`infer_request.messages`, continuations, tool calls in the text, gym environments), run on the
tiny model or a scripted engine, checked token for token against what the engine saw."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections import Counter

import numpy as np
import pytest

from interlens_mcore.chat import ChatFormat
from interlens_mcore.compat.swift import (
    Env,
    GymScheduler,
    MultiTurnScheduler,
    SwiftTaskSource,
    envs,
    multi_turns,
    resolve_scheduler,
    rollout_trajectories,
    run,
)
from interlens_mcore.engines.base import Generation, SamplingParams
from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.rollout.multiturn import MultiTurnError, MultiTurnValueError, ToolScheduler
from interlens_mcore.types import Status

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=5)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny[1]


@pytest.fixture(scope="module")
def chat(tokenizer):
    return ChatFormat(tokenizer)


class RecordingEngine:
    """Delegates to an engine and records every row it was given and what it answered."""

    name, max_context = "recording", 4096

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[int, list[int], Generation]] = []  # (request index, prompt, answer)
        self.call_sizes: list[int] = []

    def answer(self, requests):
        return self.inner.generate(requests)

    def generate(self, requests):
        out = self.answer(requests)
        self.call_sizes.append(len(requests))
        for r, g in zip(requests, out, strict=True):
            self.calls.append((int(r.tag.split()[1]), list(r.prompt_ids), g))
        return out

    def view(self, index: int) -> list[tuple[list[int], Generation]]:
        return [(p, g) for i, p, g in self.calls if i == index]


class ScriptedEngine(RecordingEngine):
    """Answers request i's t-th call with `script(i, t)`: a text (then eos) or (text, False) (cut)."""

    def __init__(self, tokenizer, script):
        super().__init__(None)
        self.tokenizer, self.script, self.turns = tokenizer, script, Counter()

    def answer(self, requests):
        out = []
        for r in requests:
            index = int(r.tag.split()[1])
            self.turns[index] += 1
            text, stop = self.script(index, self.turns[index]), True
            if isinstance(text, tuple):
                text, stop = text
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            ids += [self.tokenizer.eos_token_id] if stop else []
            logprobs = [-0.01 * (j + 1) - 0.001 * index for j in range(len(ids))]
            out.append(
                Generation(token_ids=ids, logprobs=logprobs, finish_reason="stop" if stop else "length")
            )
        return out


def assert_engine_view(traj, calls):
    """The trajectory is, token for token, what the engine saw; every sampled id trained once."""
    ids, mask, logprobs = traj.token_ids, [0] * len(traj.token_ids), []
    for prompt, gen in calls:
        assert ids[: len(prompt)] == prompt
        start = len(prompt)
        assert ids[start : start + len(gen.token_ids)] == gen.token_ids
        mask[start : start + len(gen.token_ids)] = [1] * len(gen.token_ids)
        logprobs += gen.logprobs
    assert len(ids) == len(calls[-1][0]) + len(calls[-1][1].token_ids)  # nothing after the last reply
    assert traj.loss_mask == mask
    assert traj.logprobs_complete and traj.rollout_logprobs == pytest.approx(logprobs)


# -- schedulers written in ms-swift's style -------------------------------------------------------


class EchoToolScheduler(MultiTurnScheduler):
    """Every reply gets a tool message; runs to max_turns (no stop on 'length')."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return self.max_turns and current_turn >= self.max_turns

    def step(self, infer_request, response_choice, current_turn):
        content = f"{len(response_choice.message.content)} chars"
        infer_request.messages.append({"role": "tool", "content": content})
        return {"infer_request": infer_request}


class CalculatorScheduler(MultiTurnScheduler):
    """Runs the `<tool_call>` the model wrote in its text; a reply without one ends the request."""

    def check_finished(self, infer_request, response_choice, current_turn):
        if "<tool_call>" not in response_choice.message.content:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn):
        text = response_choice.message.content
        call = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])
        result = sum(call["arguments"].values()) if call["name"] == "add" else "unknown tool"
        infer_request.messages.append({"role": "tool", "content": str(result)})
        return {"infer_request": infer_request, "rollout_infos": {"tool_calls": current_turn}}


class TipsScheduler(MultiTurnScheduler):
    """Appends a hint to the reply and continues it (ms-swift's placeholder), once."""

    tips = " But wait, let me check."

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks = 0

    def check_finished(self, infer_request, response_choice, current_turn):
        self.checks += 1  # a side effect: counts every call
        return self.tips in infer_request.messages[-1]["content"]

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[-1]["content"] += self.tips
        infer_request.messages.append({"role": "assistant", "content": None})
        return {"infer_request": infer_request}


class TruncatingTipsScheduler(MultiTurnScheduler):
    """ms-swift's math-tips pattern: cut the reply at </think>, append the tips as ids (mask 0)."""

    tips = " But wait..."

    def check_finished(self, infer_request, response_choice, current_turn):
        return self.tips in infer_request.messages[-1]["content"]

    def step(self, infer_request, response_choice, current_turn):
        completion = response_choice.message.content
        ids = list(response_choice.token_ids)
        logprobs = self._extract_logprobs_from_choice(response_choice)
        cut = completion.index("</think>")
        keep = next(i for i in range(1, len(ids) + 1) if len(self.tokenizer.decode(ids[:i])) >= cut)
        tips_ids = self.tokenizer.encode(self.tips, add_special_tokens=False)
        infer_request.messages[-1]["content"] = completion[:cut] + self.tips
        return {
            "infer_request": infer_request,
            "response_token_ids": ids[:keep] + tips_ids,
            "response_loss_mask": [1] * keep + [0] * len(tips_ids),
            "rollout_logprobs": logprobs[:keep],
        }


class GuessEnv(Env):
    closed = 0

    async def reset(self, config):
        await asyncio.sleep(0)
        self.secret = config.data_dict["secret"]
        return "Guess my number.", {}, "You play a guessing game."

    async def step(self, action):
        await asyncio.sleep(0)
        guess = action[-1]["content"].strip()
        won = guess == str(self.secret)
        return ("higher" if guess < str(self.secret) else "lower"), float(won), won, {}

    async def close(self):
        GuessEnv.closed += 1


@pytest.fixture
def guess_env():
    """GuessEnv registered as "guess" for one test (a registration at import would reach every
    test of the session that lists the registered environments)."""
    envs["guess"] = GuessEnv
    yield GuessEnv
    envs.pop("guess", None)


def user_rows(n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"question {i}"}], "solution": str(i)} for i in range(n)
    ]


# -- token space ------------------------------------------------------------------------------------


def test_tool_scheduler_on_the_tiny_model_is_token_exact(tiny, tokenizer):
    engine = RecordingEngine(HFEngine(*tiny))
    outs = run(user_rows(2), EchoToolScheduler(max_turns=3), engine, tokenizer, SAMPLING, num_generations=2)
    assert engine.call_sizes == [4, 4, 4]  # one batched engine call per turn
    for i, out in enumerate(outs):
        assert out.num_turns == 3 and out.status is Status.STOPPED
        assert [m["role"] for m in out.messages] == ["user"] + ["assistant", "tool"] * 2 + ["assistant"]
        assert out.request.data_dict == {"solution": str(i // 2)}  # the row's other fields
        assert_engine_view(out.to_trajectory(), engine.view(i))
    again = run(
        user_rows(2), EchoToolScheduler(max_turns=3), HFEngine(*tiny), tokenizer, SAMPLING, num_generations=2
    )
    assert [o.to_trajectory().token_ids for o in again] == [o.to_trajectory().token_ids for o in outs]


def test_tool_call_in_assistant_text(tokenizer, chat):
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    engine = ScriptedEngine(tokenizer, lambda i, t: call if t == 1 else "the sum is 5")
    (out,) = run(user_rows(1), CalculatorScheduler(max_turns=4), engine, tokenizer, SAMPLING)
    assert out.messages == [
        {"role": "user", "content": "question 0"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "the sum is 5"},
    ]
    assert out.num_turns == 2 and out.rollout_infos["tool_calls"] == 1
    traj = out.to_trajectory()
    assert_engine_view(traj, engine.view(0))
    (_, first), (_, second) = engine.view(0)
    # each message rendered once: the reply as sampled, the template's tail, the tool message, an opener
    expected = chat.message_ids("user", "question 0") + chat.generation_prompt_ids() + first.token_ids
    expected += chat.close_ids("stop") + chat.message_ids("tool", "5") + chat.generation_prompt_ids()
    assert traj.token_ids == expected + second.token_ids


def test_continuation_with_placeholder_extends_the_reply(tokenizer, chat):
    engine = ScriptedEngine(tokenizer, lambda i, t: ("I think 4.", False) if t == 1 else (" It is 4.", False))
    scheduler = TipsScheduler(max_turns=5)
    (out,) = run(user_rows(1), scheduler, engine, tokenizer, SAMPLING)
    assert out.messages[1:] == [
        {"role": "assistant", "content": "I think 4." + TipsScheduler.tips + " It is 4."}
    ]
    assert out.num_turns == 2 and len(out.response_token_ids) == 1  # one assistant turn, two engine calls
    (p1, g1), (p2, g2) = engine.view(0)
    tips = chat.encode(TipsScheduler.tips)
    assert p2 == p1 + g1.token_ids + tips  # the appended text, encoded once; nothing re-tokenized
    traj = out.to_trajectory()
    assert traj.token_ids == p2 + g2.token_ids
    assert traj.loss_mask == [0] * len(p1) + [1] * len(g1.token_ids) + [0] * len(tips) + [1] * len(
        g2.token_ids
    )
    assert traj.rollout_logprobs == pytest.approx(g1.logprobs + g2.logprobs)
    assert scheduler.checks == 2  # check_finished ran once per turn


def test_truncated_reply_with_tips_ids(tokenizer):
    script = lambda i, t: "<think>2+2=4</think><answer>4</answer>" if t == 1 else " so 4</think>"
    engine = ScriptedEngine(tokenizer, script)
    (out,) = run(
        user_rows(1), TruncatingTipsScheduler(max_turns=3, tokenizer=tokenizer), engine, tokenizer, SAMPLING
    )
    (p1, g1), (p2, g2) = engine.view(0)
    tips = tokenizer.encode(TruncatingTipsScheduler.tips, add_special_tokens=False)
    keep = len(p2) - len(p1) - len(tips)
    assert 0 < keep < len(g1.token_ids) and p2[len(p1) :] == g1.token_ids[:keep] + tips
    traj = out.to_trajectory()
    assert traj.token_ids == p2 + g2.token_ids
    assert traj.loss_mask == [0] * len(p1) + [1] * keep + [0] * len(tips) + [1] * len(g2.token_ids)
    assert traj.rollout_logprobs == pytest.approx(g1.logprobs[:keep] + g2.logprobs)
    assert out.messages[-1]["content"].startswith("<think>2+2=4" + TruncatingTipsScheduler.tips)


def test_prompt_ending_in_an_assistant_prefill_is_continued(tokenizer, chat):
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]}
    engine = ScriptedEngine(tokenizer, lambda i, t: " 4")
    (out,) = run([row], EchoToolScheduler(max_turns=1), engine, tokenizer, SAMPLING)
    ((prompt, gen),) = engine.view(0)
    assert prompt == chat.message_ids("user", "q") + chat.generation_prompt_ids() + chat.encode(
        "The answer is"
    )
    assert out.messages[1:] == [
        {"role": "assistant", "content": "The answer is 4"}
    ]  # one message, one opener
    # ms-swift's placeholder at the end of a row is dropped: an ordinary first turn
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}
    engine = ScriptedEngine(tokenizer, lambda i, t: "4")
    run([row], EchoToolScheduler(max_turns=1), engine, tokenizer, SAMPLING)
    assert engine.view(0)[0][0] == chat.message_ids("user", "q") + chat.generation_prompt_ids()


def test_rewriting_history_fails_only_that_request(tokenizer):
    class Rewriter(EchoToolScheduler):
        def step(self, infer_request, response_choice, current_turn):
            if infer_request.uuid.endswith("-0"):
                infer_request.messages[0]["content"] = "a different question"
            return super().step(infer_request, response_choice, current_turn)

    engine = ScriptedEngine(tokenizer, lambda i, t: "hello")
    with pytest.raises(MultiTurnValueError, match="HistoryRewriteError: request 5-0"):  # the default
        run(user_rows(2), Rewriter(max_turns=3), engine, tokenizer, SAMPLING, seed=5)
    engine = ScriptedEngine(tokenizer, lambda i, t: "hello")
    bad, good = run(
        user_rows(2), Rewriter(max_turns=3), engine, tokenizer, SAMPLING, seed=5, on_sample_error="skip"
    )
    assert good.status is Status.STOPPED and good.num_turns == 3
    assert_engine_view(good.to_trajectory(), engine.view(1))
    assert bad.status is Status.FAILED
    reason = bad.to_trajectory().infos.stop_reason
    assert reason.startswith("scheduler: HistoryRewriteError: request 5-0 (index 0, turn 1): step()")
    assert "messages[0] (user: 'question 0'" in reason
    assert sum(bad.to_trajectory().loss_mask) == 0  # a failed sample trains nothing
    assert len(engine.view(0)) == 2  # it ended at the next round: no hook or step saw it again


# -- ms-swift's meaning where the native API differs -------------------------------------------------


def test_done_none_is_not_done_and_numpy_bools_count(tokenizer):
    class Hooked(MultiTurnScheduler):
        async def on_turn_end(self, infer_request, response_choice, current_turn):
            return {"done": np.bool_(True) if current_turn == 3 else None}

        def check_finished(self, infer_request, response_choice, current_turn):
            return True  # overridden by the hook's `done` every turn

        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages.append({"role": "user", "content": "go on"})
            return {"infer_request": infer_request}

    engine = ScriptedEngine(tokenizer, lambda i, t: f"turn {t}")
    (out,) = run(user_rows(1), Hooked(max_turns=10), engine, tokenizer, SAMPLING)
    assert out.num_turns == 3 and out.status is Status.STOPPED


def test_max_turns_zero_is_unlimited_and_the_cap_reports_max_turns(tokenizer):
    class Four(EchoToolScheduler):
        def check_finished(self, infer_request, response_choice, current_turn):
            return current_turn >= 4

    engine = ScriptedEngine(tokenizer, lambda i, t: "x")
    (out,) = run(user_rows(1), Four(max_turns=0), engine, tokenizer, SAMPLING)
    assert out.num_turns == 4 and out.status is Status.STOPPED
    (out,) = run(user_rows(1), Four(max_turns=0), engine, tokenizer, SAMPLING, max_turns=2)
    assert out.num_turns == 2 and out.status is Status.MAX_TURNS


def test_check_finished_runs_after_every_hook_in_request_order(tokenizer):
    events = []

    class Ordered(MultiTurnScheduler):
        async def on_turn_end(self, infer_request, response_choice, current_turn):
            await asyncio.sleep(0.01 * (3 - int(infer_request.uuid[-1])))  # later requests return first
            events.append(("hook", infer_request.uuid[-1], current_turn))
            return {"done": False} if infer_request.uuid.endswith("0") else {}

        def check_finished(self, infer_request, response_choice, current_turn):
            events.append(("check", infer_request.uuid[-1], current_turn))
            return True  # request 0's hook says not done: only it goes on

        def step(self, infer_request, response_choice, current_turn):
            events.append(("step", infer_request.uuid[-1], current_turn))
            infer_request.messages.append({"role": "user", "content": "again"})
            return {"infer_request": infer_request}

    engine = ScriptedEngine(tokenizer, lambda i, t: "y")
    outs = run(user_rows(3), Ordered(max_turns=2), engine, tokenizer, SAMPLING)
    assert [o.num_turns for o in outs] == [2, 1, 1]
    turn1 = [e for e in events if e[2] == 1]
    assert turn1 == [("hook", "2", 1), ("hook", "1", 1), ("hook", "0", 1)] + [
        ("check", "0", 1), ("check", "1", 1), ("check", "2", 1), ("step", "0", 1)
    ]  # fmt: skip
    assert [e for e in events if e[2] == 2] == [("hook", "0", 2), ("check", "0", 2)]


def test_empty_step_logprobs_fall_back_to_the_engines(tokenizer):
    class Empty(EchoToolScheduler):
        def step(self, infer_request, response_choice, current_turn):
            result = super().step(infer_request, response_choice, current_turn)
            return {**result, "rollout_logprobs": [] if current_turn == 1 else None}

    engine = ScriptedEngine(tokenizer, lambda i, t: "abc")
    (out,) = run(user_rows(1), Empty(max_turns=3), engine, tokenizer, SAMPLING)
    assert_engine_view(out.to_trajectory(), engine.view(0))


def test_a_turn_that_trains_nothing_keeps_importance_sampling_on(tokenizer):
    class MaskFirst(EchoToolScheduler):
        def step(self, infer_request, response_choice, current_turn):
            result = super().step(infer_request, response_choice, current_turn)
            mask = [0] * len(response_choice.token_ids)
            return {**result, "response_token_ids": response_choice.token_ids, "response_loss_mask": mask}

    engine = ScriptedEngine(tokenizer, lambda i, t: "abc")
    (out,) = run(user_rows(1), MaskFirst(max_turns=2), engine, tokenizer, SAMPLING)
    traj = out.to_trajectory()
    (_, g1), (_, g2) = engine.view(0)
    assert traj.logprobs_complete and traj.rollout_logprobs == pytest.approx(g2.logprobs)
    assert sum(traj.loss_mask) == len(g2.token_ids)


def test_last_round_trains_only_the_last_turn(tokenizer):
    engine = ScriptedEngine(tokenizer, lambda i, t: f"reply {t}")
    (out,) = run(
        user_rows(1), EchoToolScheduler(max_turns=3), engine, tokenizer, SAMPLING, train_turns="last_round"
    )
    traj = out.to_trajectory()
    prompt, last = engine.view(0)[-1]
    assert traj.loss_mask == [0] * len(prompt) + [1] * len(last.token_ids)
    assert traj.logprobs_complete and traj.rollout_logprobs == pytest.approx(last.logprobs)
    assert [t.trained for t in traj.turns] == [False, False, True]


def test_final_turn_shaped_by_on_turn_end(tokenizer):
    class CutLast(EchoToolScheduler):
        async def on_turn_end(self, infer_request, response_choice, current_turn):
            if current_turn < 2:
                return {}
            ids = response_choice.token_ids[:2]
            return {
                "done": True,
                "response_token_ids": ids,
                "rollout_logprobs": self._extract_logprobs_from_choice(response_choice)[:2],
            }  # noqa: E501

    engine = ScriptedEngine(tokenizer, lambda i, t: "abcdef ghij")
    (out,) = run(user_rows(1), CutLast(max_turns=5), engine, tokenizer, SAMPLING)
    (p2, g2) = engine.view(0)[-1]
    traj = out.to_trajectory()
    assert traj.token_ids == p2 + g2.token_ids[:2]
    assert traj.logprobs_complete and traj.rollout_logprobs[-2:] == pytest.approx(g2.logprobs[:2])
    assert traj.turns[-1].end == len(traj.token_ids)

    class BadLast(EchoToolScheduler):
        async def on_turn_end(self, infer_request, response_choice, current_turn):
            return {"done": True, "response_token_ids": [10**6]}

    with pytest.raises(MultiTurnValueError, match=r"request 0-0 \(index 0, turn 1\): on_turn_end .*outside"):
        run(user_rows(1), BadLast(max_turns=5), engine, tokenizer, SAMPLING)


def test_scheduler_errors_keep_their_type(tokenizer):
    seen = []

    class Slow(EchoToolScheduler):
        def step(self, infer_request, response_choice, current_turn):
            raise TimeoutError("the tool server did not answer")

        async def on_trajectory_end(self, requests, error=None):
            seen.append(error)

    engine = ScriptedEngine(tokenizer, lambda i, t: "x")
    with pytest.raises(TimeoutError, match="did not answer") as info:
        run(user_rows(2), Slow(max_turns=3), engine, tokenizer, SAMPLING, seed=1)
    notes = "\n".join(info.value.__notes__)
    assert "Slow.step for request 1-0 (index 0, turn 1)" in notes and "failed on every rank" in notes
    assert seen == [info.value]  # on_trajectory_end ran, and saw the error

    class NoSolution(EchoToolScheduler):
        def check_finished(self, infer_request, response_choice, current_turn):
            return infer_request.data_dict["solution"] in response_choice.message.content

    with pytest.raises(KeyError) as info:
        run([{"messages": [{"role": "user", "content": "q"}]}], NoSolution(), engine, tokenizer, SAMPLING)
    assert "NoSolution.check_finished for request 0-0" in "\n".join(info.value.__notes__)


def test_bad_step_result_is_a_value_error_naming_the_request(tokenizer):
    class Typo(EchoToolScheduler):
        def step(self, infer_request, response_choice, current_turn):
            return {"infer_request": infer_request, "rollout_info": {}}

    engine = ScriptedEngine(tokenizer, lambda i, t: "x")
    with pytest.raises(MultiTurnValueError, match=r"request 0-0 .*unknown key\(s\) \['rollout_info'\]"):
        run(user_rows(1), Typo(max_turns=2), engine, tokenizer, SAMPLING)


# -- gym environments and the training path -----------------------------------------------------------


def test_gym_scheduler_resets_environments_before_turn_one(tokenizer, chat, guess_env):
    GuessEnv.closed = 0
    rows = [{"env_config": {"name": "guess"}, "secret": 7}, {"env_config": {"name": "guess"}, "secret": 9}]
    engine = ScriptedEngine(tokenizer, lambda i, t: "3" if t == 1 else "7")
    trajectories = rollout_trajectories(
        GymScheduler(max_turns=3), rows, num_generations=1, engine=engine, tokenizer=tokenizer,
        sampling=SAMPLING, seed=0, reward_key="total_reward",
    )  # fmt: skip
    system, observation = "You play a guessing game.", "Guess my number."
    opening = chat.message_ids("system", system) + chat.message_ids("user", observation)
    assert engine.view(0)[0][0] == opening + chat.generation_prompt_ids()  # the awaited reset's observation
    won, lost = trajectories
    assert [m["content"] for m in won.infos["messages"]] == [system, observation, "3", "higher", "7"]
    assert won.infos["env_reward"] == 1.0 and won.infos["step_rewards"] == [0.0, 1.0]
    assert won.infos["gym_done"] and won.status is Status.STOPPED and won.infos.turns == 2
    assert lost.infos["env_reward"] == 0.0 and lost.status is Status.MAX_TURNS and lost.infos.turns == 3
    assert GuessEnv.closed == 2  # one when its episode ended, one at on_trajectory_end
    for i, traj in enumerate(trajectories):
        assert_engine_view(traj, engine.view(i))


def test_task_source_rows_reach_the_scheduler_as_data_dict(tiny, tokenizer):
    class Judge(EchoToolScheduler):
        async def on_turn_end(self, infer_request, response_choice, current_turn):
            solved = infer_request.data_dict["solution"] in response_choice.message.content
            return {
                "rollout_infos": {"reward": float(solved), "solution": infer_request.data_dict["solution"]}
            }

    dataset = user_rows(6)
    task = SwiftTaskSource(Judge(max_turns=2), dataset, reward_key="reward")
    rows = task.rows(3, seed=4)
    assert rows == task.rows(3, seed=4) and rows != task.rows(3, seed=5)
    assert len({r["solution"] for r in rows}) == 3 and all(r in dataset for r in rows)
    trajectories = task.rollout(rows, num_generations=2, engine=HFEngine(*tiny), tokenizer=tokenizer,
                                sampling=SAMPLING, seed=11)  # fmt: skip
    assert [t.group for t in trajectories] == [0, 0, 1, 1, 2, 2]
    for t in trajectories:
        assert t.infos["solution"] == rows[t.group]["solution"] and t.infos["env_reward"] in (0.0, 1.0)
        assert t.logprobs_complete and math.isfinite(sum(t.rollout_logprobs))


PLUGIN = """
from interlens_mcore.compat.swift import MultiTurnScheduler


class CountdownScheduler(MultiTurnScheduler):
    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= int(infer_request.data_dict["turns"])

    def step(self, infer_request, response_choice, current_turn):
        left = int(infer_request.data_dict["turns"]) - current_turn
        infer_request.messages.append({"role": "user", "content": f"{left} to go"})
        return {"infer_request": infer_request, "rollout_infos": {"reward": float(left)}}
"""


def test_plugin_file_with_one_changed_import(tmp_path, tokenizer):
    path = tmp_path / "swift_plugin_countdown.py"
    path.write_text(PLUGIN)
    rows = [{"messages": [{"role": "user", "content": "count"}], "turns": 3}]
    task = SwiftTaskSource.from_spec(
        "swift_plugin_countdown:CountdownScheduler", plugins=[path], dataset=rows
    )
    engine = ScriptedEngine(tokenizer, lambda i, t: f"{t}")
    trajectories = task.rollout(task.rows(1, seed=0), num_generations=1, engine=engine, tokenizer=tokenizer,
                                sampling=SAMPLING, seed=0)  # fmt: skip
    assert trajectories[0].infos.turns == 3 and trajectories[0].infos["env_reward"] == 1.0
    assert task.describe()["scheduler"] == "CountdownScheduler"
    with pytest.raises(ValueError, match="has no 'Nope'"):
        SwiftTaskSource.from_spec("swift_plugin_countdown:Nope", dataset=rows)
    # a name registered as ms-swift plugins register theirs; a native scheduler resolves, for run_multi_turn
    multi_turns["countdown"] = sys.modules["swift_plugin_countdown"].CountdownScheduler
    assert (
        SwiftTaskSource.from_spec("countdown", dataset=rows).describe()["scheduler"] == "CountdownScheduler"
    )
    assert resolve_scheduler("interlens_mcore:ToolScheduler") is ToolScheduler
    with pytest.raises(ValueError, match="ToolScheduler is a native scheduler"):
        SwiftTaskSource.from_spec("interlens_mcore:ToolScheduler", dataset=rows)


def test_missing_reward_is_reported_by_the_reward_function(tokenizer):
    from interlens_mcore.grpo.rewards import RewardError, environment_reward

    engine = ScriptedEngine(tokenizer, lambda i, t: "x")
    trajectories = rollout_trajectories(
        EchoToolScheduler(max_turns=1), user_rows(1), num_generations=1, engine=engine, tokenizer=tokenizer,
        sampling=SAMPLING, seed=0, reward_key="total_reward",
    )  # fmt: skip
    with pytest.raises(RewardError, match="scheduler set no reward"):
        environment_reward(trajectories, user_rows(1))


def test_on_trajectory_start_failure_ends_before_the_engine(tokenizer):
    class Broken(EchoToolScheduler):
        async def on_trajectory_start(self, requests):
            raise ConnectionError("environment server down")

    engine = ScriptedEngine(tokenizer, lambda i, t: "x")
    with pytest.raises(ConnectionError, match="server down"):
        run(user_rows(1), Broken(max_turns=2), engine, tokenizer, SAMPLING)
    assert engine.calls == []
    with pytest.raises(MultiTurnError):  # not a scheduler's own error: the group's failure
        run([{"solution": "1"}], EchoToolScheduler(max_turns=2), engine, tokenizer, SAMPLING)


def test_step_time_limit_ends_only_the_slow_request(tokenizer):
    class SlowHook(EchoToolScheduler):
        async def on_turn_end(self, infer_request, response_choice, current_turn):
            if infer_request.uuid.endswith("-1") and current_turn == 2:
                await asyncio.sleep(30)  # cancelled at the limit
            return {}

    engine = ScriptedEngine(tokenizer, lambda i, t: "z")
    fast, slow = run(user_rows(2), SlowHook(max_turns=3), engine, tokenizer, SAMPLING, step_timeout_s=0.5)
    assert fast.status is Status.STOPPED and fast.num_turns == 3
    assert slow.status is Status.TIMEOUT and slow.num_turns == 2
    assert "on_turn_end exceeded 0.5 s at turn 2" in slow.rollout_infos["timeout"]
    assert_engine_view(slow.to_trajectory(), engine.view(1))


def test_done_given_as_text_is_rejected(tokenizer):
    class Texty(EchoToolScheduler):
        async def on_turn_end(self, infer_request, response_choice, current_turn):
            return {"done": "False"}  # truthy in ms-swift: a bug there, an error here

    engine = ScriptedEngine(tokenizer, lambda i, t: "z")
    with pytest.raises(MultiTurnValueError, match="'done' must be a bool or None, got 'False'"):
        run(user_rows(1), Texty(max_turns=3), engine, tokenizer, SAMPLING)


def test_a_rank_with_no_rows_still_joins_the_engine_call(tokenizer):
    engine = ScriptedEngine(tokenizer, lambda i, t: "z")
    assert run([], EchoToolScheduler(max_turns=2), engine, tokenizer, SAMPLING) == []
    assert engine.call_sizes == [0]  # the first turn's call is collective: an idle rank takes part
