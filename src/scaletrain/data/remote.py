"""A prepared token directory read from object storage (data.paths=["s3://bucket/prefix"],
any fsspec URL: gs://, file://, ...) without a local copy.

Each rank reads only the byte ranges of its own samples, in aligned blocks of BLOCK_BYTES:
a window of seq_len + 1 tokens costs one or two ranged GETs, never the shard. Blocks stay
in a bounded cache (data.cache_bytes, in memory; under data.cache_dir on disk as well, for
later runs on the same node); the next step's blocks are fetched by a background thread
while this step computes (`read_ahead`), so the loop rarely waits on the store.

Every block is checked against the shard's block checksums (`<shard>.crc32`, written by
`scaletrain data prepare`: one little-endian CRC-32 per block), so a damaged or truncated
object is caught on the ranges read, not only by a whole-shard `verify`. A read that fails
(a dropped connection, a store restarting, a throttling answer) is retried with exponential
backoff for up to RETRY_S seconds; a missing object or a refused credential is not retried:
it is a one-line error at once. Credentials and the endpoint come from the environment the
store's library reads (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for an
S3-compatible store; GOOGLE_APPLICATION_CREDENTIALS for gs://): nothing here writes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.data.blocks import BLOCK_BYTES
from scaletrain.data.prepare import MANIFEST, check_manifest
from scaletrain.errors import UserError

RETRY_S = 120.0  # how long one block's read is retried before the run stops on it
CACHE_BYTES = 256 << 20  # data.cache_bytes' default


def open_store(url: str, what: str) -> tuple[Any, str]:
    """(fsspec filesystem, the path inside it) for `url`, or a one-line error naming what
    is missing (the store's package, the bucket, the credentials)."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as e:
        package = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}.get(url.split("://")[0], "")
        raise UserError(
            f"{what}={url!r} needs {package or 'the fsspec backend for its scheme'} ({e}); accepted: "
            f"pip install 'scaletrain[s3]' (s3://), or a local path"
        ) from None
    except ValueError as e:
        raise UserError(f"{what}={url!r}: {e}; accepted: a URL fsspec knows (s3://bucket/prefix, gs://, file://)") from None
    scheme = url.split("://", 1)[0]
    if scheme not in ("file", "local", "memory") and not root.strip("/"):
        raise UserError(f"{what}={url!r} names no bucket; accepted: {scheme}://bucket/prefix")
    return fs, root.rstrip("/")


def _fatal(error: BaseException) -> bool:
    """A failure no retry mends: the object or bucket is not there, the credentials are refused."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return True
    text = f"{type(error).__name__} {error}"
    return _no_credentials(error) or any(
        k in text for k in ("NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "ExpiredToken")
    )


def _no_credentials(error: BaseException) -> bool:
    """None found at all (botocore's NoCredentialsError, or a key without its secret): no
    retry brings them."""
    return type(error).__name__ in ("NoCredentialsError", "PartialCredentialsError")


# Where botocore looks for credentials, in its order: named (never their values) when none were found.
CREDENTIAL_SOURCES = (
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN), AWS_PROFILE, the files "
    "AWS_SHARED_CREDENTIALS_FILE or ~/.aws/credentials and AWS_CONFIG_FILE or ~/.aws/config, "
    "AWS_WEB_IDENTITY_TOKEN_FILE, a container or instance role"
)


def retried(call: Callable[[], Any], what: str, budget_s: float | None = None) -> Any:
    """`call()`, again after 0.25, 0.5, 1, ... 8 s while it fails with anything but a fatal
    error, for up to `budget_s` (RETRY_S) seconds in all; then a one-line error naming `what`."""
    budget_s = RETRY_S if budget_s is None else budget_s
    start, wait = time.monotonic(), 0.25
    while True:
        try:
            return call()
        except Exception as e:  # noqa: BLE001  # each backend raises its own; judged by _fatal
            if _fatal(e):
                if isinstance(e, FileNotFoundError):
                    raise UserError(f"{what}: not there ({_say(e)}); accepted: an existing object") from None
                if _no_credentials(e):
                    raise UserError(
                        f"{what}: no credentials found ({_say(e)}); looked at: {CREDENTIAL_SOURCES}; accepted: credentials "
                        "in one of them that may read it"
                    ) from None
                raise UserError(
                    f"{what}: the store refused the credentials in the environment ({_say(e)}); accepted: credentials "
                    "that may read it (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance role)"
                ) from None
            if time.monotonic() - start + wait > budget_s:
                raise UserError(f"{what}: still failing after {budget_s:.0f} s of retries ({_say(e)})") from None
            _tell(f"scaletrain: {what}: {_say(e)}; retrying for up to {budget_s:.0f} s")
            time.sleep(wait)
            wait = min(2 * wait, 8.0)


_told = [0.0]  # when the last retry was reported: one line per TELL_EVERY_S, not one per block


TELL_EVERY_S = 10.0


def _tell(line: str) -> None:
    if time.monotonic() - _told[0] >= TELL_EVERY_S:
        _told[0] = time.monotonic()
        print(line, file=sys.stderr, flush=True)


def _say(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")


class BlockCache:
    """Blocks of the dataset's objects, read through `fs` with retries, checked, kept up to
    `limit` bytes in memory (least recently used first out) and, with `directory`, on disk
    (the same bound; a later run reads them from there). Thread-safe: the read-ahead thread
    fills it while the loop reads from it."""

    def __init__(self, fs: Any, limit: int = CACHE_BYTES, directory: Path | None = None, block: int = BLOCK_BYTES):
        self.fs, self.limit, self.directory, self.block = fs, int(limit), directory, block
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self._sums: dict[str, np.ndarray | None] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="scaletrain-read-ahead")
        self._coming: dict[tuple[str, int], Future[bytes]] = {}  # blocks the read-ahead is fetching
        self.fetched = 0  # blocks read from the store (not from a cache)
        # On disk (data.cache_dir): each block a file, least recently used first out; what an
        # earlier run left is found again (oldest first by modification time).
        self._disk: OrderedDict[Path, int] = OrderedDict()
        self._disk_held = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            for _, f in sorted((p.stat().st_mtime_ns, p) for p in directory.iterdir() if ".tmp" not in p.name):
                self._disk[f] = f.stat().st_size
                self._disk_held += self._disk[f]

    def checksums(self, path: str, sums: str | None) -> None:
        """Register `path`'s block checksums object (None: a dataset prepared before them)."""
        if sums is None:
            self._sums[path] = None
            return
        raw = retried(lambda: self.fs.cat_file(sums), f"reading {sums}")
        self._sums[path] = np.frombuffer(raw, dtype="<u4")

    def read(self, path: str, size: int, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the object `path` of `size` bytes."""
        first, last = start // self.block, (stop - 1) // self.block
        parts = [self._wait_or_get(path, size, b) for b in range(first, last + 1)]
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        offset = start - first * self.block
        return joined[offset : offset + stop - start]

    def ahead(self, wanted: Iterable[tuple[str, int, int, int]]) -> None:
        """Fetch the blocks of these (path, size, start, stop) ranges in the background."""
        blocks = {(p, s, b) for p, s, a, z in wanted for b in range(a // self.block, (z - 1) // self.block + 1)}
        for path, size, b in sorted(blocks):
            key = (path, b)
            with self._lock:
                if key in self._blocks or key in self._coming:
                    continue
                self._coming[key] = coming = self._pool.submit(self._get, path, size, b)
            coming.add_done_callback(partial(self._arrived, key))

    def _arrived(self, key: tuple[str, int], _: Future[bytes]) -> None:
        with self._lock:
            self._coming.pop(key, None)

    def _wait_or_get(self, path: str, size: int, b: int) -> bytes:
        """A block the read-ahead is fetching is waited for, not fetched twice."""
        with self._lock:
            coming = self._coming.get((path, b))
        if coming is not None:
            with contextlib.suppress(Exception):  # read here again: its own retries, and its error line
                coming.result()
        return self._get(path, size, b)

    def _get(self, path: str, size: int, b: int) -> bytes:
        key = (path, b)
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
                where = self._disk_path(path, b)
                if where is not None and where in self._disk:  # used: the disk's least recently used order is the use's, too
                    self._disk.move_to_end(where)
                return data
        data = self._from_disk(path, b)
        if data is None or not self._intact(path, b, data):
            lo, hi = b * self.block, min((b + 1) * self.block, size)
            data = retried(lambda: self._fetch(path, b, lo, hi), f"reading {path} bytes {lo}-{hi}")
            with self._lock:
                self.fetched += 1
            self._to_disk(path, b, data)
        with self._lock:
            if key not in self._blocks:
                self._blocks[key] = data
                self._held += len(data)
                while self._held > self.limit and len(self._blocks) > 1:
                    _, old = self._blocks.popitem(last=False)
                    self._held -= len(old)
        return data

    def _fetch(self, path: str, b: int, lo: int, hi: int) -> bytes:
        data = bytes(self.fs.cat_file(path, start=lo, end=hi))
        if len(data) != hi - lo:
            raise OSError(f"{len(data)} bytes returned for {hi - lo} asked")  # a short read: retried
        if not self._intact(path, b, data):
            # Read again (a transfer damaged on the way is retried); a stored object that
            # differs from its manifest stays different: retried() then stops the run.
            raise OSError(f"block {b} differs from its checksum in {path}.crc32 (the object changed since prepare?)")
        return data

    def _intact(self, path: str, b: int, data: bytes) -> bool:
        sums = self._sums.get(path)
        return sums is None or (b < len(sums) and zlib.crc32(data) == int(sums[b]))

    def _disk_path(self, path: str, b: int) -> Path | None:
        if self.directory is None:
            return None
        name = hashlib.sha256(f"{self.fs.protocol}:{path}".encode()).hexdigest()[:24]
        return self.directory / f"{name}.{b}"

    def _from_disk(self, path: str, b: int) -> bytes | None:
        where = self._disk_path(path, b)
        if where is None:
            return None
        with self._lock:
            if where not in self._disk:
                return None
            self._disk.move_to_end(where)
        try:
            return where.read_bytes()
        except FileNotFoundError:  # trimmed meanwhile, or removed by hand: read from the store
            return None

    def _to_disk(self, path: str, b: int, data: bytes) -> None:
        where = self._disk_path(path, b)
        if where is None:
            return
        tmp = where.with_suffix(f".tmp{threading.get_ident()}")
        tmp.write_bytes(data)
        tmp.replace(where)  # whole or absent: a killed run leaves no torn block
        with self._lock:
            self._disk_held += len(data) - self._disk.pop(where, 0)
            self._disk[where] = len(data)
            while self._disk_held > self.limit and len(self._disk) > 1:
                old, size = self._disk.popitem(last=False)
                self._disk_held -= size
                old.unlink(missing_ok=True)


class RemoteShard:
    """One shard object as the loader uses a memory-mapped one: its length in tokens,
    slices, and `windows` (rows of consecutive tokens), each read through the cache."""

    def __init__(self, cache: BlockCache, path: str, dtype: np.dtype, tokens: int):
        self.cache, self.path, self.dtype, self.tokens = cache, path, dtype, int(tokens)
        self.size = self.tokens * dtype.itemsize

    def __len__(self) -> int:
        return self.tokens

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(self.tokens)
        if step != 1:
            raise IndexError("a remote shard is read in consecutive ranges")
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        return np.frombuffer(
            self.cache.read(self.path, self.size, start * self.dtype.itemsize, stop * self.dtype.itemsize), dtype=self.dtype
        )

    def windows(self, offsets: np.ndarray, n: int) -> np.ndarray:
        """Rows [offset, offset + n) of the shard for each offset."""
        return np.stack([self[int(o) : int(o) + n] for o in offsets]) if len(offsets) else np.empty((0, n), self.dtype)

    def ranges(self, offsets: Iterable[int], n: int) -> list[tuple[str, int, int, int]]:
        """The byte ranges those rows read (for BlockCache.ahead)."""
        w = self.dtype.itemsize
        return [(self.path, self.size, int(o) * w, min(int(o) + n, self.tokens) * w) for o in offsets]


@dataclass(frozen=True)
class StoreOptions:
    """data.cache_dir, data.cache_bytes, and data.dir (where the tokenizer is copied: a
    local file the rest of the run can open)."""

    cache_dir: Path | None = None
    cache_bytes: int = CACHE_BYTES
    local_dir: Path = Path("data")


def store_options(data_cfg: Any) -> StoreOptions:
    """The config's data section -> how a URL's blocks are cached."""
    cache_dir = Path(data_cfg.cache_dir).expanduser() if data_cfg.cache_dir else None
    return StoreOptions(cache_dir, int(data_cfg.cache_bytes), Path(data_cfg.dir))


def upload_dataset(local: Path, url: str) -> None:
    """A prepared directory copied to `url`: the shards, their checksums and the tokenizer
    first, the manifest last (a reader finds a manifest only once everything it lists is
    there: a copy killed midway is no dataset, as on disk)."""
    fs, root = open_store(url, "--out")
    if retried(lambda: fs.exists(f"{root}/{MANIFEST}"), f"{url}/{MANIFEST}"):
        raise UserError(f"{url} already holds a prepared dataset ({MANIFEST}); accepted: another --out, or delete it first")
    files = sorted(p for p in Path(local).iterdir() if p.is_file() and p.name != MANIFEST)
    for f in [*files, Path(local) / MANIFEST]:
        retried(partial(fs.put_file, str(f), f"{root}/{f.name}"), f"writing {url}/{f.name}")


class RemoteDataset:
    """A prepared directory at `url`: its manifest, its tokenizer copied to a local file, and
    its shards as RemoteShard objects reading through one BlockCache."""

    def __init__(self, url: str, options: StoreOptions):
        self.url = url.rstrip("/")
        self.fs, self.root = open_store(self.url, "data.paths")
        where = f"{self.root}/{MANIFEST}"
        try:
            text = retried(lambda: self.fs.cat_file(where), f"{self.url}/{MANIFEST}")
        except UserError as e:
            if "not there" not in str(e):
                raise
            raise UserError(
                f"{self.url!r} has no {MANIFEST} (the bucket or prefix does not exist, or holds no prepared data); "
                "accepted: a directory made by `scaletrain data prepare`, copied there whole"
            ) from None
        self.manifest = check_manifest(bytes(text).decode(), f"{self.url}/{MANIFEST}")
        block = int(self.manifest.get("block_bytes", BLOCK_BYTES))
        self.cache = BlockCache(self.fs, options.cache_bytes, options.cache_dir, block)
        self.tokenizer = self._local_copy(self.manifest["tokenizer"], options.local_dir)

    def _local_copy(self, name: str, local_dir: Path) -> Path:
        """The tokenizer as a local file (each rank writes the same bytes; a rename makes it whole)."""
        key = hashlib.sha256(f"{self.url}:{self.manifest.get('tokenizer_sha256', '')}".encode()).hexdigest()[:12]
        where = Path(local_dir) / f"remote-{key}" / name
        if not where.is_file():
            data = retried(lambda: self.fs.cat_file(f"{self.root}/{name}"), f"{self.url}/{name}")
            where.parent.mkdir(parents=True, exist_ok=True)
            tmp = where.with_name(f"{name}.tmp{threading.get_ident()}-{id(self)}")
            tmp.write_bytes(bytes(data))
            tmp.replace(where)
        return where

    def shards(self, dtype: np.dtype) -> list[RemoteShard]:
        """The manifest's shards, their sizes checked against one listing of the prefix."""
        listing = retried(lambda: self.fs.ls(self.root, detail=True), f"listing {self.url}")
        sizes = {str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in listing}
        out = []
        for s in self.manifest["shards"]:
            name, expected = s["file"], int(s["tokens"]) * dtype.itemsize
            if name not in sizes:
                raise UserError(f"{self.url}: shard {name} listed in manifest.json is missing; copy the prepared directory again")
            if sizes[name] != expected:
                raise UserError(
                    f"{self.url}/{name}: {sizes[name]} bytes but manifest.json says {s['tokens']} {dtype.name} tokens "
                    f"({expected} bytes); the copy is damaged or mixed with another dataset"
                )
            path = f"{self.root}/{name}"
            self.cache.checksums(path, f"{self.root}/{s['blocks']}" if s.get("blocks") else None)
            if s["tokens"] > 0:
                out.append(RemoteShard(self.cache, path, dtype, int(s["tokens"])))
        return out

    def sha256(self, name: str) -> str:
        """The sha256 of one object, streamed (`verify`)."""
        h = hashlib.sha256()
        with self.fs.open(f"{self.root}/{name}", "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        return h.hexdigest()
