"""Two verifiers environments built from verifiers' public API, as a user's environment file.

`write(folder)` puts them in `folder/digit_envs.py`: `--task verifiers:PATH` loads the
SingleTurnEnv (`load_environment`), `--task verifiers:PATH:tool_env` the ToolEnv.
"""

from __future__ import annotations

from pathlib import Path

ENVS = '''
import verifiers as vf
from datasets import Dataset


def _reply(completion):
    return (completion[-1].content or "").strip() if completion else ""


def correct(completion, answer) -> float:
    return float(_reply(completion) == answer)


def starts_with_digit(completion) -> float:
    return float(_reply(completion)[:1].isdigit())


def load_environment(num_rows: int = 24, sampling_args: dict | None = None):
    """Say the digit asked for: 1 for the digit alone, 0.5 more for a reply that opens with one."""
    rows = [{"question": f"say the digit {i % 10}", "answer": str(i % 10)} for i in range(num_rows)]
    rubric = vf.Rubric(funcs=[correct, starts_with_digit], weights=[1.0, 0.5])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=rubric, sampling_args=sampling_args)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def tool_env(num_rows: int = 24, max_turns: int = 2):
    """What is a + b, with an `add` tool; 1 when the last reply holds the sum."""
    rows = [{"question": f"what is {i} + {i % 3}?", "answer": str(i + i % 3)} for i in range(num_rows)]
    evals = [{"question": f"what is {i} + 1?", "answer": str(i + 1)} for i in range(100, 108)]

    def sum_in_reply(completion, answer) -> float:
        return float(answer in _reply(completion))

    return vf.ToolEnv(
        dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(evals),
        tools=[add],
        rubric=vf.Rubric(funcs=[sum_in_reply]),
        max_turns=max_turns,
    )


def not_an_env():
    return 3
'''


def write(folder: Path) -> Path:
    path = folder / "digit_envs.py"
    path.write_text(ENVS)
    return path
