"""Run folders are the user's own and private (docs/security.md).

On a shared `--out` (a cluster's scratch space) another local user can create
`OUT/NAME/` first, with a secret of theirs and symbolic links where our files go.
So a run folder is used only when it is a real directory owned by us that nobody
else can write, and one we create is 0700; `traceml watch` attaches only to such
folders and to files in them that we own. Files are written atomically (a 0600
temp file in the same folder, renamed): readers never see half a file.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

PRIVATE_DIR_MODE = 0o700


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name}"
    except (ImportError, KeyError):
        return f"uid {uid}"


def not_private(path: Path, want_dir: bool = True) -> str | None:
    """Why `path` may not be trusted as ours, or None when it may: not a symbolic link,
    the right kind, owned by us, writable by nobody else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "does not exist"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if want_dir and not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if not want_dir and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"belongs to {_owner(st.st_uid)}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"can be written by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def make_private_dir(path: Path) -> bool:
    """Create `path` as 0700; True if we created it. An existing one must pass
    `not_private`, else PermissionError says why."""
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
        return True
    except FileExistsError:
        pass
    reason = not_private(path)
    if reason:
        raise PermissionError(f"{path} {reason}")
    return False


def open_private(path: Path, mode: str = "ab"):
    """Open a file of ours for appending: created 0600, never through a symbolic link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
    return os.fdopen(os.open(path, flags, 0o600), mode)


def write_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and rename: readers never see half a file."""
    write_atomic_with(path, lambda f: f.write(text))


def write_atomic_with(path: Path, write: Callable[[IO[str]], Any]) -> None:
    """The same, for content streamed into the file by `write(f)` (large exports)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
