"""Tasks: a dataset of prompts plus a reward function, behind one small interface.

A task hands out the prompt for a dataset index (the index comes from the run's shared
Redis cursor, so workers never duplicate or skip a prompt) and scores a response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlpipe.config import TaskConfig
from rlpipe.toy import ArithmeticTask


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    answer: str


class Task(Protocol):
    def prompt(self, index: int) -> Prompt: ...

    def reward(self, prompt: Prompt, response_text: str) -> tuple[float, dict | None]: ...


class ArithTask:
    """The toy task: exact-match reward on small-number arithmetic."""

    def __init__(self, cfg: TaskConfig):
        self.task = ArithmeticTask(digits=cfg.digits, ops=cfg.ops, seed=cfg.seed, size=cfg.size)

    def prompt(self, index: int) -> Prompt:
        text, answer = self.task.problem(index)
        return Prompt(prompt_id=str(index % self.task.size), text=text, answer=answer)

    def reward(self, prompt: Prompt, response_text: str) -> tuple[float, dict | None]:
        return self.task.reward(prompt.answer, response_text), None


def make_task(cfg: TaskConfig) -> Task:
    if cfg.type == "arith":
        return ArithTask(cfg)
    raise ValueError(f"task.type: unknown task {cfg.type!r}")
