"""Where a generate run's rows come from, and how they are cut into shards without the driver holding them.

SRC is a JSON-lines file (``.jsonl``, ``.json``, ``.ndjson``) or a Parquet file, a folder of them (every such file
below it), a glob (``data/part-*.parquet``), any of these behind a URI that pyarrow resolves (``s3://``, ``gs://``,
``file://``), or a Hugging Face dataset id (``owner/name``, read with ``datasets``, one ``split``). Rows are
numbered across files in path order; a shard is a range of rows within one file, so it reads only its own part:
a byte range of JSON lines, the row groups of a Parquet file that hold its rows, a slice of the dataset's
memory-mapped Arrow table.

The driver plans in one streaming pass (``plan``): it counts rows, cuts shards every ``shard_size`` rows, takes each
row's id and remembers the first row of every id, so that a later row with the same id is known as a duplicate
before any actor starts; it keeps offsets and ids, never the prompts. JSON lines are parsed one by one with
Python's json: pyarrow's JSON reader infers one schema for a whole file and fails it on a single row of another
type, which is exactly the bad row that must become one error row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Literal

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.archive_root import ArchiveLocationError, open_root
from pipeline.errors import InputError
from pipeline.model_specs import HUB_ID

FileFormat = Literal["jsonl", "parquet", "hub"]
SUFFIXES: dict[str, FileFormat] = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
_SAMPLE = 100  # records looked at to check columns and detect the OpenAI batch format
_BLOCK = 1 << 24


class SourceError(InputError):
    """An input that cannot be read: nothing at SRC, an unknown file type, a JSON array, a missing column."""


@dataclass(frozen=True)
class Source:
    """SRC resolved: files under a folder or URI, or a Hub dataset."""

    spec: str  # as given
    root: str | None = None  # the folder or URI the files are under
    files: tuple[str, ...] = ()  # relative to root, in path order
    dataset: str | None = None  # a Hub dataset id
    split: str = "train"

    def describe(self) -> str:
        return f"dataset {self.dataset} ({self.split})" if self.dataset else f"{len(self.files)} file(s) under {self.root}"


@dataclass(frozen=True)
class InputShard:
    """A range of input rows within one file (or the dataset): the unit of work, resume and retry."""

    index: int
    file: str | None  # relative to the source's root; None: the Hub dataset
    format: FileFormat
    first_row: int  # the run-wide number of its first row
    start: int  # JSON lines: the byte offset of its first line; otherwise its first row within the file
    stop: int  # the end of that range (exclusive)
    rows: int
    duplicates: dict[int, tuple[str, int]] = field(default_factory=dict)  # row -> (its id, the id's first row)


@dataclass(frozen=True)
class InputPlan:
    source: Source
    record_format: Literal["columns", "openai"]
    shards: list[InputShard]
    rows: int
    fingerprint: str  # of the contents as planned: a resumed run must read the same rows

    def describe(self) -> dict[str, Any]:
        """What the manifest keeps of the input."""
        return dict(source=self.source.spec, files=list(self.source.files), dataset=self.source.dataset,
                    split=self.source.split if self.source.dataset else None, format=self.record_format,
                    rows=self.rows, shards=len(self.shards), fingerprint=self.fingerprint,
                    duplicate_ids=sum(len(s.duplicates) for s in self.shards))


def resolve(spec: str, split: str = "train") -> Source:
    """The files (or the dataset) SRC names; SourceError where it names nothing readable."""
    parent, pattern = _split_glob(spec)
    try:
        root = open_root(parent)
        if pattern is not None:
            files = root.glob(pattern)
        else:
            info = root.fs.get_file_info(root.base)
            if info.type == pafs.FileType.File:
                root, files = open_root(_parent(spec)), [PurePosixPath(root.base).name]
            elif info.type == pafs.FileType.Directory:
                files = _inputs_below(root)
            elif "://" not in spec and HUB_ID.fullmatch(spec):
                return Source(spec, dataset=spec, split=split)
            else:
                raise SourceError(f"input {spec}: no such file or folder, and not a Hugging Face dataset id "
                                  "(owner/name); pass a .jsonl or .parquet file, a folder or glob of them, or a URI")
    except (ArchiveLocationError, OSError) as err:
        raise SourceError(f"input {spec}: {err}") from None
    if not files:
        raise SourceError(f"input {spec}: no {', '.join(SUFFIXES)} file there")
    unknown = [f for f in files if PurePosixPath(f).suffix not in SUFFIXES]
    if unknown:
        raise SourceError(f"input {spec}: {unknown[0]} is neither JSON lines nor Parquet ({', '.join(SUFFIXES)})")
    return Source(spec, root.uri if "://" in root.uri else root.base, tuple(files), split=split)


def _inputs_below(root) -> list[str]:
    """The JSON-lines and Parquet files anywhere below the folder, relative to it, in path order."""
    infos = root.fs.get_file_info(pafs.FileSelector(root.base, recursive=True))
    return sorted(i.path[len(root.base) + 1 :] for i in infos if i.type == pafs.FileType.File
                  and PurePosixPath(i.path).suffix in SUFFIXES and not PurePosixPath(i.path).name.startswith("."))


def _split_glob(spec: str) -> tuple[str, str | None]:
    """(the folder or URI before the first segment with a wildcard, the pattern below it)."""
    path, query = _query(spec)
    scheme, sep, rest = path.rpartition("://")
    parts = rest.split("/")
    wild = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), None)
    if wild is None:
        return spec, None
    return scheme + sep + ("/".join(parts[:wild]) or ".") + query, "/".join(parts[wild:])


def _parent(spec: str) -> str:
    """The folder or URI (its options kept) holding the file ``spec`` names."""
    path, query = _query(spec)
    head = path.rstrip("/").rpartition("/")[0]
    return (head or ("/" if path.startswith("/") else ".")) + query


def _query(spec: str) -> tuple[str, str]:
    """A URI without its ``?options``, and those options (empty for a path)."""
    if "://" not in spec or "?" not in spec:
        return spec, ""
    path, _, options = spec.partition("?")
    return path, "?" + options


def file_format(source: Source, file: str | None) -> FileFormat:
    return "hub" if file is None else SUFFIXES[PurePosixPath(file).suffix]


def sample_records(source: Source, n: int = _SAMPLE) -> list[dict[str, Any]]:
    """The first records of the first file (JSON objects only): what the checks before a run look at."""
    file = source.files[0] if source.files else None
    fmt = file_format(source, file)
    if fmt == "jsonl":
        root = open_root(source.root)
        with root.fs.open_input_stream(root.path(file)) as f:
            head = f.read(_BLOCK)
        if head.lstrip()[:1] == b"[":
            raise SourceError(f"input {source.spec}: {file} is a JSON array; kivi-eval generate reads JSON lines, one "
                              f"object per line (e.g. jq -c '.[]' {PurePosixPath(file).name} > prompts.jsonl)")
        records = [_parse(line) for _, line in _lines(head.rsplit(b"\n", 1)[0] if len(head) == _BLOCK else head)]
        return [r for r in records if isinstance(r, dict)][:n]
    if fmt == "parquet":
        return next(_parquet_file(source, file).iter_batches(batch_size=n)).to_pylist()
    return load_hub(source).data.slice(0, n).to_pylist()


def columns(source: Source) -> list[str] | None:
    """The columns every record has (Parquet and Hub datasets); None for JSON lines, whose records may differ."""
    file = source.files[0] if source.files else None
    fmt = file_format(source, file)
    if fmt == "parquet":
        return _parquet_file(source, file).schema_arrow.names
    return load_hub(source).column_names if fmt == "hub" else None


def plan(source: Source, record_format: Literal["columns", "openai"], id_field: str, shard_size: int,
         required: tuple[str, ...] = ()) -> InputPlan:
    """The run's shards in one streaming pass over the input, with every duplicate id found; a Parquet file or Hub
    dataset without the id column or one of ``required`` is refused (a JSON line without one is an error row)."""
    ids: dict[str, int] = {}  # id -> its first row
    duplicates: dict[int, tuple[str, int]] = {}
    digest = hashlib.blake2b(digest_size=8)
    shards: list[InputShard] = []
    row = 0
    for file in source.files or (None,):
        fmt = file_format(source, file)
        digest.update(f"{file or source.dataset}\n".encode())
        first, starts, end = row, [], 0  # starts: (first row, position) of each of the file's shards
        for position, value in _SCANS[fmt](source, file, (id_field, *required), digest):
            if value is _END:
                end = position
                continue
            if (row - first) % shard_size == 0:
                starts.append((row, position))
            if (key := row_id(value)) is not None:
                if key in ids:
                    duplicates[row] = (key, ids[key])
                else:
                    ids[key] = row
            row += 1
        for i, (first_row, start) in enumerate(starts):
            next_row, stop = starts[i + 1] if i + 1 < len(starts) else (row, end)
            mine = {r: d for r, d in duplicates.items() if first_row <= r < next_row}
            shards.append(InputShard(len(shards), file, fmt, first_row, start, stop, next_row - first_row, mine))
    return InputPlan(source, record_format, shards, row, digest.hexdigest())


def row_id(value: Any) -> str | None:
    """A record's id as text: strings as they are, integers in decimal; None for anything else (missing, null)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


_END = object()  # a scan's last item: (the file's end: its size in bytes or its rows, _END)


def _scan_jsonl(source: Source, file: str, fields: tuple[str, ...], digest) -> Iterator[tuple[int, Any]]:
    """(byte offset, id value) of each line, read in blocks."""
    id_field = fields[0]
    root = open_root(source.root)
    offset, tail = 0, b""  # offset: where tail starts in the file
    with root.fs.open_input_stream(root.path(file)) as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
            data = tail + block
            cut = data.rfind(b"\n") + 1  # up to the last complete line
            for at, line in _lines(data[:cut]):
                yield offset + at, _field(_parse(line), id_field)
            offset, tail = offset + cut, data[cut:]
    for at, line in _lines(tail):
        yield offset + at, _field(_parse(line), id_field)
    yield offset + len(tail), _END


def _scan_parquet(source: Source, file: str, fields: tuple[str, ...], digest) -> Iterator[tuple[int, Any]]:
    """(row within the file, id value), reading the id column only."""
    parquet = _parquet_file(source, file)
    _require(source, file, fields, parquet.schema_arrow.names)
    id_field = fields[0]
    digest.update(json.dumps(parquet.metadata.to_dict(), sort_keys=True, default=str).encode())
    values = (v for batch in parquet.iter_batches(columns=[id_field]) for v in batch.column(0).to_pylist())
    yield from enumerate(values)
    yield parquet.metadata.num_rows, _END


def _scan_hub(source: Source, file: None, fields: tuple[str, ...], digest) -> Iterator[tuple[int, Any]]:
    dataset = load_hub(source)
    _require(source, "the dataset", fields, dataset.column_names)
    digest.update(dataset._fingerprint.encode())  # datasets' own hash of the prepared data
    yield from enumerate(v for chunk in dataset.data.column(fields[0]).chunks for v in chunk.to_pylist())
    yield dataset.num_rows, _END


_SCANS = {"jsonl": _scan_jsonl, "parquet": _scan_parquet, "hub": _scan_hub}


def _require(source: Source, where: str, fields: tuple[str, ...], names: list[str]) -> None:
    missing = [f for f in fields if f not in names]
    if missing:
        flag = "--id-column" if missing[0] == fields[0] else "--prompt-column or --messages-column"
        raise SourceError(f"input {source.spec}: {where} has no column {missing[0]!r} (columns: {', '.join(names)}); "
                          f"name the column with {flag}")


def _field(record: Any, name: str) -> Any:
    return record.get(name) if isinstance(record, dict) else None


def read_shard(source: Source, shard: InputShard, columns: list[str] | None = None) -> list[tuple[int, Any]]:
    """(row, record) of each row of ``shard``: a dict, or for a line that is no JSON object, its text."""
    if shard.format == "jsonl":
        root = open_root(source.root)
        with root.fs.open_input_file(root.path(shard.file)) as f:
            data = f.read_at(shard.stop - shard.start, shard.start)
        records = [_parse(line) for _, line in _lines(data)]
    elif shard.format == "parquet":
        records = _parquet_rows(_parquet_file(source, shard.file), shard.start, shard.stop, columns)
    else:
        table = load_hub(source).data.slice(shard.start, shard.stop - shard.start)
        records = (table.select(columns) if columns else table).to_pylist()
    if len(records) != shard.rows:
        raise SourceError(f"input {source.spec}: shard {shard.index} of {shard.file or source.dataset} holds "
                          f"{len(records)} rows, {shard.rows} when the run was planned: the input changed")
    return list(enumerate(records, start=shard.first_row))


def _parquet_rows(parquet: pq.ParquetFile, start: int, stop: int, columns: list[str] | None) -> list[dict]:
    """Rows [start, stop) of the file, reading only the row groups that hold them."""
    groups, first, begin = [], None, 0
    for i in range(parquet.metadata.num_row_groups):
        end = begin + parquet.metadata.row_group(i).num_rows
        if begin < stop and end > start:
            groups.append(i)
            first = begin if first is None else first
        begin = end
    table = parquet.read_row_groups(groups, columns=columns)
    return table.slice(start - first, stop - start).to_pylist()


def _parquet_file(source: Source, file: str) -> pq.ParquetFile:
    root = open_root(source.root)
    return pq.ParquetFile(root.fs.open_input_file(root.path(file)))


_HUB: dict[tuple[str, str], Any] = {}  # one load per process: datasets memory-maps its Arrow files


def load_hub(source: Source):
    """The Hub dataset's split (``datasets.load_dataset``; downloaded once into the Hugging Face cache)."""
    key = (source.dataset, source.split)
    if key not in _HUB:
        import datasets

        try:
            _HUB[key] = datasets.load_dataset(source.dataset, split=source.split)
        except Exception as err:  # datasets raises many kinds (not found, no such split, offline …)
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise SourceError(f"input {source.spec}: no such file or folder, and the Hugging Face dataset "
                              f"{source.dataset} (split {source.split!r}) cannot be loaded: {type(err).__name__}: "
                              f"{first}; check the path, or the dataset id and --split") from None
    return _HUB[key]


def _lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the non-blank lines of ``data``; only \\n ends a line (a raw U+2028 may sit in a string)."""
    offset = 0
    for line in data.split(b"\n"):
        if line.strip():
            yield offset, line
        offset += len(line) + 1


def _parse(line: bytes) -> Any:
    """A JSON line's value, or the line's text where it is no JSON (the worker turns it into an error row)."""
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return line.decode("utf-8", errors="replace")
