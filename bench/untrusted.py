"""Checkpoints parabench did not write are data: nothing in them runs (docs/security.md).

``torch.save`` files and the ``.metadata`` file of ``torch.distributed.checkpoint`` are pickles, and
unpickling calls whatever global the file names. Every pickle parabench reads - its own readers, and
the files it hands to DeepSpeed's ``ds_to_universal``, Megatron-Core's ``dist_checkpointing`` or
``torch.distributed.checkpoint``, which unpickle with code allowed - is first read without running
anything, and refused (one line naming the file and the global) unless every global it names is one
of torch's ``weights_only`` set or of :data:`ALLOWED`:

- a ``torch.save`` file: its ``data.pkl`` disassembled with torch's own scanner
  (``torch.serialization.get_unsafe_globals_in_checkpoint``; it refuses any opcode outside the
  ``weights_only`` unpickler's, so the set of globals it returns is complete), then loaded with
  ``weights_only=True`` and the file's allowed globals as ``safe_globals``;
- a DCP ``.metadata``: unpickled by a restricted ``pickle.Unpickler`` whose ``find_class`` hands out
  only the allowed globals (the Python docs' "Restricting Globals"); the non-tensor items it points
  at in the ``.distcp`` files are ``torch.save`` bytes, checked as above, and loaded through
  :func:`dcp_planner` with ``weights_only=True``.

``trusted=True`` (``bench convert --trust-checkpoint``, ``run.trust_checkpoint=true``) skips all of
it, for a checkpoint whose source the user trusts that needs globals beyond the allowlist.
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from parabench.errors import SpecError

# The globals, beyond torch's weights_only set (torch/_weights_only_unpickler.py,
# _get_allowed_globals), that the checkpoint formats parabench reads pickle, found with
# torch.serialization.get_unsafe_globals_in_checkpoint on checkpoints the frameworks wrote. Each
# builds a value and runs nothing else: classes, enums and dataclasses constructed from their state.
DEEPSPEED = (  # deepspeed/runtime/engine.py and zero/stage_1_and_2.py, stage3.py: the optimizer states
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
MEGATRON = (  # Megatron-LM's common.pt: its argparse namespace (megatron/training/arguments.py) and enums
    "argparse.Namespace",
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe",
    "megatron.core.transformer.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.transformer.enums.CudaGraphScope",
)
NUMPY = (  # numpy arrays and RNG states in non-tensor items (torch's docs: numpy in weights_only)
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
)
DCP_METADATA = (  # torch/distributed/checkpoint/metadata.py, filesystem.py, planner.py: the .metadata file
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.planner.SavePlan",
    "torch.distributed.checkpoint.planner.WriteItem",
    "torch.distributed.checkpoint.planner.WriteItemType",
    "torch.distributed.checkpoint.planner.TensorWriteData",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
)
ALLOWED = frozenset(DEEPSPEED + MEGATRON + NUMPY + DCP_METADATA)
TRUST_HINT = "convert it with --trust-checkpoint (resume with run.trust_checkpoint=true) only if you trust its source"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin")
DCP_METADATA_FILE = ".metadata"
DCP_METADATA_NAME = re.compile(r"(?:__(\d+))?\.metadata")  # torch/distributed/checkpoint/filesystem.py


class Untrusted(SpecError):
    """A checkpoint file names a global outside the allowlist, or is not a format that can be checked."""


def _refuse(path: Path, what: str, key: str) -> Untrusted:
    return Untrusted(key, f"{path}: {what}; refused before it was unpickled ({TRUST_HINT})")


def _torch_safe() -> set[str]:
    from torch import _weights_only_unpickler

    return set(_weights_only_unpickler._get_allowed_globals())


def globals_of(data: bytes | Path, path: Path, key: str) -> set[str]:
    """Every global a ``torch.save`` file (or its bytes) names, read without unpickling it."""
    from torch import _weights_only_unpickler

    try:
        with zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else data) as archive:
            pkl = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise _refuse(path, "not a torch.save archive (no single data.pkl)", key)
            return _weights_only_unpickler.get_globals_in_pkl(io.BytesIO(archive.read(pkl[0])))
    except zipfile.BadZipFile:
        raise _refuse(path, "not a torch.save zip archive (the legacy format cannot be checked)", key) from None
    except (pickle.UnpicklingError, EOFError, ValueError, AssertionError) as exc:
        raise _refuse(path, f"its pickle cannot be checked ({exc})", key) from None


def check_globals(found: Iterable[str], path: Path, key: str) -> list[str]:
    """The allowlisted globals of ``found`` beyond torch's own; refuses any other."""
    beyond = sorted(set(found) - _torch_safe())
    for name in beyond:
        if name not in ALLOWED:
            raise _refuse(
                path, f"it names the global {name}, which checkpoints of the formats parabench reads never hold", key
            )
    return beyond


def _resolve(names: Iterable[str]) -> list[Any]:
    """The objects of allowlisted names; a framework that is not installed raises ModuleNotFoundError
    (the caller says which package reads the file)."""
    objects = []
    for name in names:
        module, _, attr = name.rpartition(".")
        objects.append(getattr(importlib.import_module(module), attr, None) or _absent(name))
    return objects


def _absent(name: str) -> Any:
    raise ModuleNotFoundError(f"{name} is not in the installed version of its package", name=name.split(".")[0])


def load(path: Path, key: str = "SRC", trusted: bool = False, **kwargs: Any) -> Any:
    """``torch.load(path)`` of a file checked by :func:`globals_of`; ``trusted``: as torch loads it."""
    import torch

    if trusted:
        return torch.load(path, weights_only=False, **kwargs)
    extra = check_globals(globals_of(path, path, key), path, key)
    with torch.serialization.safe_globals(_resolve(extra)):
        return torch.load(path, weights_only=True, **kwargs)


def load_bytes(data: bytes, path: Path, key: str = "SRC") -> Any:
    """A DCP non-tensor item (``torch.save`` bytes), checked, loaded with ``weights_only=True``."""
    import torch

    extra = check_globals(globals_of(data, path, key), path, key)
    with torch.serialization.safe_globals(_resolve(extra)):
        return torch.load(io.BytesIO(data), weights_only=True)


class _MetadataUnpickler(pickle.Unpickler):
    """``find_class`` hands out torch's weights_only globals and the DCP metadata classes, nothing else."""

    def __init__(self, stream, path: Path, key: str):
        super().__init__(stream)
        self.path, self.key = path, key

    def find_class(self, module: str, name: str) -> Any:
        from torch import _weights_only_unpickler

        full = f"{module}.{name}"
        safe = _weights_only_unpickler._get_allowed_globals()
        if full in safe:
            return safe[full]
        if full in DCP_METADATA:
            return getattr(importlib.import_module(module), name)
        raise _refuse(self.path, f"it names the global {full}, which DCP metadata never holds", self.key)

    def persistent_load(self, pid: Any) -> Any:
        raise _refuse(self.path, "it holds a persistent id, which DCP metadata never does", self.key)


def dcp_metadata(directory: Path, key: str = "SRC", trusted: bool = False, rank: int | None = None) -> Any:
    """The ``torch.distributed.checkpoint`` Metadata of ``directory`` (``rank``: a rank's own, which
    DCP writes without collectives), unpickled with only its own classes."""
    path = directory / (DCP_METADATA_FILE if rank is None else f"__{rank}{DCP_METADATA_FILE}")
    with open(path, "rb") as stream:
        if trusted:
            return pickle.load(stream)
        try:
            return _MetadataUnpickler(stream, path, key).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
            raise _refuse(path, f"not DCP metadata ({exc})", key) from None


def _bytes_items(directory: Path, metadata: Any, key: str) -> Iterable[tuple[Path, bytes]]:
    """The ``torch.save`` bytes of every non-tensor item of a DCP checkpoint, with the file they are in."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    items = {fqn for fqn, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in items:
            continue
        path = directory / info.relative_path
        if Path(info.relative_path).name != info.relative_path or info.relative_path in ("", ".", ".."):
            raise _refuse(directory, f"item {index.fqn} is stored outside it ({info.relative_path!r})", key)
        if getattr(info, "transform_descriptors", None):
            raise _refuse(path, f"item {index.fqn} is stored transformed ({info.transform_descriptors})", key)
        if not path.is_file():  # a missing data file: the readers name it
            continue
        with open(path, "rb") as stream:
            stream.seek(info.offset)
            yield path, stream.read(info.length)


def check_dcp(directory: Path, key: str = "SRC", rank: int | None = None) -> None:
    """A DCP checkpoint's metadata and every non-tensor item in its ``.distcp`` files, checked."""
    metadata = dcp_metadata(directory, key, rank=rank)
    for path, data in _bytes_items(directory, metadata, key):
        check_globals(globals_of(data, path, key), path, key)


def check_checkpoint(directory: Path, key: str = "SRC", trusted: bool = False) -> None:
    """Every pickle under ``directory`` that a reader of it may unpickle, checked before any is: for a
    checkpoint handed whole to a framework's loader (DeepSpeed, Megatron-Core, DCP)."""
    if trusted:
        return
    for path in sorted(directory.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        if found := DCP_METADATA_NAME.fullmatch(path.name):
            check_dcp(path.parent, key, None if found.group(1) is None else int(found.group(1)))
        elif path.suffix in PICKLE_SUFFIXES:
            check_globals(globals_of(path, path, key), path, key)


def dcp_reader(directory: Path, trusted: bool = False) -> Any:
    """A ``FileSystemReader`` whose metadata is read by :func:`dcp_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    directory = Path(directory)

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = dcp_metadata(directory, trusted=trusted, rank=kwargs.get("rank"))
            if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return CheckedReader(str(directory))


def dcp_planner(directory: Path, trusted: bool = False, key: str = "run.resume") -> Any:
    """A ``DefaultLoadPlanner`` that loads non-tensor items with :func:`load_bytes`
    (``torch.distributed.checkpoint``'s own loads them with ``weights_only=False``)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    directory = Path(directory)

    class CheckedPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            if trusted:
                return super().load_bytes(read_item, value)
            loaded = load_bytes(value.read(), directory, key)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes puts it
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded
            return None

    return CheckedPlanner()
