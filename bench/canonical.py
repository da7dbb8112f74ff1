"""The canonical training state every backend converts to and from (``bench convert``, docs/convert.md).

One directory, format ``parabench-canonical`` version 1::

    manifest.json          format, version, step, the source's job identity, checksums, sizes
    model.safetensors      full fp32 weights under the canonical (Hugging Face) names
    optimizer.safetensors  AdamW moments, ``exp_avg/<name>`` and ``exp_avg_sq/<name>`` (full, fp32)
    harness.pt             the source ranks' harness states (step, RNG streams, data ledger, losses)

The canonical checksum is SHA-256 over every tensor (name, shape, float32 little-endian bytes, in
name order) and the optimizer step: the same number before and after a conversion means the target
holds exactly the source's weights, moments and step.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "parabench-canonical"
VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
HARNESS = "harness.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")  # torch.optim.AdamW's state keys (docs/sources.md#canonical-conversion)


@dataclass
class CanonicalState:
    """Full, unsharded training state under canonical names (fp32 CPU tensors, or NumPy arrays).
    ``moments`` is None where the optimizer state is not carried (say why in ``no_optimizer``)."""

    weights: dict[str, Any]
    moments: dict[str, dict[str, Any]] | None  # "exp_avg"/"exp_avg_sq" -> name -> tensor
    step: int  # optimizer steps taken (AdamW's bias-correction counter)
    no_optimizer: str | None = None

    def tensors(self) -> dict[str, Any]:
        out = dict(self.weights)
        for key, values in (self.moments or {}).items():
            out.update({f"{key}/{n}": v for n, v in values.items()})
        return out


def _array(value):
    import numpy as np

    if hasattr(value, "detach"):
        value = value.detach().to("cpu").float().contiguous().numpy()
    return np.ascontiguousarray(value, dtype="<f4")


def checksum(state: CanonicalState) -> str:
    """SHA-256 over (name, shape, float32 bytes) of every tensor in name order, then the step."""
    h = hashlib.sha256()
    tensors = state.tensors()
    for name in sorted(tensors):
        arr = _array(tensors[name])
        h.update(name.encode())
        h.update(repr(tuple(arr.shape)).encode())
        h.update(arr.tobytes())
    h.update(f"step={state.step}".encode())
    return h.hexdigest()[:16]


def size(state: CanonicalState) -> tuple[int, int]:
    """(tensors, bytes as fp32)."""
    tensors = state.tensors()
    return len(tensors), sum(4 * int(_array(v).size) for v in tensors.values())


def write(directory: Path, state: CanonicalState, harness: list[dict[str, Any]], info: dict[str, Any]) -> dict:
    """Write the canonical directory (rank 0); returns its manifest."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    as_torch = {n: torch.from_numpy(_array(v).copy()) for n, v in state.tensors().items()}
    save_file({n: as_torch[n] for n in state.weights}, str(directory / WEIGHTS))
    if state.moments is not None:
        save_file({n: t for n, t in as_torch.items() if n not in state.weights}, str(directory / OPTIMIZER))
    torch.save(harness, directory / HARNESS)
    tensors, nbytes = size(state)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": state.step,
        "checksum": checksum(state),
        "tensors": tensors,
        "bytes": nbytes,
        "optimizer": state.moments is not None,
        "no_optimizer": state.no_optimizer,
        **info,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest, its format and version checked (ValueError with one line otherwise)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory / MANIFEST}: unreadable ({exc})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(
            f"{directory / MANIFEST}: format {manifest.get('format')!r} version {manifest.get('version')!r} "
            f"is not one this parabench reads ({FORMAT} version {VERSION})"
        )
    return manifest


def load(directory: Path) -> tuple[CanonicalState, list[dict[str, Any]]]:
    """The canonical state (torch tensors) and the source ranks' harness states."""
    import torch
    from safetensors.torch import load_file

    manifest = read_manifest(directory)
    weights = load_file(str(directory / WEIGHTS))
    moments = None
    if manifest["optimizer"]:
        flat = load_file(str(directory / OPTIMIZER))
        moments = {k: {n.split("/", 1)[1]: t for n, t in flat.items() if n.startswith(k + "/")} for k in MOMENTS}
    harness = torch.load(directory / HARNESS, weights_only=True)
    return CanonicalState(weights, moments, int(manifest["step"]), manifest.get("no_optimizer")), harness
