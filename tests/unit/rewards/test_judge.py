"""--judge-model / --judge-template: the template, the parsing rule, and a real judge engine."""

from __future__ import annotations

import pytest

from interlens_mcore.rewards.judge import Judge, JudgeError, JudgeTemplateError, Template, parse_score
from interlens_mcore.rewards.model import RewardModelError
from interlens_mcore.types import Status, Trajectory, TrajectoryInfo

TEMPLATE = "Question: {prompt}\nAnswer: {completion}\nReference: {solution}\nscore:"


def trajectory(question: str, answer: str, status: Status = Status.STOPPED) -> Trajectory:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    info = TrajectoryInfo(conversation=question, completion=answer, messages=messages)
    return Trajectory(token_ids=[1, 2], loss_mask=[0, 1], rollout_logprobs=None, status=status, infos=info)


def template(tmp_path, text: str = TEMPLATE) -> Template:
    path = tmp_path / "judge.txt"
    path.write_text(text)
    return Template.read(path)


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("score: 0.8", 0.8),
        ("The answer is 3 of 4. Score = 1", 1.0),
        ("SCORE: .25 and later 7", 0.25),  # a score line wins over a later number
        ("I think 0 then 0.5", 0.5),  # no score line: the last number
        ("score: 7", None),  # outside [0, 1]
        ("no number here", None),
        ("", None),
    ],
)
def test_parse_score(reply, score):
    assert parse_score(reply) == score


def test_template_fills_prompt_completion_and_row_columns(tmp_path):
    t = template(tmp_path)
    assert t.keys == ("prompt", "completion", "solution")
    filled = t.fill({"prompt": "1+1?", "completion": "2", "solution": "2", "other": 5}, "row 0")
    assert filled == "Question: 1+1?\nAnswer: 2\nReference: 2\nscore:"


def test_a_missing_key_names_the_file_and_the_key(tmp_path):
    t = template(tmp_path)
    missing = r"judge\.txt: placeholder \{solution\} is not filled"
    with pytest.raises(JudgeTemplateError, match=missing) as err:
        t.fill({"prompt": "q", "completion": "c"}, "trajectory 3")
    assert str(tmp_path / "judge.txt") in str(err.value) and "trajectory 3" in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Answer: {completion} {", "Single '{' encountered"),
        ("Answer: {completion} {0}", r"placeholder \{0\} is not a name"),
        ("Answer: {completion.upper}", r"placeholder \{completion.upper\} is not a name"),
        ("Question: {prompt}", r"no \{completion\} placeholder"),
    ],
)
def test_bad_templates_are_refused(tmp_path, text, message):
    with pytest.raises(JudgeTemplateError, match=message):
        template(tmp_path, text)


def test_literal_braces_are_doubled(tmp_path):
    t = template(tmp_path, 'Reply as {{"score": X}}. Answer: {completion}')
    assert t.fill({"completion": "c"}, "row") == 'Reply as {"score": X}. Answer: c'


def test_judge_scores_with_a_real_engine(tiny_path, tmp_path):
    judge = Judge(tiny_path, template(tmp_path), max_new_tokens=4)
    trajs = [trajectory("1+1?", "2"), trajectory("2+2?", "4"), trajectory("x", "y", Status.FAILED)]
    rows = [{"solution": "2"}, {"solution": "4"}, {"solution": "?"}]
    scores = judge(trajs, rows)
    assert len(scores) == 3 and scores[2] == 0.0 and all(0.0 <= s <= 1.0 for s in scores)
    for t, s in zip(trajs[:2], scores):
        reply = t.infos.extra["judge_reply"]
        assert isinstance(reply, str)
        assert t.infos.extra["judge_unparsed"] == int(parse_score(reply) is None)
        assert s == (parse_score(reply) or 0.0)
    assert "judge_reply" not in trajs[2].infos.extra  # a FAILED sample is not judged
    assert not judge.engine().model.training  # type: ignore[attr-defined]
    # greedy: the same trajectories get the same replies
    again = [trajectory("1+1?", "2"), trajectory("2+2?", "4")]
    judge(again, rows[:2])
    assert [t.infos.extra["judge_reply"] for t in again] == [t.infos.extra["judge_reply"] for t in trajs[:2]]


def test_judge_row_without_a_placeholder_column_fails_through_the_vote(tiny_path, tmp_path):
    judge = Judge(tiny_path, template(tmp_path), max_new_tokens=2)
    missing = r"JudgeTemplateError: .*placeholder \{solution\} is not filled"
    with pytest.raises(JudgeError, match=missing):
        judge([trajectory("q", "a")], [{"answer": "a"}])


def test_judge_folder_must_be_a_causal_lm(tmp_path):
    from interlens_mcore.assets import ensure_tiny_classifier

    with pytest.raises(RewardModelError, match="--judge-model .*not a causal LM"):
        Judge(ensure_tiny_classifier(), template(tmp_path))


def test_prompt_is_the_transcript_before_the_seats_last_message():
    from interlens_mcore.rewards.inputs import reward_inputs

    messages = [
        {"role": "system", "content": "play"},
        {"role": "user", "content": "guess"},
        {"role": "assistant", "content": "50"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "75"},
        {"role": "user", "content": "correct"},  # the environment's last word follows the completion
    ]
    t = Trajectory(
        token_ids=[1],
        loss_mask=[1],
        rollout_logprobs=None,
        infos=TrajectoryInfo(completion="75", messages=messages),
    )
    assert reward_inputs(t, None).context_text == "play\nguess\n50\nhigher"


class ScriptedJudge:
    """A judge engine with set replies (the engine is not what this test is about), recording prompts."""

    name, max_context = "judge", 4096

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts = tokenizer, dict(replies), []

    def generate(self, requests):
        from interlens_mcore.engines.base import Generation

        out = []
        for r in requests:
            self.prompts.append(self.tokenizer.decode(r.prompt_ids))
            assert r.temperature == 0.0 and r.max_new_tokens == 16  # greedy, --judge-max-new-tokens
            ids = self.tokenizer.encode(self.replies[r.tag], add_special_tokens=False)
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop"))
        return out


def test_parsed_replies_are_the_scores(tiny, tiny_path, tmp_path):
    _, tok = tiny
    judge = Judge(tiny_path, template(tmp_path))
    judge._engine = engine = ScriptedJudge(tok, {"1+1?": "score: 0.75", "2+2?": "hmm wrong"})
    trajs = [trajectory("1+1?", "2"), trajectory("2+2?", "5")]
    assert judge(trajs, [{"solution": "2"}, {"solution": "4"}]) == [0.75, 0.0]
    assert [t.infos.extra["judge_unparsed"] for t in trajs] == [0, 1]
    # the filled template reached the judge as a user message of its chat template
    assert "<|im_start|>user\nQuestion: 1+1?\nAnswer: 2\nReference: 2\nscore:<|im_end|>" in engine.prompts[0]
    assert engine.prompts[0].endswith("<|im_start|>assistant\n")


def test_judge_called_inside_a_running_event_loop(tiny, tiny_path, tmp_path):
    import asyncio

    _, tok = tiny
    judge = Judge(tiny_path, template(tmp_path))
    judge._engine = ScriptedJudge(tok, {"1+1?": "score: 1"})

    async def caller():  # e.g. a trainer that awaits async reward functions beside this one
        return judge([trajectory("1+1?", "2")], [{"solution": "2"}])

    assert asyncio.run(caller()) == [1.0]
