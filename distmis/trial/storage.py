"""Where Ray Tune and Ray Train keep a search's state: the local disk, with every file written whole or not at all.

Tune saves its state (which trials ended, the searcher's and the scheduler's) in a staging folder and copies it into
``OUTPUT/ray_results`` every few seconds; trials copy their checkpoints there too. Ray copies with
``pyarrow.fs.copy_files``, which opens the destination (emptying it) and then writes it. A driver killed between the
two leaves an empty or cut ``search_gen_state-*.json``, and ``--resume`` then fails on it (``EOFError``) where it
should carry on.

:func:`atomic_local_filesystem` is the local file system with one change: a file opened for writing is written
beside its destination (``.<name>.partial-<random>``) and moved over it when closed, so a reader sees the old file
or the new one, never a part. Everything else is pyarrow's ``LocalFileSystem``. Pass it as ``storage_filesystem`` to
``RunConfig``, ``Tuner.restore`` and Ray Train's ``RunConfig``.
"""

from __future__ import annotations

import io
import os
import secrets
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from distmis.trial.record import STORAGE_TYPE

PARTIAL_MARK = ".partial-"  # a file being written; one left behind by a killed writer is never read by Ray


class _ReplaceOnClose(io.FileIO):
    """A file written under a temporary name in the destination's folder and renamed onto it on close."""

    def __init__(self, destination: str) -> None:
        folder, name = os.path.split(destination)
        if folder:
            os.makedirs(folder, exist_ok=True)  # as pyarrow's local file system does
        self._partial = os.path.join(folder, f".{name}{PARTIAL_MARK}{secrets.token_hex(4)}")
        # the mode the file would have had (the umask applies), not mkstemp's 0600
        handle = os.open(self._partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        super().__init__(handle, "wb", closefd=True)
        self._destination = destination
        self._failed = False

    def write(self, data: Any) -> int:
        """Write all of ``data`` (a raw file may write part of it; pyarrow does not ask again)."""
        view = memoryview(data).cast("B")
        try:
            written = 0
            while written < len(view):
                written += super().write(view[written:]) or 0
            return written
        except BaseException:
            self._failed = True  # a failed copy (a full disk) keeps the old file
            raise

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()
        except BaseException:
            self._failed = True
            raise
        finally:
            if self._failed:
                Path(self._partial).unlink(missing_ok=True)
        if not self._failed:
            os.replace(self._partial, self._destination)


class AtomicLocalHandler(pafs.FileSystemHandler):
    """pyarrow's local file system whose output streams replace their file only when closed."""

    def __init__(self) -> None:
        self._local = pafs.LocalFileSystem()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AtomicLocalHandler)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __reduce__(self) -> tuple[Any, ...]:  # trials receive the storage context, file system included
        return AtomicLocalHandler, ()

    def get_type_name(self) -> str:
        return STORAGE_TYPE.removeprefix("py::")  # pyarrow adds the prefix

    def normalize_path(self, path: str) -> str:
        return self._local.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self._local.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self._local.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self._local.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self._local.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("distmis never empties the root of a file system")

    def delete_file(self, path: str) -> None:
        self._local.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self._local.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        with self._local.open_input_stream(src) as source, self.open_output_stream(dest, None) as target:
            while chunk := source.read(1 << 22):
                target.write(chunk)

    def open_input_stream(self, path: str) -> pafs.NativeFile:
        return self._local.open_input_stream(path)

    def open_input_file(self, path: str) -> pafs.NativeFile:
        return self._local.open_input_file(path)

    def open_output_stream(self, path: str, metadata: dict[str, str] | None) -> Any:
        import pyarrow as pa

        return pa.PythonFile(_ReplaceOnClose(path), mode="w")

    def open_append_stream(self, path: str, metadata: dict[str, str] | None) -> pafs.NativeFile:
        return self._local.open_append_stream(path)


def atomic_local_filesystem() -> pafs.FileSystem:
    """The file system for a search's Ray storage on local disk (see the module's docstring)."""
    return pafs.PyFileSystem(AtomicLocalHandler())
