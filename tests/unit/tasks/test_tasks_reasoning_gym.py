"""reasoning-gym tasks: seeded disjoint rows, the answer rule, the judge, and a tiny-model rollout."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fakes import ScriptEngine
from support.play import play, scored

from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.grpo.rewards import environment_reward
from interlens_mcore.tasks import reasoning_gym as rg
from interlens_mcore.tasks.reasoning_gym import AnswerRule

RULE = AnswerRule()


@pytest.mark.parametrize(
    "text,answer",
    [
        ("<answer>42</answer>", "42"),
        ("think\n<answer> 7 </answer>\nbye", "7"),
        ("<answer>1</answer> no wait <answer>2</answer>", "2"),  # the last tag wins
        ("<answer>\n-4\n</answer>", "-4"),
        ("<answer></answer>", None),  # an empty tag holds no answer (and blocks the fallback)
        ("reasoning\n\n  the end is 12  \n\n", "the end is 12"),  # last non-empty line
        ("<answer>5", "<answer>5"),  # unclosed: not a tag, so the last line
        ("</answer>5<answer>", "</answer>5<answer>"),
        ("", None),
        ("   \n\t\n", None),
        ("<ANSWER>3</ANSWER>", "<ANSWER>3</ANSWER>"),  # tags are case-sensitive
    ],
)
def test_answer_rule(text, answer):
    assert RULE.extract(text) == answer


def test_answer_rule_options():
    assert AnswerRule(fallback="none").extract("just 5") is None
    assert AnswerRule(fallback="whole").extract(" a\nb ") == "a\nb"
    last_number = AnswerRule(fallback="last_number")
    assert last_number.extract("1 + 6 = 7") == "7"
    assert last_number.extract("so 12 - 30 is -18.\nDone") == "-18"
    assert last_number.extract("about 1,234.5 apples") == "1234.5"
    assert last_number.extract("no digits here") is None
    assert last_number.extract("<answer>9</answer> not 8") == "9"  # the tag still wins
    assert AnswerRule(tag="final").extract("<final>x</final><answer>y</answer>") == "x"
    assert AnswerRule(tag=None).extract("<answer>y</answer>\nz") == "z"
    with pytest.raises(ValueError, match="fallback must be"):
        AnswerRule(fallback="first")
    with pytest.raises(ValueError, match="tag must be a tag name"):
        AnswerRule(tag="a>b")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<answer>", "</answer>", "\n", " ", "1", "x", "<", ">"])).map("".join))
def test_answer_rule_never_raises(text):
    out = RULE.extract(text)
    assert out is None or (out == out.strip() and out)


def test_rows_are_seeded_and_disjoint_from_evaluation():
    src = rg.source("basic_arithmetic", eval_fraction=0.2)
    a, b = src.rows(40, seed=3), src.rows(40, seed=3)
    assert [r.entry for r in a] == [r.entry for r in b]
    assert [r.entry["question"] for r in a] != [r.entry["question"] for r in src.rows(40, seed=4)]
    train = {r.entry["question"] for s in range(5) for r in src.rows(40, seed=s)}
    held = {r.entry["question"] for s in range(5) for r in src.eval_rows(20, seed=s)}
    assert len(held) > 50 and not train & held
    assert src.describe()["datasets"] == ["basic_arithmetic"]


def test_held_out_questions_are_distinct():
    # one-digit sums and differences (a few phrasings each): some hundreds of questions, 10 %
    # held out; a draw of held-out rows never repeats one, and more than there are is an error
    narrow = rg.source("basic_arithmetic", min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    held = [r.entry["question"] for r in narrow.eval_rows(8, seed=0)]
    assert len(set(held)) == 8
    with pytest.raises(ValueError, match="found \\d+ of 1000 held-out questions"):
        narrow.eval_rows(1000, seed=0)
    wide = rg.source("basic_arithmetic", min_terms=2, max_terms=2, min_digits=1, max_digits=2)
    assert len({r.entry["question"] for r in wide.eval_rows(200, seed=0)}) == 200


def test_mixes_configs_and_errors():
    src = rg.source("chain_sum+basic_arithmetic", weights="1,3")
    kinds = [r.entry["metadata"]["source_dataset"] for r in src.rows(80, seed=0)]
    assert 5 < kinds.count("chain_sum") < kinds.count("basic_arithmetic")
    narrow = rg.source("basic_arithmetic", min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert all(r.entry["metadata"]["num_terms"] == 2 for r in narrow.rows(10, seed=0))
    with pytest.raises(ValueError, match="no dataset \\['nope'\\]"):
        rg.source("nope")
    with pytest.raises(ValueError, match="unexpected keyword argument 'foo'"):
        rg.source("basic_arithmetic", foo=1)
    with pytest.raises(ValueError, match="ambiguous for the mix"):
        rg.source("chain_sum+basic_arithmetic", min_terms=2)
    with pytest.raises(ValueError, match="must be 2 positive numbers"):
        rg.source("chain_sum+basic_arithmetic", weights="1")
    with pytest.raises(ValueError, match="max_attempts must be >= 1"):
        rg.source("basic_arithmetic", max_attempts=0)


def _judged(tiny, src, replies):
    row = src.rows(1, seed=0)[0]
    convs = play([row], ScriptEngine(tiny[1], {"row0": list(replies)}), tiny[1])
    return row, convs[0]


def test_single_turn_scores_with_the_verifier(tiny):
    src = rg.source("basic_arithmetic")
    row = src.rows(1, seed=0)[0]
    right = row.entry["answer"]
    _, conv = _judged(tiny, src, [f"so <answer>{right}</answer>"])
    assert conv.infos["success"] == 1.0 and conv.stop_reason == "solved" and len(conv.messages) == 1
    [t] = scored(conv)
    assert environment_reward([t], [row]) == [1.0] and t.infos["attempts"] == 1
    _, conv = _judged(tiny, src, ["<answer>nonsense</answer>"])
    assert conv.infos["success"] == 0.0 and conv.stop_reason == "out of attempts"
    assert conv.lineup[1].reward(conv) == 0.0


def test_multi_turn_feedback_and_discount(tiny):
    src = rg.source("basic_arithmetic", max_attempts=3, discount=0.5, feedback="detailed")
    row = src.rows(1, seed=0)[0]
    right = row.entry["answer"]
    _, conv = _judged(tiny, src, ["", "<answer>999999</answer>", f"<answer>{right}</answer>"])
    said = [m.content for m in conv.messages if m.speaker == "judge"]
    assert said[0].startswith("No answer found") and said[1].startswith("Your answer '999999' scored")
    assert conv.infos["attempts"] == 3 and conv.infos["answer_found"] == 2 and conv.infos["success"] == 1.0
    assert conv.lineup[1].reward(conv) == 0.25  # 1.0 x 0.5 ** 2
    assert row.max_turns == 6


def test_attempt_rates_say_which_attempt_solved_it(tiny):
    src = rg.source("basic_arithmetic", max_attempts=3)
    right = src.rows(1, seed=0)[0].entry["answer"]
    cases = {  # replies -> (first attempt, second after a miss): None where the rate is not set
        (f"<answer>{right}</answer>",): (1.0, None),
        ("<answer>999999</answer>", f"<answer>{right}</answer>"): (0.0, 1.0),
        ("<answer>999999</answer>", "<answer>1</answer>", f"<answer>{right}</answer>"): (0.0, 0.0),
    }
    for replies, (first, second) in cases.items():
        _, conv = _judged(tiny, src, list(replies))
        extra = conv.trajectories()[0].infos.extra
        assert extra["rate/first_attempt"] == first, replies
        assert extra.get("rate/second_attempt_after_miss") == second, replies
        assert conv.infos["success"] == 1.0
    # one attempt: no rates (success_rate says it all)
    _, conv = _judged(tiny, rg.source("basic_arithmetic"), [f"<answer>{right}</answer>"])
    assert not [k for k in conv.infos if k.startswith("rate/")]


def test_a_verifier_that_raises_scores_zero_and_is_counted(tiny):
    src = rg.source("prime_factorization", max_attempts=2, feedback="detailed")
    _, conv = _judged(tiny, src, ["<answer>abc</answer>", "<answer>x</answer>"])
    assert conv.infos["verifier_errors"] == 2 and conv.infos["score"] == 0.0
    assert conv.infos["verifier_error"].startswith("ValueError")
    assert "could not be checked (ValueError" in conv.messages[1].content
    assert conv.trajectories()[0].infos["verifier_errors"] == 2


def test_tiny_model_rollout(tiny):
    model, tok = tiny
    src = rg.source("basic_arithmetic", max_attempts=2)
    rows = src.rows(4, seed=1)
    convs = play(rows, HFEngine(model, tok), tok, max_new_tokens=6)
    trajectories = [t for c in convs for t in scored(c)]
    assert len(trajectories) == 4
    for c, t in zip(convs, trajectories):
        assert c.infos["attempts"] in (1, 2) and c.infos["success"] in (0.0, 1.0)
        assert len(t.turns) == c.infos["attempts"] and sum(t.loss_mask) == len(t.rollout_logprobs)
    assert len(environment_reward(trajectories, rows)) == 4


def test_make_source_dispatches_by_family():
    from interlens_mcore.tasks.families import make_source

    assert make_source("reasoning_gym:basic_arithmetic", max_attempts=2).options.max_attempts == 2
    assert make_source("gym:FrozenLake-v1", is_slippery=False).name == "gym:FrozenLake-v1"
    assert make_source("textarena:TicTacToe-v0", opponent="frozen").frozen_seats == ("player_1",)
    for bad in ("reasoning_gym", "chess:Chess-v0", "gym:"):
        with pytest.raises(ValueError, match="expected FAMILY:NAME"):
            make_source(bad)


def test_parse_task_args():
    from interlens_mcore.tasks.families import make_source, parse_task_args

    args = parse_task_args(["max_attempts=3", "discount=0.5", "weights=1,3", "feedback=detailed", "x=false"])
    assert args == {"max_attempts": 3, "discount": 0.5, "weights": "1,3", "feedback": "detailed", "x": False}
    assert parse_task_args(["configs={basic_arithmetic: {min_terms: 2}}"])["configs"] == {
        "basic_arithmetic": {"min_terms": 2}
    }
    assert parse_task_args(["tag=a: b: c"])["tag"] == "a: b: c"  # not YAML: kept as text
    for bad, why in [
        (["novalue"], "expected KEY=VALUE"),
        (["1x=2"], "expected KEY=VALUE"),
        (["a=1", "a=2"], "twice"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_task_args(bad)
    src = make_source("gym:FrozenLake-v1", **parse_task_args(["is_slippery=false", "max_steps=4"]))
    assert src.options.make_args == {"is_slippery": False} and src.options.max_steps == 4
