"""--reward-model: the tiny sequence classifier scores trajectories in batches, frozen."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from interlens_mcore.assets import ensure_tiny_classifier
from interlens_mcore.rewards.model import RewardModel, RewardModelError
from interlens_mcore.types import Status, Trajectory, TrajectoryInfo


def trajectory(question: str, answer: str, status: Status = Status.STOPPED) -> Trajectory:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    info = TrajectoryInfo(conversation=question, completion=answer, messages=messages)
    return Trajectory(token_ids=[1, 2], loss_mask=[0, 1], rollout_logprobs=None, status=status, infos=info)


TEXTS = [
    ("what is one + two", "three"),
    ("guess the number", "My guess is 50. It is higher than the first guess you made"),
    ("yes", "no"),
    ("add the sum of the total", "done"),
    ("think step by step first", "first second third step done correct answer"),
]


@pytest.fixture(scope="module")
def classifier():
    return ensure_tiny_classifier()


def test_batches_score_as_one_by_one(classifier):
    trajs = [trajectory(q, a) for q, a in TEXTS]
    batched = RewardModel(classifier, batch_size=3)(trajs, [None] * len(trajs))
    alone = [RewardModel(classifier, batch_size=1)([t], [None])[0] for t in trajs]
    assert batched == pytest.approx(alone, abs=1e-5)
    assert len(set(round(s, 6) for s in batched)) == len(trajs)  # the scores tell the texts apart


def test_frozen_and_loaded_once(classifier):
    rm = RewardModel(classifier)
    rm([trajectory("a", "b")], [None])
    model = rm.loaded.model
    rm([trajectory("c", "d")], [None])
    assert rm.loaded.model is model and not model.training
    assert not any(p.requires_grad for p in model.parameters())


def test_chat_template_scores_the_messages(classifier):
    rm = RewardModel(classifier)
    t = trajectory("guess the number", "My guess is 7.")
    tok = rm.loaded.tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "guess the number"}, {"role": "assistant", "content": "My guess is 7."}],
        tokenize=False,
    )
    assert rm.input_ids(t) == tok(chat, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_start|>") in rm.input_ids(t)


def test_without_chat_template_scores_prompt_and_completion_text(classifier, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(classifier, plain)
    (plain / "chat_template.jinja").unlink()
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    rm = RewardModel(plain)
    assert not rm.loaded.tokenizer.chat_template
    t = trajectory("guess the number", "My guess is 7.")
    assert rm.input_ids(t) == rm.loaded.tokenizer("guess the number\nMy guess is 7.")["input_ids"]
    chat_score = RewardModel(classifier)([t], [None])[0]
    assert rm([t], [None])[0] != pytest.approx(chat_score, abs=1e-7)


def test_failed_trajectory_scores_zero_and_is_not_read(classifier):
    rm = RewardModel(classifier)
    ok, failed = trajectory("yes", "no"), trajectory("yes", "no", Status.FAILED)
    scores = rm([ok, failed], [None, None])
    assert scores[1] == 0.0 and scores[0] != 0.0


def test_too_long_trajectory_is_marked_failed(classifier):
    rm = RewardModel(classifier)
    long = trajectory("guess " * 2000, "no")
    assert rm([long], [None]) == [0.0]
    assert long.status is Status.FAILED and long.infos.stop_reason.startswith("reward reward_model: ")


def test_a_causal_lm_folder_is_refused(tiny_path):
    with pytest.raises(RewardModelError, match="--reward-model .*not a sequence classifier") as err:
        RewardModel(tiny_path)
    assert str(tiny_path) in str(err.value) and "Qwen2ForCausalLM" in str(err.value)


def test_a_folder_without_safetensors_is_refused(classifier, tmp_path):
    pickled = tmp_path / "pickled"
    shutil.copytree(classifier, pickled)
    weights = {k: v for k, v in RewardModel(classifier).loaded.model.state_dict().items()}
    (pickled / "model.safetensors").unlink()
    torch.save(weights, pickled / "pytorch_model.bin")
    with pytest.raises(RewardModelError, match=f"--reward-model {pickled}: no safetensors weights"):
        RewardModel(pickled)


def test_label_out_of_range_is_refused(classifier):
    with pytest.raises(RewardModelError, match="--reward-model-label 1: .* 1 labels"):
        RewardModel(classifier, label=1)


def test_a_transcript_the_chat_template_refuses_fails_only_itself(classifier, tmp_path):
    strict = tmp_path / "strict"
    shutil.copytree(classifier, strict)
    template = (strict / "chat_template.jinja").read_text()
    guard = "{% for m in messages %}{% if m['role'] == 'tool' %}"
    guard += "{{ raise_exception('no tool role') }}{% endif %}{% endfor %}"
    (strict / "chat_template.jinja").write_text(guard + template)
    odd = trajectory("add", "3")
    odd.infos.messages.insert(1, {"role": "tool", "content": "1 + 2 = 3"})
    ok = trajectory("add", "3")
    scores = RewardModel(strict)([odd, ok], [None, None])
    assert odd.status is Status.FAILED and scores[0] == 0.0
    assert odd.infos.stop_reason.startswith("reward reward_model: TemplateError: no tool role")
    assert ok.status is Status.STOPPED and scores[1] == RewardModel(classifier)([ok], [None])[0]
