"""Prompt sources for the controller: built-in tasks and user data, and prompt rendering to token ids."""

from rlfleet.workers.data.tasks import (
    ArithmeticTask,
    DataError,
    Example,
    JsonlTask,
    Task,
    render_prompt,
    task_for,
)

__all__ = ["ArithmeticTask", "DataError", "Example", "JsonlTask", "Task", "render_prompt", "task_for"]
