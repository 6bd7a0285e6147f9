"""TRL environment classes as TRL's documentation teaches them (`environment_factory`): a class
with `reset(**row)`, public methods with Google docstrings as tools, and `get_reward()`.

Loaded by file path (`--environment-factory tests/support/trl_envs.py:Vault`), so nothing here
imports the test support package.
"""

from __future__ import annotations

import threading


class Vault:
    """A vault with a one-digit code: the policy tries codes and may ask for a hint."""

    def __init__(self):
        self.code = 0
        self.tries = 0
        self.opened = False

    def reset(self, **kwargs) -> str | None:
        self.code, self.tries, self.opened = int(kwargs["code"]), 0, False
        return " The code is one digit."

    def try_code(self, code: int) -> str:
        """Try a code on the vault.

        Args:
            code: The code to try, 0 to 9.

        Returns:
            Whether the vault opened.
        """
        self.tries += 1
        self.opened = self.opened or code == self.code
        return "open" if self.opened else "still locked"

    def hint(self) -> str:
        """Tell whether the code is even or odd.

        Returns:
            The parity of the code.
        """
        return "even" if self.code % 2 == 0 else "odd"

    def get_reward(self) -> float:
        return 1.0 if self.opened else 0.0


class Lamp:
    """A lamp to switch on; its reward is read asynchronously, as an LLM judge's would be."""

    def __init__(self):
        self.on = False
        self.switches = 0

    def reset(self, **kwargs) -> str | None:
        self.on, self.switches = False, 0
        return None  # the prompt as it is

    def switch(self, on: bool) -> str:
        """Switch the lamp.

        Args:
            on: True to switch it on, False to switch it off.

        Returns:
            The lamp's state.
        """
        self.on, self.switches = on, self.switches + 1
        return "on" if on else "off"

    def look(self) -> str:
        """Look at the lamp.

        Returns:
            Whether it is on.
        """
        return "on" if self.on else "off"

    async def get_reward(self) -> float:
        return float(self.on)


class Faulty:
    """Tools that fail: one raises, one does not return before its event is set."""

    released = threading.Event()

    def reset(self, **kwargs) -> str | None:
        return None

    def explode(self, size: int) -> str:
        """Raise.

        Args:
            size: How big.
        """
        raise RuntimeError(f"boom of size {size}")

    def hang(self) -> str:
        """Wait until released."""
        Faulty.released.wait(60)
        return "released"


def fewer_tries(completions, environments, **kwargs):
    """A TRL reward function reading the environments: minus a tenth per code tried."""
    return [-0.1 * env.tries if isinstance(env, Vault) else None for env in environments]


# a dict of factories, picked by the rows' `environment` column
BY_NAME = {"vault": Vault, "lamp": Lamp}
