"""`--dynamic-sampling` under torchrun: prompts that teach nothing are replaced in extra rounds, the
batch keeps its size, both ranks agree on the rounds."""

from __future__ import annotations

from support.launch import SMALL, metrics, torchrun

# the game's own reward for odd secrets; one reward for every sample of an even secret, so about
# half the prompts of each round teach nothing
REWARD = """
def odd_only(trajectories, rows):
    return [t.infos.env_reward if row.secret % 2 else 0.25 for t, row in zip(trajectories, rows)]
"""


def _run(tmp_path, *extra: str) -> list[dict]:
    (tmp_path / "odd.py").write_text(REWARD)
    out = tmp_path / "run"
    args = ["--reward", "odd:odd_only", "--no-env-reward", "--steps", "4", "--output-dir", str(out)]
    res = torchrun(*args, *SMALL, *extra, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    return metrics(out)


def test_dynamic_sampling_keeps_the_batch_full_of_informative_prompts(tmp_path):
    rows = _run(tmp_path, "--dynamic-sampling", "--max-extra-rounds", "3")
    quota = 2 * 8 // 4  # 2 ranks x batch size 8 / 4 generations
    assert all(r["samples"] == 16 for r in rows)  # the batch keeps its size
    assert any(r["dynamic/extra_rounds"] > 0 for r in rows)  # half of a round cannot fill it
    for r in rows:
        assert 0 <= r["dynamic/extra_rounds"] <= 3
        if r["dynamic/extra_rounds"] < 3:  # it stopped because every rank was full
            assert r["dynamic/kept_groups"] == quota and r["frac_reward_zero_std"] == 0.0


def test_without_it_uninformative_prompts_stay(tmp_path):
    rows = _run(tmp_path)
    assert not any(k.startswith("dynamic/") for r in rows for k in r)
    assert max(r["frac_reward_zero_std"] for r in rows) > 0
