"""The three reward-function conventions: detected from the signature, called with their arguments."""

from __future__ import annotations

import asyncio

import pytest
from support.reward_samples import row, sample

from interlens_mcore.grpo.rewards import WeightedRewards, environment_reward
from interlens_mcore.rewards import Convention, adapt, convention_of, named
from interlens_mcore.rollout.rollouter import RolloutConfig, rollout_advantages


def ours(trajectories, rows):
    return [1.0 for _ in trajectories]


def trl_style(prompts, completions, completion_ids, **kwargs):
    return [0.0 for _ in completions]


class SwiftStyle:
    def __call__(self, completions, **kwargs):
        return [0.0 for _ in completions]


def test_the_convention_is_read_from_the_signature():
    from trl.rewards import get_soft_overlong_punishment

    assert convention_of(ours, what="--reward") is Convention.OURS
    assert convention_of(trl_style, what="--reward") is Convention.TRL
    assert convention_of(lambda completions, solution: [], what="--reward") is Convention.TRL
    # a TRL callable object whose only named parameter is completion_ids
    assert convention_of(get_soft_overlong_punishment(8, 2), what="--reward") is Convention.TRL
    assert convention_of(SwiftStyle, what="--reward") is Convention.ORM
    with pytest.raises(ValueError, match=r"--reward m:f: one takes \(x\); expected fn\(trajectories, rows\)"):

        def one(x):
            return [x]

        convention_of(one, what="--reward m:f")


def test_trl_functions_get_prompts_completions_ids_every_column_and_the_trainer_state():
    seen = {}

    def spy(prompts, completions, completion_ids, solution, trainer_state, log_extra, log_metric, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, solution=solution)
        seen.update(step=trainer_state.global_step, max_steps=trainer_state.max_steps, kwargs=kwargs)
        log_extra("checked", ["yes", "no"])
        log_metric("calls", 1.0)
        return [0.5, 0.25]

    rewards = WeightedRewards([adapt(spy, what="--reward m:spy")])
    rewards.state.max_steps = 10
    ts = [sample("a", ids=[5, 6]), sample("b")]
    totals, parts = rewards.score(ts, [row("1", level=3), row("2", level=4)], step=7)
    assert totals == [0.5, 0.25] and parts == {"spy": [0.5, 0.25]}
    assert seen["prompts"][0] == [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "What is 1/2 + 1/2?"},
    ]
    assert seen["completions"] == [
        [{"role": "assistant", "content": "a"}],
        [{"role": "assistant", "content": "b"}],
    ]
    assert seen["ids"] == [[5, 6], [7, 8, 9, 10]] and seen["solution"] == ["1", "2"]
    assert seen["kwargs"] == {"level": [3, 4]}  # the prompt column is `prompts`, as TRL drops it
    assert (seen["step"], seen["max_steps"]) == (7, 10)
    assert [t.infos.extra["checked"] for t in ts] == ["yes", "no"]
    assert rewards.take_metrics() == {"calls": [1.0]} and rewards.take_metrics() == {}


def test_a_text_prompt_gives_text_prompts_and_completions():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [1.0]

    adapt(spy, what="--reward")([sample("the answer")], [row(text=True)])
    assert seen == {"prompts": ["What is 1/2 + 1/2?"], "completions": ["the answer"]}


def test_an_async_reward_function_is_awaited():
    async def judge(completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(c[0]["content"])) for c in completions]

    assert WeightedRewards([adapt(judge, what="--reward")])([sample("abc")], [row()]) == [3.0]


def test_none_is_skipped_in_the_sum_and_a_sample_no_function_scores_is_left_out():
    def only_first(completions, **kwargs):
        return [1.0, None, None, None]

    def only_second(completions, **kwargs):
        return [None, 2.0, None, None]

    ts = [sample(c) for c in "wxyz"]
    for t in ts:
        t.group = 0
    rewards = WeightedRewards([adapt(only_first, what="a"), adapt(only_second, what="b")], [1.0, 0.5])
    totals, parts = rewards.score(ts, [row()] * 4)
    assert totals == [1.0, 1.0, 0.0, 0.0] and parts["only_second"] == [None, 2.0, None, None]
    assert [t.infos.unscored for t in ts] == [False, False, True, True]
    for t, r in zip(ts, totals):
        t.reward = r
    adv, keep = rollout_advantages(ts, RolloutConfig(num_generations=4))
    # the unscored two neither train nor move the baseline: the scored two have mean 1.0
    assert keep.tolist() == [True, True, False, False] and adv.tolist()[2:] == [0.0, 0.0]


def test_an_orm_class_is_built_with_no_arguments_and_called_as_ms_swift_calls_it():
    seen = {}

    class MyORM:
        def __call__(self, completions, solution, messages, response_token_ids, **kwargs):
            seen.update(completions=completions, solution=solution, last=messages[0][-1])
            seen.update(ids=response_token_ids, step=kwargs["trainer_state"].global_step)
            return [float(c == s) for c, s in zip(completions, solution)]

    fn = adapt(MyORM, what="--reward plug:MyORM")
    assert WeightedRewards([fn]).score([sample("1"), sample("3")], [row("1"), row("2")], step=2)[0] == [
        1.0,
        0.0,
    ]
    assert seen == {
        "completions": ["1", "3"],
        "solution": ["1", "2"],
        "last": {"role": "assistant", "content": "1"},
        "ids": [[7, 8, 9, 10], [7, 8, 9, 10]],
        "step": 2,
    }

    class NeedsArgs:
        def __init__(self, threshold):
            self.threshold = threshold

        def __call__(self, completions, **kwargs):
            return []

    with pytest.raises(ValueError, match="--reward p:NeedsArgs: the ORM class NeedsArgs cannot be built"):
        adapt(NeedsArgs, what="--reward p:NeedsArgs")


PLUGIN = """
class Shorter:
    def __call__(self, completions, **kwargs):
        return [1.0 if len(c) < 3 else 0.0 for c in completions]


class MyAccuracy:  # overrides the built-in of the same name, as in ms-swift
    def __call__(self, completions, **kwargs):
        return [0.25 for _ in completions]


orms = {"shorter": Shorter, "accuracy": MyAccuracy}
"""


def test_reward_funcs_names_come_from_the_plugins_orms_then_the_built_ins(tmp_path):
    plugin = tmp_path / "rewards_plugin_conv.py"
    plugin.write_text(PLUGIN)
    fns = named(["shorter", "accuracy", "format"], [str(plugin)], max_new_tokens=16)
    rewards = WeightedRewards([environment_reward, *fns])
    ts = [sample("ab"), sample("<think>x</think><answer>1</answer>")]
    for t in ts:
        t.infos.env_reward = 0.0
    totals, parts = rewards.score(ts, [row(), row()])
    assert parts == {"env": [0.0, 0.0], "shorter": [1.0, 0.0], "accuracy": [0.25, 0.25], "format": [0.0, 1.0]}
    assert rewards.names == ["env", "shorter", "accuracy", "format"]
    with pytest.raises(
        ValueError,
        match=r"--reward-funcs nope: no such reward; built-in: accuracy, format.*"
        r"from --external-plugins: accuracy, shorter",
    ):
        named(["nope"], [str(plugin)], max_new_tokens=16)


def test_trls_own_reward_functions_run_unchanged():
    from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward

    fns = [adapt(f, what="--reward") for f in (accuracy_reward, think_format_reward)]
    fns.append(
        adapt(get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2), what="--reward")
    )
    ts = [sample(r"<think>ok</think> \boxed{1}", ids=[1, 2]), sample(r"\boxed{2}", ids=[1, 2, 3])]
    totals, parts = WeightedRewards(fns).score(ts, [row("$1$"), row("$1$")])
    assert parts == {
        "accuracy_reward": [1.0, 0.0],
        "think_format_reward": [1.0, 0.0],
        "soft_overlong_punishment_reward": [0.0, -0.5],
    }


def test_a_reasoning_gym_row_gives_its_entry_fields_and_conversational_completions():
    from interlens_mcore.tasks.reasoning_gym import ReasoningOptions, ReasoningTask

    seen = {}

    def spy(completions, question, answer, metadata, **kwargs):
        seen.update(completions=completions, question=question, answer=answer, metadata=metadata)
        return [1.0]

    task = ReasoningTask(
        entry={"question": "2 + 2?", "answer": "4", "metadata": {"level": 1}},
        score=lambda said, entry: 0.0,
        options=ReasoningOptions(),
    )
    adapt(spy, what="--reward")([sample("4")], [task])
    assert seen == {
        "completions": [[{"role": "assistant", "content": "4"}]],
        "question": ["2 + 2?"],
        "answer": ["4"],
        "metadata": [{"level": 1}],
    }
