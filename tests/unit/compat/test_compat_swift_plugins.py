"""What ms-swift's own rollout files import and how they are found: the names compat.swift
exports with ms-swift's meaning, plugin files loaded as packages (relative imports), schedulers
and environments by registry name, and classes on ms-swift's own base classes driven by hooks."""

from __future__ import annotations

import sys
import textwrap

import pytest

from interlens_mcore.compat import swift
from interlens_mcore.compat.swift import (
    MathAccuracy,
    SwiftTaskSource,
    get_token_backed_response_ids,
    load_plugins,
    remove_response,
    resolve_gym_env,
    resolve_scheduler,
)
from interlens_mcore.engines.base import Generation, SamplingParams
from interlens_mcore.types import Status

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=5)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny[1]


class Scripted:
    """Answers every request with `text`, then the end-of-turn token."""

    name, max_context = "scripted", 4096

    def __init__(self, tokenizer, text):
        self.tokenizer, self.text = tokenizer, text

    def generate(self, requests):
        ids = self.tokenizer.encode(self.text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return [Generation(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop") for _ in requests]


def test_every_name_ms_swift_rollout_files_import_is_exported():
    for name in ("ChatCompletionResponse", "ChatCompletionResponseChoice", "RequestConfig",
                 "RolloutInferRequest", "RolloutOutput", "Messages", "get_token_backed_response_ids",
                 "remove_response", "get_logger", "MathAccuracy", "Env", "envs"):  # fmt: skip
        assert name in swift.__all__ and getattr(swift, name) is not None
    assert swift.RequestConfig().n == 1
    assert swift.get_logger() is swift.get_logger()


def test_token_backed_response_ids_as_ms_swift_reads_them():
    assert get_token_backed_response_ids([3, 4]) == [3, 4]
    assert get_token_backed_response_ids({"token_ids": [5]}) == [5]
    assert get_token_backed_response_ids({"input_ids": [6, 7]}) == [6, 7]
    assert get_token_backed_response_ids([]) == []
    assert get_token_backed_response_ids("text") is None
    assert get_token_backed_response_ids([{"type": "text"}]) is None
    assert get_token_backed_response_ids({"token_ids": "no"}) is None


def test_remove_response_pops_only_an_assistant_reply():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert remove_response(messages) == "a" and messages == [{"role": "user", "content": "q"}]
    assert remove_response(messages) is None and len(messages) == 1


def test_math_accuracy_compares_answers_as_math():
    acc = MathAccuracy()
    got = acc(["<answer>0.5</answer>", "\\boxed{\\frac{1}{2}}", "<answer>3</answer>", "no idea"],
              ["1/2", "$0.5$", "<answer>2</answer>", "2"])  # fmt: skip
    assert got == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 completions for 1 solutions"):
        acc(["1", "2"], ["1"])


def test_an_orm_written_for_ms_swift_registers_in_orms_and_runs_by_name(tmp_path):
    from interlens_mcore.rewards import named

    (tmp_path / "swift_orm_plugin.py").write_text(
        textwrap.dedent("""
        # was: from swift.rewards import ORM, orms
        from interlens_mcore.compat.swift import ORM, orms

        class Shouting(ORM):
            def __call__(self, completions, **kwargs):
                return [float(c.isupper()) for c in completions]

        orms["shouting"] = Shouting
    """)
    )
    try:
        (fn,) = named(["shouting"], [str(tmp_path / "swift_orm_plugin.py")], max_new_tokens=8)
        assert swift.orms["shouting"].__name__ == "Shouting"
        assert fn.name == "shouting"
    finally:
        swift.orms.pop("shouting", None)


def test_a_plugin_file_imports_its_neighbours_relatively(tmp_path):
    (tmp_path / "helper.py").write_text("TIP = 'look again'\n")
    (tmp_path / "rel_plugin.py").write_text(textwrap.dedent("""
        from .helper import TIP
        from interlens_mcore.compat.swift import MultiTurnScheduler

        class TipOnce(MultiTurnScheduler):
            def check_finished(self, infer_request, response_choice, current_turn):
                return current_turn >= 2

            def step(self, infer_request, response_choice, current_turn):
                infer_request.messages.append({"role": "user", "content": TIP})
                return {"infer_request": infer_request}

        multi_turns = {"tip_once": TipOnce}
    """))  # fmt: skip
    (name,) = load_plugins([tmp_path / "rel_plugin.py"])
    assert name.endswith(".rel_plugin") and sys.modules["rel_plugin"] is sys.modules[name]
    assert load_plugins([tmp_path / "rel_plugin.py"]) == [name]  # loaded once
    # by the plugin file's own multi_turns, and as MODULE:CLASS by the file's stem
    assert resolve_scheduler("tip_once") is resolve_scheduler("rel_plugin:TipOnce")


def test_unknown_names_list_the_known_ones(tmp_path):
    (tmp_path / "named.py").write_text("class A:\n    pass\n\nmulti_turns = {'a_sched': A}\nenvs = {}\n")
    load_plugins([tmp_path / "named.py"])
    with pytest.raises(ValueError, match=r"--multi-turn-scheduler 'nope': no scheduler of that name "
                       r"\(registered: .*a_sched"):  # fmt: skip
        resolve_scheduler("nope")
    with pytest.raises(ValueError, match="'a_sched' is .*not a scheduler class"):
        resolve_scheduler("a_sched")
    with pytest.raises(ValueError, match=r"--gym-env 'nope': no environment of that name \(registered: "):
        resolve_gym_env("nope")


# ms-swift's own pattern: base classes of the file's own, a run() loop of ms-swift's engine, a
# registry of its own, environments looked up in its own envs dict
OWN_BASES = """
import asyncio

envs = {}


class OwnBase:
    def __init__(self, infer_engine=None, max_turns=None, *args, **kwargs):
        self.infer_engine, self.max_turns = infer_engine, max_turns
        self._tokenizer = kwargs.get("tokenizer")
        self.gym_env_name = kwargs.get("gym_env")

    @property
    def tokenizer(self):
        return self._tokenizer

    async def run(self, infer_request, request_config, **kwargs):
        raise AssertionError("ms-swift's own loop is never called here")

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        return {}

    def check_finished(self, infer_request, response_choice, current_turn):
        return self.max_turns and current_turn >= self.max_turns


class EnvTurns(OwnBase):
    async def on_trajectory_start(self, requests):
        for r in requests:
            r.messages = [{"role": "user", "content": envs[self.gym_env_name]().question}]

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": str(len(self.tokenizer))})
        return {"infer_request": infer_request}


class EmptyReplyRewrites(OwnBase):
    # MathTipsScheduler's step on an empty reply: it pops the reply and rewrites the question
    def step(self, infer_request, response_choice, current_turn):
        if not response_choice.message.content:
            infer_request.messages.pop(-1)
        infer_request.messages[-1]["content"] += " But wait..."
        return {"infer_request": infer_request}


multi_turns = {"env_turns": EnvTurns, "empty_reply": EmptyReplyRewrites}
"""

ENV_PLUGIN = """
class Question:
    question = "how many tokens?"

envs = {"question_env": Question}
"""


def test_a_scheduler_on_its_own_base_classes_runs_by_its_hooks(tmp_path, tokenizer):
    (tmp_path / "own_bases.py").write_text(OWN_BASES)
    (tmp_path / "env_plugin.py").write_text(ENV_PLUGIN)
    files = [tmp_path / "own_bases.py", tmp_path / "env_plugin.py"]
    rows = [{"messages": [{"role": "user", "content": "unused"}]}]
    task = SwiftTaskSource.from_spec(
        "env_turns", plugins=files, dataset=rows, max_turns=3, gym_env="question_env",
        scheduler_kwargs={"tokenizer": tokenizer},
    )  # fmt: skip
    assert task.describe()["scheduler"] == "EnvTurns"
    # the environment the flag named is in the scheduler file's own registry too
    assert sys.modules["own_bases"].envs["question_env"] is sys.modules["env_plugin"].Question
    engine = Scripted(tokenizer, "a reply")
    (traj,) = task.rollout(rows, num_generations=1, engine=engine, tokenizer=tokenizer,
                           sampling=SAMPLING, seed=0)  # fmt: skip
    assert traj.infos.turns == 3 and traj.status is Status.STOPPED
    text = tokenizer.decode(traj.token_ids)
    assert "how many tokens?" in text and text.count(str(len(tokenizer))) == 2


def test_an_empty_reply_that_rewrites_the_question_fails_only_its_request(tmp_path, tokenizer):
    (tmp_path / "own_bases2.py").write_text(OWN_BASES)
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(2)]
    task = SwiftTaskSource.from_spec("own_bases2:EmptyReplyRewrites", plugins=[tmp_path / "own_bases2.py"],
                                     dataset=rows, max_turns=2)  # fmt: skip

    class EmptyForFirst(Scripted):
        def generate(self, requests):
            out = super().generate(requests)
            for r, g in zip(requests, out, strict=True):
                if r.tag.split()[1] == "0":  # request 0 answers only the end-of-turn token
                    g.token_ids, g.logprobs = [self.tokenizer.eos_token_id], [-0.1]
            return out

    engine = EmptyForFirst(tokenizer, "7")
    bad, good = task.rollout(rows, num_generations=1, engine=engine, tokenizer=tokenizer,
                             sampling=SAMPLING, seed=0, on_sample_error="skip")  # fmt: skip
    assert good.status is Status.STOPPED and good.infos.turns == 2
    assert bad.status is Status.FAILED and sum(bad.loss_mask) == 0
    assert bad.infos.stop_reason.startswith("scheduler: HistoryRewriteError: ")


def test_any_module_path_flag_loads_the_file_as_a_package_member(tmp_path):
    from interlens_mcore.plugins import load_object

    (tmp_path / "scores.py").write_text("def one(trajectories, rows):\n    return [1.0] * len(rows)\n")
    (tmp_path / "my_reward.py").write_text("from .scores import one as reward\n")
    assert load_object(f"{tmp_path}/my_reward.py:reward", what="--reward")([], [0, 0]) == [1.0, 1.0]


def test_gym_env_flag_in_both_spellings():
    from interlens_mcore.cli.args import parse

    for flag in ("--gym-env", "--gym_env"):
        args = parse([flag, "math_env", "--multi-turn-scheduler", "gym_scheduler"], "test")
        assert args.launch.gym_env == "math_env"
