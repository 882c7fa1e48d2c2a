"""Where the archive lives: a local folder or any URI that pyarrow.fs resolves (file://, s3://, gs://, hdfs://).

Files are written whole and appear at once. In a local folder: a ``<name>.tmp-<uuid>`` file in the final folder,
fsynced and renamed with ``os.replace``. In an object store, which has no rename: the complete bytes in one
upload, which becomes visible only when it completes. A crashed write leaves nothing that a listing returns: a
``.tmp-`` file no pattern here matches, or an unfinished multipart upload (invisible; a bucket lifecycle rule
removes it). Object stores read back what was written (S3, GCS and SeaweedFS list and read after write).

Credentials and endpoint are pyarrow's: for s3://, the AWS SDK's default chain (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, an instance or pod role; AWS_ENDPOINT_URL, AWS_REGION)
and the URI's query options (``?endpoint_override=host:9000&scheme=http&region=…``). Credentials written into
the URI are refused: the URI shows up in configs, logs and manifests.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import tempfile
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.errors import InputError

SCHEMES = "a folder, file://, s3://bucket/prefix, gs://bucket/prefix or hdfs://host/path"


class ArchiveLocationError(InputError):
    """An archive root that cannot be used: unknown scheme, credentials in the URI, unreachable store, no bucket."""


@dataclass(frozen=True)
class ArchiveRoot:
    """The archive root as given (``uri``), the filesystem it resolves to and the root's path inside it."""

    uri: str
    fs: pafs.FileSystem
    base: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def __str__(self) -> str:
        return self.base if self.is_local else self.uri

    def path(self, relative: str) -> str:
        """The filesystem path of ``relative`` (a ``/``-separated path under the root)."""
        return f"{self.base}/{relative}"

    def location(self, relative: str) -> str:
        """Where ``relative`` is, as a person would name it: a local path or a URI."""
        return self.path(relative) if self.is_local else f"{self.uri.split('?')[0].rstrip('/')}/{relative}"

    def check(self) -> None:
        """Raise ArchiveLocationError unless the store answers and the root's bucket (where it has one) exists."""
        if self.is_local:  # folders are created by the first write, under the nearest folder that exists
            existing = self.base
            while not os.path.exists(existing):
                existing = os.path.dirname(existing)
            if not os.path.isdir(existing):
                raise ArchiveLocationError(f"archive {self.base}: {existing} is a file, not a folder; name a folder "
                                           "(created at the first write) or a URI")
            return
        bucket = self.base.split("/", 1)[0]
        if self._info(bucket).type == pafs.FileType.NotFound:
            raise ArchiveLocationError(f"archive {self.uri}: bucket {bucket!r} does not exist; create it (runs never "
                                       "create buckets) or fix the URI")

    def glob(self, pattern: str) -> list[str]:
        """Relative paths of the files matching ``pattern`` (``*`` within one path segment), sorted."""
        parts = pattern.split("/")
        fixed = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts))
        folder = self.path("/".join(parts[:fixed])) if fixed else self.base
        start = len(folder) + 1
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True))
        except OSError as err:
            raise self._unreachable(err) from err
        found = []
        for info in infos:
            rest = info.path[start:].split("/")
            if info.type == pafs.FileType.File and len(rest) == len(parts) - fixed and all(
                    fnmatch.fnmatchcase(name, p) for name, p in zip(rest, parts[fixed:], strict=True)):
                found.append("/".join([*parts[:fixed], *rest]))
        return sorted(found)

    def exists(self, relative: str) -> bool:
        return self._info(self.path(relative)).type == pafs.FileType.File

    def read(self, relative: str) -> pa.Buffer:
        with self.fs.open_input_file(self.path(relative)) as f:
            return f.read_buffer()

    def write(self, relative: str, data: bytes | pa.Buffer) -> str:
        """Write ``data`` to ``relative`` so that no reader and no crash ever sees part of it; returns its location."""
        if self.is_local:
            with self.open_whole(relative) as out:
                out.write(data)
        else:
            with self.fs.open_output_stream(self.path(relative)) as out:  # one upload: visible once it completes
                out.write(data)
        return self.location(relative)

    @contextmanager
    def open_whole(self, relative: str) -> Iterator[BinaryIO]:
        """A stream whose bytes appear at ``relative`` all at once when the block ends without an error, and never
        in part: a file too large to build in memory first, written piece by piece."""
        path = self.path(relative)
        if not self.is_local:
            # Spooled to a local file, then sent in one upload (visible once it completes): closing a stream that
            # an error interrupted would complete the upload with what it held.
            with tempfile.TemporaryFile() as spool:
                yield spool
                spool.seek(0)
                with self.fs.open_output_stream(path) as out:
                    shutil.copyfileobj(spool, out, 1 << 24)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        # The rename itself is durable only once the directory entry is synced.
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _info(self, path: str) -> pafs.FileInfo:
        try:
            return self.fs.get_file_info(path)
        except OSError as err:
            raise self._unreachable(err) from err

    def _unreachable(self, err: OSError) -> ArchiveLocationError:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return ArchiveLocationError(
            f"archive {self.uri}: {first}; check the endpoint (AWS_ENDPOINT_URL or the URI's endpoint_override) and "
            "the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")


def open_root(root: str | os.PathLike[str] | ArchiveRoot) -> ArchiveRoot:
    """The archive root named by a folder or a URI; a URI pyarrow cannot resolve raises ArchiveLocationError."""
    if isinstance(root, ArchiveRoot):
        return root
    uri = os.fspath(root)
    if "://" not in uri:
        return ArchiveRoot(uri, pafs.LocalFileSystem(), os.path.abspath(uri))
    parsed = urllib.parse.urlsplit(uri)
    if parsed.username or parsed.password:
        raise ArchiveLocationError(f"archive {parsed.scheme}://…@{parsed.hostname}{parsed.path}: credentials in the URI "
                                   "would be kept in configs, logs and manifests; set AWS_ACCESS_KEY_ID and "
                                   "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead")
    try:
        fs, base = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, OSError) as err:
        raise ArchiveLocationError(f"archive {uri}: {err}; use {SCHEMES}") from err
    return ArchiveRoot(uri, fs, base.rstrip("/"))

