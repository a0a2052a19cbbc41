"""The on-disk format of an activation dataset: shard files, their index files, the directory.

A dataset directory holds, for every shard, two files with the same stem::

    {run}-rank{rank:05d}-{seq:06d}.safetensors   # the tensors (safetensors format)
    {run}-rank{rank:05d}-{seq:06d}.index.json    # what each tensor holds (written after it)

An index file exists only for a complete shard: the shard is written under a temporary name,
flushed to disk and given its name (on a local disk a hard link, made only where no file has the
name, so that two writers of one run and rank never replace each other's shards), and only then
is its index file written (under a temporary name, then renamed). A reader
lists the index files; a shard without one (a crash between the two writes) is not part of the
dataset. One small index file per shard, rather than one appended index, because an append is
not atomic on a local disk and does not exist on object stores (``s3://``, ``gs://``), while
writing a whole small file is; each rank writes only its own files, so ranks never share one.

Every index file is one JSON object (see :data:`FORMAT`, :data:`VERSION`)::

    {"format": "lightning_recorder.activations", "version": 1,
     "run": "...", "rank": 0, "seq": 3, "shard": "<file name>", "bytes": 123,
     "generation": 0,
     "chunks": [{"key": "features.2#0", "source": "feat", "module": "features.2",
                 "stage": "predict", "global_step": 0, "epoch": 0, "batch_idx": 5,
                 "dataloader_idx": 0, "call": 0, "dtype": "float32", "shape": [32, 64],
                 "sample_index": [160, 161, ...]}, ...]}

A *chunk* is one tensor of the shard: the activations of one source in one batch, rows along
its first dimension; row ``i`` is sample ``sample_index[i]`` and has shape ``shape[1:]``.
"""

from __future__ import annotations

import json
import operator
import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .._core.checks import installed
from ..errors import RecorderConfigError, RecorderStateError

FORMAT = "lightning_recorder.activations"
"""The ``format`` field of every index file this package writes."""
VERSION = 1
"""The ``version`` field of the index files: the format version this package writes and reads."""
SHARD_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".index.json"
TMP_SUFFIX = ".tmp"
_STEM = re.compile(r"^(?P<run>.+)-rank(?P<rank>\d{5})-(?P<seq>\d{6})$")
_RUN = re.compile(r"^[A-Za-z0-9_.]+$")

#: The torch dtypes a shard stores (those of safetensors' format since its first release).
STORABLE = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
)
#: Their torch names, for messages.
STORABLE_NAMES = ", ".join(sorted(str(d).removeprefix("torch.") for d in STORABLE))


def as_index(value: object) -> int | None:
    """``value`` as an int where it is one (an int, a NumPy integer, an integer 0-d tensor),
    else ``None``: a bool (a mask's 0 or 1), a float, a string, ``None`` or a slice is not."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def new_run_id() -> str:
    """A fresh run id: unique enough that two runs writing to one directory never collide."""
    return uuid.uuid4().hex[:12]


def require_safetensors(owner: str) -> None:
    """Raise unless safetensors (the format of the shards; a dependency of the package, which
    an environment may still lack) can be imported: said when the writer or dataset is made,
    not when its first shard is written or read (mid-training, in the writer's thread)."""
    if not installed("safetensors"):
        raise RecorderStateError(
            f"Expected the Python package `safetensors` for {owner} but it is not installed: "
            "activation shards are safetensors files. Install it: `pip install safetensors` "
            "(a dependency of lightning-recorder, which `pip install lightning-recorder` "
            "installs)."
        )


def check_run_id(run: object, owner: str) -> str:
    """Validate a user-given run id (it becomes part of file names)."""
    if not isinstance(run, str) or not _RUN.match(run):
        raise RecorderConfigError(
            f"Expected `run` of {owner} to be a non-empty str of letters, digits, '_' and '.' "
            f"(it becomes part of file names) but got {run!r}."
        )
    return run


def check_storable(dtype: torch.dtype, where: str) -> None:
    """Raise unless safetensors can store ``dtype``."""
    if dtype not in STORABLE:
        fix = "cast them with the `dtype` option"
        if dtype.is_complex:  # a cast to a real dtype would drop the imaginary part
            fix = (
                "store their real and imaginary parts with the option `transform` "
                "torch.view_as_real (a last dimension of 2), or their magnitude with torch.abs "
                "(a cast with `dtype` would drop the imaginary part)"
            )
        raise RecorderConfigError(
            f"Expected the activations of {where} to have a dtype the shard format stores "
            f"({STORABLE_NAMES}) but got {dtype}; {fix}."
        )


def stem(run: str, rank: int, seq: int) -> str:
    return f"{run}-rank{rank:05d}-{seq:06d}"


def parse_stem(name: str) -> tuple[str, int, int] | None:
    """``(run, rank, seq)`` of a shard or index file name, or ``None`` for other files."""
    for suffix in (INDEX_SUFFIX, SHARD_SUFFIX):
        if name.endswith(suffix):
            match = _STEM.match(name[: -len(suffix)])
            if match is None:
                return None
            return match["run"], int(match["rank"]), int(match["seq"])
    return None


def encode_index(entry: Mapping[str, Any]) -> bytes:
    return json.dumps(entry, separators=(",", ":")).encode()


def decode_index(data: bytes, name: str) -> dict[str, Any]:
    try:
        entry = json.loads(data)
    except ValueError as err:  # not JSON, or not UTF-8
        raise RecorderConfigError(
            f"Expected {name} to be an activation index file (JSON) but it cannot be read: "
            f"{err}. The file is damaged: restore it, or remove it to leave its shard out."
        ) from None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        raise RecorderConfigError(f"Expected {name} to be an activation index file but it is not.")
    if entry.get("version", 0) > VERSION:
        raise RecorderConfigError(
            f"Expected {name} to have format version <= {VERSION} but got {entry['version']}: "
            "it was written by a newer lightning_recorder."
        )
    return entry


# ---------------------------------------------------------------------------------- filesystem
class Storage:
    """A directory on a local disk or on any filesystem ``fsspec`` knows (``memory://``, ``s3://``).

    Local files are written to a temporary name, ``fsync``-ed and renamed (atomic on POSIX), or
    linked to a name that no file has (:meth:`publish`); other filesystems get a write to a
    temporary name and a move (an object store writes an object atomically anyway).
    """

    def __init__(self, directory: str | os.PathLike[str], owner: str) -> None:
        if not isinstance(directory, (str, os.PathLike)) or str(directory) == "":
            raise RecorderConfigError(
                f"Expected `directory` of {owner} to be a path or an fsspec URL such as "
                f"'memory://acts' but got {directory!r}."
            )
        text = os.fspath(directory)
        self.url = text
        self.local = "://" not in text or text.startswith("file://")
        if self.local:
            self.fs: Any = None
            self.path = os.path.abspath(text.removeprefix("file://"))
            self.hard_links = True  # False once the filesystem refused one (FAT, some shares)
        else:
            try:
                from fsspec.core import url_to_fs
            except ImportError as err:  # pragma: no cover - fsspec comes with lightning
                raise RecorderConfigError(
                    f"Expected `directory` of {owner} to be a local path: {text!r} needs fsspec, "
                    "which is not installed."
                ) from err
            try:
                self.fs, self.path = url_to_fs(text)
            except (ValueError, ImportError) as err:
                raise RecorderConfigError(
                    f"Expected `directory` of {owner} to be a path or an fsspec URL but got "
                    f"{text!r}: {err}"
                ) from err

    def join(self, name: str) -> str:
        return os.path.join(self.path, name) if self.local else f"{self.path}/{name}"

    def make_writable(self, owner: str) -> None:
        """Create the directory and check that a file can be written in it."""
        probe = self.join(f".write-test-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
        try:
            if self.local:
                os.makedirs(self.path, exist_ok=True)
                with open(probe, "wb") as handle:
                    handle.write(b"")
                os.remove(probe)
            else:
                self.fs.makedirs(self.path, exist_ok=True)
                self.fs.pipe_file(probe, b"")
                self.fs.rm_file(probe)
        except OSError as err:
            raise RecorderConfigError(
                f"Expected `directory` of {owner} to be a writable directory but {self.url!r} is "
                f"not: {err}"
            ) from err

    def write_atomic(self, name: str, write: Callable[[Any], object], fsync: bool) -> None:
        """Write a file through ``write(handle)`` under a temporary name, then rename it; a write
        that fails (a full disk) removes the temporary file and raises."""
        final = self.join(name)
        tmp = final + TMP_SUFFIX
        try:
            if self.local:
                with open(tmp, "wb") as handle:
                    write(handle)
                    if fsync:
                        handle.flush()
                        os.fsync(handle.fileno())
                os.replace(tmp, final)
            else:
                with self.fs.open(tmp, "wb") as handle:
                    write(handle)
                self.fs.mv(tmp, final)
        except BaseException:
            self.remove(name + TMP_SUFFIX)
            raise

    def write_tensors(
        self, tmp: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str], fsync: bool
    ) -> int:
        """Write ``tensors`` (contiguous, on the CPU) as the complete safetensors file ``tmp``
        (a temporary name, given its final one by :meth:`publish`), by safetensors' own writer,
        flushed to the disk with ``fsync``; a write that fails (a full disk) removes it and
        raises. A local file is written from the tensors' memory (``save_file``); another
        filesystem gets the file's bytes (``save``). Returns the file's size in bytes."""
        from safetensors.torch import save, save_file  # imported when first written

        tensors = _unshared(tensors)
        path = self.join(tmp)
        try:
            if not self.local:
                data = save(tensors, metadata=metadata)
                with self.fs.open(path, "wb") as handle:
                    handle.write(data)
                return len(data)
            save_file(tensors, path, metadata=metadata)
            if fsync:
                fd = os.open(path, os.O_RDWR)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            return os.path.getsize(path)
        except BaseException:  # a full disk: no part of the file is left
            self.remove(tmp)
            raise

    def publish(self, tmp: str, name: str) -> bool:
        """Give the complete file ``tmp`` the name ``name``, unless a file has that name already
        (``False``: both stay as they are), so that a writer never replaces a file that another
        one wrote. Locally by a hard link (made only where no file has the name), then ``tmp``
        is removed; where the filesystem has no hard links, by an empty file created only where
        none has the name (``O_EXCL``) and ``tmp`` renamed over it. On another filesystem, which
        may not create only where no file is, ``tmp`` is moved to ``name`` whatever is there."""
        final = self.join(name)
        if not self.local:
            self.fs.mv(self.join(tmp), final)
            return True
        if self.hard_links:
            try:
                os.link(self.join(tmp), final)
            except FileExistsError:
                return False
            except FileNotFoundError:
                raise
            except OSError:  # no hard links on this filesystem (EPERM, ENOTSUP): as below
                self.hard_links = False
            else:
                self.remove(tmp)
                return True
        try:
            os.close(os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            return False
        try:
            os.replace(self.join(tmp), final)
        except BaseException:
            self.remove(name)  # the empty file that claimed the name
            raise
        return True

    def names(self) -> list[str]:
        """The file names in the directory (none if it does not exist)."""
        if self.local:
            try:
                return sorted(os.listdir(self.path))
            except FileNotFoundError:
                return []
            except NotADirectoryError:
                raise RecorderConfigError(
                    f"Expected {self.url!r} to be a directory of activation shards but it is a "
                    "file; pass the directory the activations were written into."
                ) from None
        if not self.fs.exists(self.path):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False))

    def read(self, name: str) -> bytes:
        if self.local:
            with open(self.join(name), "rb") as handle:
                return handle.read()
        return bytes(self.fs.cat_file(self.join(name)))

    def remove(self, name: str) -> None:
        try:
            if self.local:
                os.remove(self.join(name))
            else:
                self.fs.rm_file(self.join(name))
        except FileNotFoundError:
            pass

    def sync_directory(self) -> None:
        """Make the renames durable (local disks only)."""
        if self.local and hasattr(os, "O_DIRECTORY"):
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with a copy of each one whose memory an earlier one holds (one tensor written
    twice, as two sources of the same output): safetensors refuses tensors that share memory."""
    seen: set[int] = set()
    found = {}
    for key, tensor in tensors.items():
        address = tensor.untyped_storage().data_ptr()
        if address and tensor.nbytes:
            if address in seen:
                tensor = tensor.clone()
            seen.add(address)
        found[key] = tensor
    return found


def iter_index(storage: Storage) -> Iterator[dict[str, Any]]:
    """Every index entry of the directory (one per complete shard), in file-name order; an index
    file removed since it was listed (a resumed run's writer removing what followed its
    checkpoint) is left out."""
    for name in storage.names():
        if name.endswith(INDEX_SUFFIX):
            try:
                data = storage.read(name)
            except FileNotFoundError:
                continue
            yield decode_index(data, name)
