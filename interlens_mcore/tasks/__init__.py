"""Task sources: toy games, datasets and adapters of outside task libraries."""

from .base import Task, TaskSource
from .registry import register_task, resolve_task
from .toy import DuelTasks, GuessTasks

__all__ = ["DuelTasks", "GuessTasks", "Task", "TaskSource", "register_task", "resolve_task"]
