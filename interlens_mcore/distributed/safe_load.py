"""Reading checkpoints that someone else may have written, without running code from them.

A pickle can call any function while it is read, so a checkpoint is only data if nothing in it
is unpickled freely. This package writes its own state as JSON and safetensors; two kinds of
pickle remain, both written by libraries it uses:

- torch.distributed.checkpoint's `.metadata` (read with `pickle.load` by DCP's own reader):
  `dcp_metadata` reads it with an unpickler that resolves only DCP's metadata classes,
  `torch.Size`, dtypes, layouts and paths, and `DCPReader` is DCP's reader doing so;
- files of `torch.save`: DCP loads tensors with `weights_only=True` (safe), but its byte entries
  and DeepSpeed's `*_states.pt` with `weights_only=False`. `unsafe_globals` lists what a file
  would call beyond torch's `weights_only` allowlist and `LIBRARY_GLOBALS`; `check_checkpoint`
  refuses a folder holding any such file before a library loads it.

What a check cannot cover: a file replaced between the check and the library's own read
(whoever can write into the folder during a resume can change the code that runs, too).
"""

from __future__ import annotations

import io
import pickle
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
_PICKLE_PROTOCOLS = {bytes([0x80, p]) for p in range(2, 6)}
_ZIP = b"PK\x03\x04"


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


def unsafe_globals(source: str | Path | bytes) -> list[str]:
    """What loading a torch.save file with `weights_only=False` would call beyond the allowed types."""
    f = io.BytesIO(source) if isinstance(source, bytes) else source
    found = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    return sorted(set(found) - LIBRARY_GLOBALS)


def dcp_reason(folder: str | Path) -> tuple[str, str] | None:
    """None if a DCP folder's metadata and byte entries hold only data, else (file name, why not)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    folder = Path(folder)
    try:
        with (folder / ".metadata").open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except UnsafeCheckpoint as exc:
        return ".metadata", str(exc)
    except Exception:  # missing or unreadable: DCP fails on it too, without running anything
        return None
    storage = metadata.storage_data or {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, BytesStorageMetadata):
            continue  # tensors: DCP reads them with weights_only=True
        info = storage.get(MetadataIndex(fqn=key))
        if info is None:
            continue  # nothing to read: DCP fails on it without unpickling anything
        with (folder / info.relative_path).open("rb") as f:
            f.seek(info.offset)
            reason = _globals_reason(f.read(info.length))
        if reason is not None:
            return info.relative_path, f"entry {key!r} {reason}"
    return None


def check_dcp(folder: str | Path) -> None:
    """UnsafeCheckpoint unless `dcp_reason` finds nothing (before a library's own DCP load)."""
    found = dcp_reason(folder)
    if found is not None:
        raise UnsafeCheckpoint(f"{Path(folder) / found[0]} {found[1]}")


def _globals_reason(data: str | Path | bytes) -> str | None:
    """None if `data` (a torch.save file) calls only allowed types, else why it is refused."""
    try:
        bad = unsafe_globals(data)
    except Exception:  # not a file torch can read: loading it fails, it cannot run anything
        return None
    if not bad:
        return None
    return f"is a pickle that would call {', '.join(bad)} when loaded"


def check_checkpoint(folder: str | Path) -> None:
    """UnsafeCheckpoint naming the file if any file a loader would unpickle holds more than data.

    Every file under `folder` is looked at by its first bytes: a raw pickle is refused (nothing
    this package reads is one, DCP's `.metadata` aside), a torch.save archive must call only
    allowed types, and each DCP folder's metadata and byte entries are checked.
    """
    folder = Path(folder)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.suffix == ".distcp":
            continue  # DCP's data files: read through their .metadata, checked with it
        if path.name == ".metadata":
            found = dcp_reason(path.parent)
            where, reason = (path.parent / found[0], found[1]) if found else (path, None)
        else:
            where, reason = path, _file_reason(path)
        if reason is not None:
            raise UnsafeCheckpoint(f"{where.relative_to(folder).as_posix()} {reason}")


def _file_reason(path: Path) -> str | None:
    with path.open("rb") as f:
        head = f.read(9)
    if head[:2] in _PICKLE_PROTOCOLS and not _safetensors(head, path):
        return "is a raw pickle, which nothing here reads"
    return _globals_reason(path) if head[:4] == _ZIP else None


def _safetensors(head: bytes, path: Path) -> bool:
    # a safetensors file opens with its JSON header's length (8 bytes, little-endian), which can
    # begin with the same two bytes as a pickle; the header itself opens with "{"
    size = int.from_bytes(head[:8], "little")
    return len(head) == 9 and head[8:9] == b"{" and 8 + size <= path.stat().st_size
