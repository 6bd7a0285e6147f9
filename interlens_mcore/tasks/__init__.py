"""Task sources: toy games, datasets and adapters of outside task libraries."""

from .base import Task, TaskSource

__all__ = ["Task", "TaskSource"]
