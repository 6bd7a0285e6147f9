"""ms-swift's small helpers that scheduler and environment files import, with ms-swift's meaning.

- `get_token_backed_response_ids(content)`: the exact token ids an assistant message carries
  instead of text (a list of ints, or a dict with `token_ids` / `input_ids` that is one), else
  None (text, or anything else);
- `remove_response(messages)`: pops a last assistant message and returns its content (None,
  and `messages` untouched, when the last message is not the assistant's);
- `get_logger()`: the logger ported files write to (`interlens_mcore.swift`), with a handler on
  stderr so their warnings show.
"""

from __future__ import annotations

import logging
from typing import Any

from .types import Message

_LOGGER = "interlens_mcore.swift"


def get_token_backed_response_ids(response: Any) -> list[int] | None:
    """The token ids a token-backed response holds, or None when it is not one."""
    token_ids = response
    if isinstance(response, dict):
        token_ids = response.get("token_ids", response.get("input_ids"))
    if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
        return None
    return list(token_ids)


def remove_response(messages: list[Message]) -> Any:
    """Pop the last message if it is the assistant's and return its content; else None."""
    if messages and messages[-1].get("role") == "assistant":
        return messages.pop()["content"]
    return None


def get_logger(
    log_file: str | None = None, log_level: int | None = None, file_mode: str = "w"
) -> logging.Logger:
    """The logger of ported ms-swift files (stderr; `log_file` adds a file handler once)."""
    logger = logging.getLogger(_LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(levelname)s:swift] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    if log_level is not None:
        logger.setLevel(log_level)
    if log_file is not None and not any(
        isinstance(h, logging.FileHandler) and h.baseFilename == str(log_file) for h in logger.handlers
    ):
        logger.addHandler(logging.FileHandler(log_file, mode=file_mode))
    return logger
