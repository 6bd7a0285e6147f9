"""The toy backend of docs/guide.md ("Adding a backend"), taken from the page, trains two steps.

The block is written out as a module, registered in `registry.BACKENDS` as the page says, and
built through `build_backend` from a `BackendConfig` naming it: the same path `--backend` takes.
Being the cheapest whole trainer, it also runs the loop's own checks in one process: the learning
rate schedule, and evaluation with an environment that fails on some held-out samples.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from interlens_mcore import Environment, distributed
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.grpo.rewards import environment_reward
from interlens_mcore.rollout.rollouter import RolloutConfig
from interlens_mcore.tasks import GuessTasks
from trainers import BackendConfig, GRPOTrainer, TrainerConfig, build_backend
from trainers.backends import registry
from trainers.backends.factory import builder

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guide.md"


def toy_backend_code() -> str:
    section = re.split(r"^## ", GUIDE.read_text(), flags=re.M)
    (body,) = [s for s in section if s.startswith("Adding a backend\n")]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)[0]


def test_the_toy_backend_is_about_30_lines():
    code = toy_backend_code()
    toy_class = code[code.index("class ToyBackend") :]
    assert len(toy_class.splitlines()) < 30
    assert len(code.splitlines()) <= 40


def sampled_token_sum(trajectories, rows):
    """A reward the samples of the untrained tiny model differ in (guess-a-number gives them all 0)."""
    sums = [sum(i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m) for t in trajectories]
    return [float(s % 17) for s in sums]


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The page's block as module `toy_backend`, registered as --backend toy; a one-rank world."""
    (tmp_path / "toy_backend.py").write_text(toy_backend_code())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.BACKENDS, "toy", "toy_backend")
    distributed.init_distributed()
    yield
    distributed.destroy()


def _toy(config, tiny_path, tokenizer, *, micro_batch_size):
    """The guide's toy backend for 4 trajectories a rank, built through the factory."""
    return build_backend(
        BackendConfig(backend="toy"),
        config,
        model_path=tiny_path,
        tokenizer=tokenizer,
        temperature=1.0,
        reference=False,
        trajectories_per_rank=4,
        micro_batch_size=micro_batch_size,
    )


def test_the_toy_backend_from_the_guide_trains_two_steps(toy, tiny_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    config = TrainerConfig(steps=2, batch_size=4, eval_every=0, output_dir=str(tmp_path / "run"))
    backend, groups = _toy(config, tiny_path, tokenizer, micro_batch_size=0)
    assert type(backend).__name__ == "ToyBackend"
    before = [p.detach().clone() for p in backend.model.parameters()]
    trainer = GRPOTrainer(
        backend=backend,
        tasks=GuessTasks(),
        groups=groups,
        tokenizer=tokenizer,
        config=config,
        rollout_config=RolloutConfig(num_generations=2, max_new_tokens=4),
        loss_config=LossConfig(beta=0.0),
        rewards=[environment_reward, sampled_token_sum],
    )
    records = trainer.train()
    assert [r["step"] for r in records] == [0, 1]
    written = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in written] == [0, 1]
    after = list(backend.model.parameters())
    assert any(not torch.equal(b, a.detach()) for b, a in zip(before, after, strict=True))


def test_every_registered_backend_has_a_build_function():
    # importing the modules needs neither megatron-core nor DeepSpeed: they import them lazily
    assert all(callable(builder(name)) for name in registry.BACKENDS)


def test_an_unknown_backend_names_the_flag_and_the_known_ones():
    expected = "expected one of megatron, deepspeed"
    with pytest.raises(ValueError, match=f"--backend 'fsdp': {expected}"):
        builder("fsdp")
    with pytest.raises(ValueError, match=f"BackendConfig.backend 'fsdp': {expected}"):
        BackendConfig(backend="fsdp")


def test_the_loop_sets_the_scheduled_lr_and_accumulates_micro_batches(toy, tiny_path, tmp_path):
    """--warmup-steps 3: the backend's optimizer runs at lr/3, then 2lr/3, each logged as `lr`;
    --gradient-accumulation-steps 2 cuts a rank's 4 trajectories into 2 micro-batches."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    config = TrainerConfig(
        steps=2, batch_size=4, eval_every=0, lr=3e-3, warmup_steps=3, gradient_accumulation_steps=2,
        output_dir=str(tmp_path / "run"),
    )  # fmt: skip
    backend, groups = _toy(config, tiny_path, tokenizer, micro_batch_size=2)
    seen = []
    step = backend.optimizer_step
    backend.optimizer_step = lambda: (seen.append(backend.optimizer.param_groups[0]["lr"]), step())[1]
    trainer = GRPOTrainer(
        backend=backend,
        tasks=GuessTasks(),
        groups=groups,
        tokenizer=tokenizer,
        config=config,
        rollout_config=RolloutConfig(num_generations=2, max_new_tokens=4),
        loss_config=LossConfig(beta=0.0),
        rewards=[environment_reward, sampled_token_sum],
    )
    assert trainer.rollout_config.micro_batch_size == 2
    records = trainer.train()
    assert [r["learning_rate"] for r in records] == pytest.approx([1e-3, 2e-3])
    assert seen == pytest.approx([1e-3, 2e-3])  # what the optimizer stepped with
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["learning_rate"] for r in written] == pytest.approx([1e-3, 2e-3])


class FallsOver(Environment):
    """The game master of a held-out game, raising on one sample in three (by the sample's id)."""

    def __init__(self, inner: Environment, raised: list[str]):
        self.inner, self.raised, self.name = inner, raised, inner.name

    def respond(self, conv):
        if zlib.crc32(conv.id.encode()) % 3 == 0:
            self.raised.append(conv.id)
            raise RuntimeError("the game master fell over")
        return self.inner.respond(conv)

    def reward(self, conv):
        return self.inner.reward(conv)


@dataclass(frozen=True)
class FlakyGame:
    inner: object  # a GuessNumberTask
    raised: list[str]

    @property
    def max_turns(self) -> int:
        return self.inner.max_turns

    def prompt(self):
        return self.inner.prompt()

    def lineup(self, seat):
        policy, master = self.inner.lineup(seat)
        return [policy, FallsOver(master, self.raised)]


class FlakyEvaluation(GuessTasks):
    """Guess-a-number whose held-out games fail on one sample in three; training never fails."""

    def __init__(self):
        super().__init__()
        self.raised: list[str] = []  # the ids of the samples that failed, in order

    def eval_rows(self, n, *, seed):
        return [FlakyGame(row, self.raised) for row in super().eval_rows(n, seed=seed)]


def test_failed_evaluation_samples_are_counted_in_metrics_the_bar_and_the_done_line(
    toy, tiny_path, tmp_path, capsys
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    config = TrainerConfig(steps=1, batch_size=4, eval_every=1, eval_size=8, output_dir=str(tmp_path / "run"))
    backend, groups = _toy(config, tiny_path, tokenizer, micro_batch_size=0)
    tasks = FlakyEvaluation()
    trainer = GRPOTrainer(
        backend=backend,
        tasks=tasks,
        groups=groups,
        tokenizer=tokenizer,
        config=config,
        rollout_config=RolloutConfig(num_generations=2, max_new_tokens=4),
        loss_config=LossConfig(beta=0.0),
        rewards=[environment_reward],
    )
    trainer.train()
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in written if "eval/samples" in r]  # step 0's, and the end's (step 1)
    assert [r["step"] for r in evals] == [0, 1]
    # the ids are eval<step>-r0-p<row>-g0; crc32 % 3 picks rows 2 and 6 at step 0, 3 and 5 at 1
    failed = [sum(i.startswith(f"eval{s}-") for i in tasks.raised) for s in (0, 1)]
    assert failed == [2, 2]
    for r, n in zip(evals, failed, strict=True):
        assert r["eval/samples"] == 8 and r["eval/failed_samples"] == n == r["eval/failed/environment"]
        # the rate is over the games that were played out, each of which says how it went
        assert r["eval/success_n"] == 8 - n
    err = capsys.readouterr().err
    rate = evals[0]["eval/success_rate"]
    assert f"eval={rate:.2f} of 6, 2 of 8 failed" in err  # the progress bar, after step 0
    (done,) = [line for line in err.splitlines() if line.startswith("done:")]
    assert "eval/success_rate: " in done and done.count("of 6, 2 of 8 failed") == 2, done
