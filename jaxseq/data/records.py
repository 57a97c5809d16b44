"""A user's data file as a list of records (dicts): csv/tsv with a header row, a JSON list, or JSONL."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from jaxseq.errors import JaxseqError

SUFFIXES = (".csv", ".tsv", ".json", ".jsonl")


def read_records(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise JaxseqError(f"file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        with open(path, encoding="utf-8-sig", newline="") as f:
            return list(csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ","))
    if suffix in (".json", ".jsonl"):
        text = path.read_text(encoding="utf-8")
        try:
            if text.lstrip().startswith("["):
                return json.loads(text)
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise JaxseqError(f"{path} is not valid JSON/JSONL: {e}") from None
    raise JaxseqError(f"{path}: unsupported file type {suffix!r}; use {', '.join(SUFFIXES)}")


def require_columns(records: list[dict], columns: list[str], path) -> None:
    """One line naming the missing columns (and the ones the file has) if the first record lacks any."""
    if records:
        missing = [c for c in columns if c not in records[0]]
        if missing:
            raise JaxseqError(f"{path} lacks column(s) {', '.join(missing)}; it has {', '.join(records[0])}")
