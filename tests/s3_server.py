"""A real S3 server on loopback for the tests (moto's standalone server, as s3fs's own tests
use it): started once per test process, a fresh bucket per test, stopped and started again
on the same port for the fault drills (its objects live in this process's memory, so they
outlast a restart). The credentials are fake but unique: a test greps everything a run
wrote for the secret."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SECRET = f"scaletrain-test-secret-{secrets.token_hex(8)}"


@dataclass
class S3:
    port: int
    server: Any
    bucket: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(key=self.env["AWS_ACCESS_KEY_ID"], secret=SECRET, endpoint_url=self.endpoint)

    def upload(self, local: Path, prefix: str) -> str:
        """A local prepared directory copied under `prefix`; its URL."""
        fs = self.fs()
        for f in sorted(Path(local).iterdir()):
            fs.put_file(str(f), f"{self.bucket}/{prefix}/{f.name}")
        return self.url(prefix)

    def listing(self, prefix: str) -> list[str]:
        """The names right under `prefix` now (step_N, hf), sorted."""
        fs = self.fs()
        fs.invalidate_cache()
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{self.bucket}/{prefix}"))

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        for _ in range(50):  # the port may linger a moment after the stop
            try:
                self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
                self.server.start()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"the S3 server did not start again on port {self.port}")


def start_server() -> S3:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "scaletrain-test-key",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    return S3(port, server, env=env)


def with_bucket(s3: S3, name: str) -> S3:
    s3.bucket = name
    s3.fs().mkdir(name)
    return s3


def environment(s3: S3) -> dict[str, str]:
    return {**os.environ, **s3.env}
