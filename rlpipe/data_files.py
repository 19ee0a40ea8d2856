"""A dataset as its user has it, read into rows (dicts): a file or a folder, in the formats TRL's and verl's users keep.

``task.dataset`` (and ``eval.dataset``) is a path when it ends in one of :data:`FILE_SUFFIXES` (any case) or
holds a ``/`` (``./my_set``, ``data/gsm8k``); anything else is a name of :mod:`rlpipe.datasets`. The rule
reads the string only, never the disk, so every process reads one value the same way, and no shipped
name holds a ``/``.

- ``.jsonl``: one JSON object a line (a bad line is named by its number); ``.parquet``: pyarrow.
- ``.json`` (a JSON array, or JSON lines), ``.csv`` and ``.arrow``: Hugging Face ``datasets``.
- A folder: written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``datasets.load_from_disk``),
  or a folder of data files that ``datasets.load_dataset(folder)`` reads (``data/train-*.parquet``, a
  Hub snapshot). A folder of several splits needs one named: ``./gsm8k:test``.

Nothing is downloaded: ``datasets`` runs offline here (HF_DATASETS_OFFLINE), so a Hub id is refused as a
missing path; download the set once and name its folder. Rows are read whole at start-up (RL prompt
sets fit in memory).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE_SUFFIXES = (".jsonl", ".parquet", ".json", ".csv", ".arrow")


def is_path(dataset: str) -> bool:
    """Whether ``task.dataset``'s value is a file or folder (else a shipped name)."""
    return dataset.lower().endswith(FILE_SUFFIXES) or "/" in dataset


def split_of(dataset: str) -> tuple[str, str | None]:
    """``./set:test`` -> (``./set``, ``test``): a folder's split, named after its last ``:``."""
    head, sep, tail = dataset.rpartition(":")
    if sep and head and tail and "/" not in tail and not tail.lower().endswith(FILE_SUFFIXES):
        return head, tail
    return dataset, None


def read_rows(dataset: str | Path) -> list[dict]:
    """Every row of the file or folder ``dataset`` names; a ValueError naming the path and what is wrong."""
    path, split = split_of(str(dataset))
    path = Path(path)
    suffix = path.suffix.lower()
    if split is not None and not path.is_dir():
        raise ValueError(f"{dataset}: a split (':{split}') chooses among a folder's splits, and {path} is not a folder")
    if path.is_dir():
        rows = _folder_rows(path, split)
    elif not path.exists():
        raise ValueError(f"{path}: no such file or folder (a Hub id is not downloaded: save the set to a folder "
                         "and name that)")
    elif suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif suffix in (".json", ".csv", ".arrow"):
        rows = _hf_file_rows(path, suffix)
    else:
        raise ValueError(f"{path}: unsupported dataset extension {suffix!r} (use {', '.join(FILE_SUFFIXES)} or a "
                         "folder saved by the datasets library)")
    if not rows:
        raise ValueError(f"{dataset}: empty dataset")
    return rows


def _jsonl_rows(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {n}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _datasets():
    """The ``datasets`` library, offline (it is imported only for the formats it reads)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    return datasets


def _hf_file_rows(path: Path, suffix: str) -> list[dict]:
    ds = _datasets()
    try:
        if suffix == ".arrow":
            table = ds.Dataset.from_file(str(path), in_memory=True)
        else:
            reader = ds.Dataset.from_json if suffix == ".json" else ds.Dataset.from_csv
            table = reader(str(path), keep_in_memory=True)
    except Exception as e:  # noqa: BLE001 - the library's parse errors have no common base
        raise ValueError(f"{path}: not readable as {suffix[1:]} ({type(e).__name__}: {str(e)[:200]})") from None
    return table.to_list()


def _folder_rows(path: Path, split: str | None) -> list[dict]:
    ds = _datasets()
    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            data = ds.load_from_disk(str(path), keep_in_memory=True)
        else:
            data = ds.load_dataset(str(path), keep_in_memory=True)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path}: not a dataset folder the datasets library reads ({type(e).__name__}: "
                         f"{str(e)[:200]})") from None
    if isinstance(data, ds.Dataset):
        if split is not None:
            raise ValueError(f"{path}:{split}: the folder holds one dataset, not splits: name the folder alone")
        return data.to_list()
    splits = list(data)
    if split is None and len(splits) == 1:
        split = splits[0]
    if split not in splits:
        how = f"':{split}' is not one of them" if split else f"choose one, e.g. {path}:{splits[0]}"
        raise ValueError(f"{path}: holds the splits {', '.join(splits)}: {how}")
    return data[split].to_list()
