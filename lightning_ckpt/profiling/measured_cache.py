"""Timings of this machine kept between runs: the machine rates and the keep calibration.

Timings differ from run to run by their noise, and plans made from them did too (HF BERT-48
at op level: 2 distinct plans in 5 fresh processes, its rates 14-61 % apart). What is measured
once is kept in a JSON file per kind under `LIGHTNING_CKPT_CACHE_DIR` (default
`~/.cache/lightning_ckpt`) and read back by later runs, keyed by everything it depends on:
torch's version, the device and its name, torch's thread count and the dtypes (for the
calibration also the blocks' counted work and the batch size). `LIGHTNING_CKPT_CACHE_DIR=off`
keeps nothing; `LIGHTNING_CKPT_REMEASURE=1` measures again and replaces what was kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["CACHE_ENV", "REMEASURE_ENV", "cache_dir", "kept", "machine_key"]

CACHE_ENV = "LIGHTNING_CKPT_CACHE_DIR"
REMEASURE_ENV = "LIGHTNING_CKPT_REMEASURE"
_OFF = {"", "0", "off", "false", "no", "none"}
_TOLD: set[str] = set()  # folders already said to be unwritable
MAX_ENTRIES = 64  # per kind; the oldest go first: a file stays a few tens of KB


def cache_dir() -> Path | None:
    """Where kept timings live, or None when `LIGHTNING_CKPT_CACHE_DIR` turns keeping off."""
    value = os.environ.get(CACHE_ENV)
    if value is None:
        return Path.home() / ".cache" / "lightning_ckpt"
    if value.strip().lower() in _OFF:
        return None
    return Path(value).expanduser()


def _remeasure() -> bool:
    return os.environ.get(REMEASURE_ENV, "").strip().lower() not in _OFF


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        return platform.processor() or platform.machine()
    return device.type


def machine_key(device: str | torch.device) -> dict[str, Any]:
    """What a timing on `device` depends on besides the work: torch, the device, the threads."""
    device = torch.device(device)
    return {
        "torch": torch.__version__,
        "device": device.type,
        "device_name": _device_name(device),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing, or written by something else: measured again and replaced
    return data if isinstance(data, dict) else {}


def _write(path: Path, entries: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, path)  # ranks writing at once: each file is whole, the last one stays
    except OSError as err:  # a read-only home: timings are measured in every run, said once per folder
        if str(path.parent) not in _TOLD:
            _TOLD.add(str(path.parent))
            warnings.warn(
                f"lightning-ckpt: cannot keep measured timings in {path.parent} ({err}); they are measured again in "
                f"every run. Set {CACHE_ENV} to a writable folder, or to 'off' to keep nothing.",
                stacklevel=2,
            )


def kept(kind: str, key: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The timing `measure()` returns (a JSON-able dict) for `key`, from the file of `kind` when
    one was kept, else measured now and kept."""
    folder = cache_dir()
    if folder is None:
        return measure()
    path = folder / f"{kind}.json"
    digest = _digest(key)
    entries = _read(path)
    entry = entries.get(digest)
    if not _remeasure() and isinstance(entry, dict) and entry.get("key") == json.loads(json.dumps(key, default=str)):
        return entry["value"]
    value = measure()
    entries.pop(digest, None)
    entries[digest] = {"key": key, "value": value}
    while len(entries) > MAX_ENTRIES:
        entries.pop(next(iter(entries)))
    _write(path, entries)
    return value
