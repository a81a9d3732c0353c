"""Run folders are the user's own and private (docs/security.md).

On a shared `--out` (a cluster's scratch space) another local user can create
`OUT/NAME/` first, with a secret of theirs and symbolic links where our files go.
So a run folder is used only when it is a real directory owned by us that nobody
else can write, and one we create is 0700; `traceml watch` attaches only to such
folders and to files in them that we own. Files are written atomically (a 0600
temp file in the same folder, renamed): readers never see half a file.

Checked once is not enough: the folder is then used by path, and a later swap of
`OUT/NAME` (renamed away, a link put in its place) would redirect every write. So the
launcher and the collector `pin_dir` the run folder once verified: from then on
`write_atomic` into it (or a folder below it) goes through that folder's descriptor
(openat, O_NOFOLLOW, an O_EXCL temp file, renameat), never through the path again.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

PRIVATE_DIR_MODE = 0o700
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_PINNED: dict[str, int] = {}  # a verified folder's absolute path -> its descriptor


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


def pin_dir(path: Path) -> None:
    """Verify `path` (`not_private`) and keep a descriptor of it: later atomic writes
    under it go through the descriptor. PermissionError says why it may not be used."""
    key = os.path.abspath(path)
    reason = not_private(Path(key))
    if reason is None:
        fd = os.open(key, _DIR_FLAGS)
        st = os.fstat(fd)  # the folder we opened is the one we checked (no swap between)
        if (not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid())
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            os.close(fd)
            reason = "changed while it was checked"
        else:
            old = _PINNED.pop(key, None)
            if old is not None:
                os.close(old)
            _PINNED[key] = fd
            return
    raise PermissionError(f"{path} {reason}")


def _pinned_dir(folder: str) -> tuple[int, bool] | None:
    """A descriptor of `folder` reached from a pinned folder (itself or one above it,
    each step below opened without following links), and whether the caller closes it;
    None if no pinned folder holds it."""
    rest: list[str] = []
    here = folder
    while here not in _PINNED:
        parent = os.path.dirname(here)
        if parent == here:
            return None
        rest.insert(0, os.path.basename(here))
        here = parent
    fd = _PINNED[here]
    if not rest:
        return fd, False
    for i, part in enumerate(rest):
        sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
        if i:
            os.close(fd)
        fd = sub
    return fd, True


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
    pinned = _pinned_dir(os.path.abspath(path.parent))
    if pinned is not None:
        _write_at(pinned, path.name, write)
        return
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


def _write_at(pinned: tuple[int, bool], name: str, write: Callable[[IO[str]], Any]) -> None:
    """`write_atomic_with` through a folder's descriptor: an O_EXCL, O_NOFOLLOW temp file
    of ours (0600) renamed over `name` in the same folder."""
    dir_fd, close = pinned
    tmp = f".{name}.{secrets.token_hex(6)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
                     | getattr(os, "O_CLOEXEC", 0), 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                write(f)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    finally:
        if close:
            os.close(dir_fd)


# --- reading and reopening through the pinned folder (issue 42, 7f) ------------------------
# After a swap of a shared --out, reading by path reads the other user's files: the
# headless progress lines, the fallback summary and the step log's rotation go through
# the pinned descriptor too, and the path printed at the end is where the folder is now.


def open_dir(path: Path, create: bool = False) -> int:
    """A descriptor of folder `path` (the caller closes it): reached from the pinned
    folder that holds it (each step below opened without following links), else by path
    with O_NOFOLLOW at the last step; `create`: made 0700 first if it is missing."""
    folder = os.path.abspath(path)
    parent, name = os.path.split(folder)
    if folder in _PINNED:
        return os.dup(_PINNED[folder])
    pinned = _pinned_dir(parent)
    if pinned is None:
        if create:
            os.makedirs(parent, mode=PRIVATE_DIR_MODE, exist_ok=True)
        pinned = os.open(parent, _DIR_FLAGS & ~_NOFOLLOW), True
    parent_fd, close = pinned
    try:
        if create:
            try:
                os.mkdir(name, PRIVATE_DIR_MODE, dir_fd=parent_fd)
            except FileExistsError:
                pass
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    finally:
        if close:
            os.close(parent_fd)


def read_bytes(path: Path, limit: int) -> tuple[bytes, int]:
    """At most `limit` + 1 bytes of file `path` and its mtime (ns), read through the pinned
    folder that holds it (by path, O_NOFOLLOW, where none does). OSError as open's."""
    parent = open_dir(Path(os.path.abspath(path)).parent)
    try:
        fd = os.open(os.path.basename(path), os.O_RDONLY | _NOFOLLOW
                     | getattr(os, "O_CLOEXEC", 0), dir_fd=parent)
    finally:
        os.close(parent)
    with os.fdopen(fd, "rb") as f:
        return f.read(limit + 1), os.fstat(fd).st_mtime_ns


def mtime_ns(path: Path) -> int:
    """The mtime of file `path`, through the pinned folder (see read_bytes)."""
    parent = open_dir(Path(os.path.abspath(path)).parent)
    try:
        return os.stat(os.path.basename(path), dir_fd=parent, follow_symlinks=False).st_mtime_ns
    finally:
        os.close(parent)


def where_now(path: Path) -> tuple[Path, bool]:
    """Where `path` (below a pinned folder) is now: the pinned folder may have been renamed
    away and something else put at its old path. (path, False) when the path still leads
    to the pinned folder or nothing is pinned; else (its place now, True), from
    /proc/self/fd where there is one (else the old path, True)."""
    full = os.path.abspath(path)
    here = full
    while here not in _PINNED:
        parent = os.path.dirname(here)
        if parent == here:
            return Path(path), False
        here = parent
    fd = _PINNED[here]
    try:
        st, now = os.fstat(fd), os.stat(here, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            return Path(path), False
    except OSError:
        pass
    try:
        moved = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return Path(path), True
    return Path(moved) / os.path.relpath(full, here), True
