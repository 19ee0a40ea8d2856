"""The base of every config section (rlpipe/config.py, rlpipe/task_config.py): an unknown key is
an error naming it, and a value assigned later is validated as a loaded one is."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
