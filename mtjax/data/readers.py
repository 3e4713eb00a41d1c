"""Input files as rows: JSONL, JSON arrays, CSV, Parquet, Arrow shards, a `datasets` folder written
by `save_to_disk`, and plain text files (one document each), read in batches so that a large source
never sits in memory whole (JSON arrays excepted: they are parsed whole; use JSONL for big data).

Each row comes with where it is (`file:line` for text formats, `file:row N` for columnar ones), the
place a skipped row is reported by.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Iterator

_BATCH_ROWS = 4096  # rows per record batch read from Parquet and Arrow files


class BadFile(ValueError):
  """A whole input file that cannot be read as its kind (a .parquet that is not Parquet, ...)."""


class BadRow(ValueError):
  """One row that cannot be read (bad JSON, not an object); `reason` groups such rows in stats."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


def _pyarrow():
  try:
    import pyarrow
  except ImportError:
    raise ValueError("reading Parquet, Arrow or datasets folders needs pyarrow: pip install "
                     "pyarrow") from None
  return pyarrow


def kind(path: Path) -> str:
  """What a path holds, from its name: datasets, parquet, arrow, jsonl, json, csv or text."""
  if path.is_dir():
    return "datasets"
  suffix = path.suffix.lower()
  return {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "jsonl", ".ndjson": "jsonl",
          ".json": "json", ".csv": "csv", ".tsv": "csv"}.get(suffix, "text")


def is_datasets_folder(path: Path) -> bool:
  """A folder `datasets.Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` wrote."""
  return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _datasets_files(folder: Path) -> list[Path]:
  """The Arrow files of a save_to_disk folder in order; a DatasetDict gives its train split."""
  if (folder / "dataset_dict.json").is_file():
    try:
      splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise BadFile(f"{folder}: unreadable dataset_dict.json ({e})") from None
    if "train" not in splits:
      raise BadFile(f"{folder}: a DatasetDict without a 'train' split (splits: "
                    f"{', '.join(splits)}); pass {folder}/SPLIT")
    folder = folder / "train"
  try:
    state = json.loads((folder / "state.json").read_text())
    names = [f["filename"] for f in state["_data_files"]]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise BadFile(f"{folder}: unreadable state.json of a datasets folder ({e})") from None
  if state.get("_indices_data_files"):
    raise BadFile(f"{folder}: a datasets folder with an indices mapping; save it after "
                  "flatten_indices()")
  return [folder / n for n in names]


def _arrow_batches(path: Path) -> Iterator:
  """The record batches of an Arrow IPC file (stream format, as datasets writes it, or file)."""
  pa = _pyarrow()
  try:
    source = pa.memory_map(str(path), "r")
    try:
      reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
      source.seek(0)
      f = pa.ipc.open_file(source)
      reader = (f.get_batch(i) for i in range(f.num_record_batches))
    yield from reader
  except (pa.ArrowException, OSError) as e:
    raise BadFile(f"{path}: not an Arrow file ({' '.join(str(e).split())})") from None


def _parquet_batches(path: Path) -> Iterator:
  pa = _pyarrow()
  import pyarrow.parquet as pq
  try:
    f = pq.ParquetFile(str(path))
    yield from f.iter_batches(batch_size=_BATCH_ROWS)
  except (pa.ArrowException, OSError) as e:
    raise BadFile(f"{path}: not a Parquet file ({' '.join(str(e).split())})") from None


def _columnar_rows(path: Path, batches: Iterator) -> Iterator[tuple[str, dict]]:
  n = 0
  for batch in batches:
    for row in batch.to_pylist():
      n += 1
      yield f"{path}:row {n}", row


def _lines(path: Path) -> Iterator[tuple[int, str]]:
  try:
    with open(path, encoding="utf-8") as f:
      for lineno, line in enumerate(f, 1):
        yield lineno, line
  except UnicodeDecodeError as e:
    raise BadFile(f"{path}: unreadable as UTF-8 text ({e})") from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
  for lineno, line in _lines(path):
    if not line.strip():
      continue
    where = f"{path}:{lineno}"
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      yield where, BadRow("bad JSON", f"{where}: bad JSON ({e.msg} at column {e.colno})")
      continue
    if not isinstance(obj, dict):
      yield where, BadRow("not an object", f"{where}: expected a JSON object, got "
                          f"{type(obj).__name__}")
      continue
    yield where, obj


def _json_rows(path: Path) -> Iterator[tuple[str, dict]]:
  """A .json file: an array of objects (parsed whole), or JSON lines under a .json name."""
  with open(path, encoding="utf-8", errors="replace") as f:
    head = f.read(4096).lstrip()
  if not head.startswith("["):
    yield from _jsonl_rows(path)
    return
  try:
    items = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadFile(f"{path}: not a JSON array of objects ({e})") from None
  for i, obj in enumerate(items):
    where = f"{path}:[{i}]"
    if not isinstance(obj, dict):
      yield where, BadRow("not an object", f"{where}: expected a JSON object, got "
                          f"{type(obj).__name__}")
    else:
      yield where, obj


def _csv_rows(path: Path) -> Iterator[tuple[str, dict]]:
  delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
  try:
    with open(path, encoding="utf-8", newline="") as f:
      reader = csv.DictReader(f, delimiter=delimiter)
      line = reader.line_num + 1
      for row in reader:
        where = f"{path}:{line}"
        line = reader.line_num + 1
        if None in row:  # more fields than the header names
          yield where, BadRow("bad CSV", f"{where}: {len(row) - 1 + len(row[None])} fields; the "
                              f"header names {len(reader.fieldnames)}")
          continue
        yield where, row
  except UnicodeDecodeError as e:
    raise BadFile(f"{path}: unreadable as UTF-8 text ({e})") from None
  except csv.Error as e:
    raise BadFile(f"{path}: not a CSV file ({e})") from None


def rows(path: Path) -> Iterator[tuple[str, dict | BadRow]]:
  """Yields (where, row) of a row file or folder in order; a row that cannot be read is a BadRow.

  Raises:
    BadFile: the file is not what its name says (checked when iteration reaches it).
  """
  k = kind(path)
  if k == "datasets":
    if not is_datasets_folder(path):
      raise BadFile(f"{path}: a folder that is not a datasets save_to_disk folder")
    for f in _datasets_files(path):
      yield from _columnar_rows(f, _arrow_batches(f))
  elif k == "parquet":
    yield from _columnar_rows(path, _parquet_batches(path))
  elif k == "arrow":
    yield from _columnar_rows(path, _arrow_batches(path))
  elif k == "json":
    yield from _json_rows(path)
  elif k == "csv":
    yield from _csv_rows(path)
  else:  # jsonl, or any other name read as JSON lines
    yield from _jsonl_rows(path)


def count(path: Path, whole: bool) -> int:
  """The rows a file holds (1 where `whole`: the file is one document), without converting them:
  Parquet from its metadata, Arrow from its batches' headers, line formats by a pass over them."""
  k = kind(path)
  if whole:
    try:
      path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
      raise BadFile(f"{path}: unreadable as UTF-8 text ({e})") from None
    return 1
  if k == "parquet":
    pa = _pyarrow()
    import pyarrow.parquet as pq
    try:
      return pq.ParquetFile(str(path)).metadata.num_rows
    except (pa.ArrowException, OSError) as e:
      raise BadFile(f"{path}: not a Parquet file ({' '.join(str(e).split())})") from None
  if k in ("arrow", "datasets"):
    files = [path] if k == "arrow" else (
        _datasets_files(path) if is_datasets_folder(path) else None)
    if files is None:
      raise BadFile(f"{path}: a folder that is not a datasets save_to_disk folder")
    return sum(b.num_rows for f in files for b in _arrow_batches(f))
  if k == "csv":
    return sum(1 for _ in _csv_rows(path))
  if k == "json":
    return sum(1 for _ in _json_rows(path))
  return sum(1 for _, line in _lines(path) if line.strip())


def read_text(path: Path) -> str:
  """A text file's content: the whole file is one document."""
  try:
    return path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise BadFile(f"{path}: unreadable as UTF-8 text ({e})") from None


def input_files(name: str) -> list[Path]:
  """The files an input names: a file, a datasets folder, or a folder (recursive, sorted, hidden
  files left out) of files."""
  p = Path(name)
  if p.is_dir():
    if is_datasets_folder(p):
      return [p]
    found = sorted(f for f in p.rglob("*") if f.is_file()
                   and not any(part.startswith(".") for part in f.relative_to(p).parts))
    if not found:
      raise ValueError(f"{p}: folder holds no files")
    for f in found:
      if f.stat().st_size == 0:
        raise ValueError(f"{f}: empty file")
    return found
  if p.is_file():
    if p.stat().st_size == 0:
      raise ValueError(f"{p}: empty file")
    return [p]
  raise FileNotFoundError(f"{p}: no such file or folder")
