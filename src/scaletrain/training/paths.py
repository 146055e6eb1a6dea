"""The directories a config names for writing, made (or found usable) before any work
starts: a run that would fail to write its first checkpoint after an hour of data
preparation should fail in its first second, in one line."""

from __future__ import annotations

import os
from pathlib import Path

from scaletrain.data.blocks import is_url
from scaletrain.errors import UserError


def make_dir(value: str | Path, key: str, create: bool = True) -> Path:
    """`value` (config key `key`) as a directory scaletrain can write into, created unless
    `create` is False (then only judged: its nearest existing ancestor must be a writable
    directory). A one-line UserError names what is in the way."""
    accepted = f"accepted: {key}=<a directory that exists or can be created>"
    if is_url(str(value)):  # metrics, logs and the checkpoint being written go to a filesystem
        also = " (checkpoints reach object storage through checkpoint.dir=<url>)" if key == "run.dir" else ""
        raise UserError(f"{key}={value} is a URL, not a directory on this machine; {accepted}{also}")
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}={value} is a file, not a directory; {accepted}")
    if not create:
        ancestor = path.absolute()
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise UserError(f"{key}={value} cannot be created: {ancestor} is a file, not a directory; {accepted}")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise UserError(f"{key}={value} cannot be created: {ancestor} is not writable; {accepted}")
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except NotADirectoryError:
        raise UserError(f"{key}={value} cannot be created: a part of it is a file, not a directory; {accepted}") from None
    except OSError as e:
        raise UserError(f"{key}={value} cannot be created ({e.strerror}: {e.filename}); {accepted}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{key}={value} is not writable; {accepted}")
    return path
