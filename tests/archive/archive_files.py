"""Files of an archive root (a folder or an s3:// prefix) seen through pyarrow.fs directly, not through the code
under test: what the tests list, delete, copy and write behind the archive's back."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq


def resolve(root: str, relative: str = "") -> tuple[pafs.FileSystem, str]:
    fs, base = pafs.FileSystem.from_uri(root)
    return fs, f"{base.rstrip('/')}/{relative}".rstrip("/")


def listing(root: str, under: str = "") -> list[str]:
    """Every file below ``under``, relative to the root, sorted."""
    fs, path = resolve(root, under)
    _, base = resolve(root)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return sorted(i.path[len(base) + 1:] for i in infos if i.type == pafs.FileType.File)


def remove(root: str, relative: str) -> None:
    """Delete one file, or every file below a folder."""
    fs, path = resolve(root, relative)
    if fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)
    else:
        fs.delete_dir(path)


def copy(source: str, target: str) -> None:
    """Copy every file of one root to another of the same filesystem (in S3: one CopyObject a file)."""
    fs, path_from = resolve(source)
    _, path_to = resolve(target)
    for relative in listing(source):
        if isinstance(fs, pafs.LocalFileSystem):
            fs.create_dir(f"{path_to}/{relative}".rsplit("/", 1)[0])
        fs.copy_file(f"{path_from}/{relative}", f"{path_to}/{relative}")


def read_parquet(root: str, relative: str) -> pa.Table:
    fs, path = resolve(root, relative)
    return pq.read_table(path, filesystem=fs)


def write_parquet(root: str, relative: str, table: pa.Table) -> None:
    fs, path = resolve(root, relative)
    fs.create_dir(path.rsplit("/", 1)[0])
    pq.write_table(table, path, filesystem=fs)


def hive(root: str, folder: str, partitions: tuple[str, ...] = ("run_id", "workload", "cache")) -> ds.Dataset:
    """The Parquet files under ``folder``, hive partitions read as text, for DuckDB to query (``duckdb.sql`` finds
    a dataset by its Python variable name)."""
    fs, path = resolve(root, folder)
    partitioning = ds.partitioning(pa.schema([(name, pa.string()) for name in partitions]), flavor="hive")
    return ds.dataset(path, filesystem=fs, format="parquet", partitioning=partitioning)
