"""Reading checkpoints that someone else may have written, without running code from them.

A pickle can call any function while it is read, so a checkpoint is only data if nothing in it
is unpickled freely. This package writes its own state as JSON and safetensors; two kinds of
pickle remain, both written by libraries it uses:

- torch.distributed.checkpoint's `.metadata` (read with `pickle.load` by DCP's own reader):
  `dcp_metadata` reads it with an unpickler that resolves only DCP's metadata classes,
  `torch.Size`, dtypes, layouts and paths, and `DCPReader` is DCP's reader doing so;
- files of `torch.save`: DCP loads tensors with `weights_only=True` (safe), but its byte entries
  with `weights_only=False` (`dcp_planner` refuses them), and DeepSpeed its `*_states.pt`
  (the backend hands it `weights_only_load` instead of its own `torch.load`).

Before any loader sees a file, `check_checkpoint` walks every opcode of every pickle in it
(`pickletools`, protocols 0 to 5: a raw pickle, torch's legacy format of successive pickles, or
the `.pkl` entries of torch's zip format) and refuses a global outside `ALLOWED_GLOBALS`.

What a check cannot cover: a file replaced between the check and the library's own read
(whoever can write into the folder during a resume can change the code that runs, too).
"""

from __future__ import annotations

import _compat_pickle
import importlib
import io
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import ReadItem

# classes a torch.save file of the libraries holds besides torch's own, each plain data when
# unpickled (a dataclass, an int enum, a class without __setstate__ or __reduce__)
LIBRARY_GLOBALS = frozenset(
    {
        "deepspeed.utils.tensor_fragment.fragment_address",  # dataclass (numel, start)
        "deepspeed.runtime.zero.config.ZeroStageEnum",  # int enum
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # attributes only
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  # attributes only
    }
)

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_ZIP = b"PK\x03\x04"


def _allowed_globals() -> frozenset[str]:
    from torch._weights_only_unpickler import _get_allowed_globals

    dcp = {f"{m}.{n}" for m, n in _DCP_CLASSES}
    return frozenset(_get_allowed_globals()) | LIBRARY_GLOBALS | dcp


# what a pickle in a checkpoint may name: torch's `weights_only` types (tensors, storages,
# dtypes, plain containers), the libraries' data classes above and DCP's metadata classes
ALLOWED_GLOBALS = _allowed_globals()
_STRINGS = {"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"}
_STRINGS |= {"STRING", "BINSTRING", "SHORT_BINSTRING"}
_GETS, _PUTS = {"GET", "BINGET", "LONG_BINGET"}, {"PUT", "BINPUT", "LONG_BINPUT"}
_STILL = {"PROTO", "FRAME", "STOP"}  # leave the stack as it is


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that loading would unpickle holds calls outside the allowed data types."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        if (module, name) in _DCP_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"would call {module}.{name} when read (DCP metadata holds data classes only)")


def dcp_metadata(folder: str | Path, *, rank: int | None = None) -> Metadata:
    """A DCP folder's `Metadata`, read without calling anything but its own data classes."""
    name = ".metadata" if rank is None else f"__{rank}.metadata"
    path = Path(folder) / name
    with path.open("rb") as f:
        try:
            return _MetadataUnpickler(f).load()
        except UnsafeCheckpoint as exc:
            raise UnsafeCheckpoint(f"{path} {exc}") from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not a DCP metadata file ({type(exc).__name__}: {exc})") from None


def _reader_class() -> type[FileSystemReader]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class DCPReader(FileSystemReader):
        """DCP's file reader with its metadata read by `dcp_metadata`."""

        def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
            rank = kwargs.get("rank")
            metadata = dcp_metadata(Path(self.path), rank=rank if isinstance(rank, int) else None)
            storage = getattr(metadata, "storage_meta", None) or StorageMeta()  # older files: none
            storage.load_id = self.load_id
            metadata.storage_meta = storage
            return metadata

    return DCPReader


def dcp_reader(folder: str | Path) -> FileSystemReader:
    """A `FileSystemReader` over `folder` whose metadata cannot run code (for `dcp.load`)."""
    return _reader_class()(str(folder))


def dcp_planner() -> DefaultLoadPlanner:
    """DCP's default load planner, refusing byte entries (DCP would unpickle them freely).

    This package stores none: everything it saves through DCP is a tensor.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            raise UnsafeCheckpoint(
                f"entry {read_item.dest_index.fqn!r} is a pickled object (DCP would load it with "
                "weights_only=False); only tensors are read"
            )

    return Planner()


def _name(module: str, name: str) -> str:
    # an unpickler maps Python 2 names of protocols 0 to 2 (`__builtin__`) to today's
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def _one_pickle(f: io.BytesIO, found: list[str]) -> None:
    """Append every global the pickle at `f`'s position names (GLOBAL, INST, STACK_GLOBAL, EXT*).

    STACK_GLOBAL takes its names from the stack: the last two values pushed, followed through the
    memo; any other opcode leaves an unknown on top, so a name not pushed just before is '?'.
    """
    pushed: list[str | None] = []
    memo: dict[object, str | None] = {}
    for op, arg, _ in pickletools.genops(f):
        if op.name in ("GLOBAL", "INST"):
            found.append(_name(*str(arg).split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            module, name = pushed[-2:] if len(pushed) >= 2 else (None, None)
            found.append(_name(module, name) if module is not None and name is not None else "?")
        elif op.name.startswith("EXT"):
            found.append(f"copyreg extension {arg}")
        if op.name in _STRINGS:
            pushed.append(arg.decode("latin-1") if isinstance(arg, bytes) else str(arg))
        elif op.name in _GETS:
            pushed.append(memo.get(arg))
        elif op.name in _PUTS or op.name == "MEMOIZE":
            memo[arg if op.name in _PUTS else len(memo)] = pushed[-1] if pushed else None
        elif op.name not in _STILL:
            pushed.append(None)


def pickle_globals(data: bytes) -> list[str]:
    """Every global the pickles in `data` name, read as an unpickler would: one pickle after
    another (torch's legacy format holds several), until the bytes stop being a pickle (an
    unpickler fails there, having called only what it named before)."""
    f, found = io.BytesIO(data), list[str]()
    while f.tell() < len(data):
        try:
            _one_pickle(f, found)
        except Exception:  # pickletools' errors on bytes that are no pickle (ValueError and others)
            break
    return found


def unsafe_globals(source: str | Path | bytes) -> list[str]:
    """What loading a file (any pickle protocol, raw or torch.save) would name beyond `ALLOWED_GLOBALS`."""
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    if data[:4] == _ZIP:
        found = []
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist():
                if info.filename.endswith(".pkl"):  # torch.load unpickles these, reads the rest raw
                    found += pickle_globals(archive.read(info))
    else:
        found = pickle_globals(data)
    seen: dict[str, None] = dict.fromkeys(g for g in found if g not in ALLOWED_GLOBALS)
    return list(seen)


def weights_only_load(path: str | Path, map_location: object = None) -> object:
    """`torch.load` with `weights_only=True` and the libraries' data classes allowed (DeepSpeed's loader)."""
    classes = []
    for dotted in sorted(LIBRARY_GLOBALS):
        module, name = dotted.rsplit(".", 1)
        classes.append(getattr(importlib.import_module(module), name))
    with torch.serialization.safe_globals(classes):
        return torch.load(path, map_location=map_location, weights_only=True)  # type: ignore[arg-type]



def dcp_reason(folder: str | Path) -> tuple[str, str] | None:
    """None if a DCP folder's metadata and byte entries hold only data, else (file name, why not)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    folder = Path(folder)
    if (folder / ".metadata").is_file() and (reason := _globals_reason(folder / ".metadata")) is not None:
        return ".metadata", reason
    try:
        with (folder / ".metadata").open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except UnsafeCheckpoint as exc:
        return ".metadata", str(exc)
    except Exception:  # missing or unreadable: DCP fails on it too, without running anything
        return None
    # every stored piece DCP would read: byte entries (unpickled freely) and tensors (torch.load
    # with weights_only=True, scanned all the same: one rule for every pickle)
    wanted = set(metadata.state_dict_metadata)
    pieces = sorted((metadata.storage_data or {}).items(), key=lambda kv: str(kv[1].relative_path))
    for index, info in pieces:
        if not isinstance(index, MetadataIndex) or index.fqn not in wanted:
            continue  # nothing asks for it: DCP never reads it
        path = folder / info.relative_path
        if not path.is_file():
            continue  # DCP fails on it without unpickling anything
        with path.open("rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) < info.length and data[:4] == _ZIP and not zipfile.is_zipfile(io.BytesIO(data)):
            # a zip cut short: its directory is at its end, so neither this scan nor torch's
            # reader can open it, and DCP's load fails before anything is unpickled (the
            # checkpoint is then set aside as one that does not load). A short zip that opens
            # whole, and a short raw pickle, are scanned as any other piece.
            continue
        reason = _globals_reason(data)
        if reason is not None:
            return info.relative_path, f"entry {index.fqn!r} {reason}"
    return None


def check_dcp(folder: str | Path) -> None:
    """UnsafeCheckpoint unless `dcp_reason` finds nothing (before a library's own DCP load)."""
    found = dcp_reason(folder)
    if found is not None:
        raise UnsafeCheckpoint(f"{Path(folder) / found[0]} {found[1]}")


def _globals_reason(data: str | Path | bytes) -> str | None:
    """None if unpickling `data` (any protocol; raw, legacy torch or torch's zip) would name only
    allowed types, else why it is refused."""
    try:
        bad = unsafe_globals(data)
    except zipfile.BadZipFile:  # torch's own reader might still open it: not worth the doubt
        return "is a zip archive that cannot be read whole (torch.save writes whole ones)"
    if not bad:
        return None
    return f"is a pickle that would call {', '.join(bad)} when loaded"


def check_checkpoint(folder: str | Path) -> None:
    """UnsafeCheckpoint naming the file and the global if any file under `folder` holds a pickle
    that names more than `ALLOWED_GLOBALS`; each DCP folder's byte entries are checked too.

    Every file is scanned whatever its name or first bytes (a loader does not ask either), but
    safetensors files (never unpickled); DCP's `.distcp` data files are scanned piece by piece
    where their `.metadata` says each piece lies (that is all DCP reads of them).
    """
    folder = Path(folder)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.suffix == ".distcp" and (path.parent / ".metadata").is_file():
            continue  # read only where its .metadata points: checked piece by piece with it
        where, reason = path, _file_reason(path)
        if reason is None and path.name == ".metadata":
            found = dcp_reason(path.parent)
            where, reason = (path.parent / found[0], found[1]) if found else (path, None)
        if reason is not None:
            raise UnsafeCheckpoint(f"{where.relative_to(folder).as_posix()} {reason}")


def _file_reason(path: Path) -> str | None:
    with path.open("rb") as f:
        head = f.read(9)
    return None if _safetensors(head, path) else _globals_reason(path)


def _safetensors(head: bytes, path: Path) -> bool:
    # a safetensors file opens with its JSON header's length (8 bytes, little-endian), which can
    # begin with the same two bytes as a pickle; the header itself opens with "{"
    size = int.from_bytes(head[:8], "little")
    return len(head) == 9 and head[8:9] == b"{" and 8 + size <= path.stat().st_size
