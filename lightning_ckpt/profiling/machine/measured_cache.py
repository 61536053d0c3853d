"""Timings of this machine kept between runs: the machine rates and the keep calibration.

Timings differ from run to run by their noise, and plans made from them did too (HF BERT-48
at op level: 2 distinct plans in 5 fresh processes, its rates 14-61 % apart). What is measured
once is kept in a JSON file per kind under `LIGHTNING_CKPT_CACHE_DIR` (default
`~/.cache/lightning_ckpt`) and read back by later runs, keyed by everything it depends on:
torch's version, the device and its name, torch's thread count and the dtypes (for the
calibration also the blocks' counted work and the batch size). `LIGHTNING_CKPT_CACHE_DIR=off`
keeps nothing; `LIGHTNING_CKPT_REMEASURE=1` measures again and replaces what was kept. Entries
are checked as they are read (a damaged one is measured again, the file healed); writers take a
lock beside the file and merge, so runs writing at once lose nothing. Each write, and a read that finds
more than `MAX_ENTRIES` or entries of another machine or torch version, trims the file to this machine's
newest entries, so that a start reads a small file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
import warnings
from collections.abc import Callable, Iterator
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


def _json_form(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples as lists, other objects as their `str`)."""
    return json.loads(json.dumps(value, default=str))


def _entry_problem(digest: Any, entry: Any, check: Callable[[Any], None]) -> str | None:
    """Why `entry` (kept under `digest`) cannot be used, or None when it can: an object of exactly
    a `key` (whose digest it is kept under) and a `value` that `check` accepts."""
    if not isinstance(entry, dict) or set(entry) != {"key", "value"}:
        fields = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        return f"entry {digest!r} is {fields!r}, not an object of a 'key' and a 'value'"
    if not isinstance(entry["key"], dict) or _digest(entry["key"]) != digest:
        return f"entry {digest!r} is not kept under the digest of its key"
    try:
        check(entry["value"])
    except (TypeError, ValueError, KeyError) as err:
        return f"entry {digest!r}: {err}"
    return None


def _is_object(value: Any) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"its value is a {type(value).__name__}, not an object")


def _read(path: Path, check: Callable[[Any], None]) -> tuple[dict[str, Any], list[str]]:
    """The usable entries of the file at `path` in the order kept, and why each other one was dropped
    (a file that is not a JSON object drops everything: one reason)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, []
    except OSError:
        return {}, []  # unreadable: measured again; writing it back says what is wrong, if anything
    except ValueError as err:
        return {}, [f"it is not JSON ({err})"]
    if not isinstance(data, dict):
        return {}, [f"it holds a {type(data).__name__}, not an object of entries"]
    entries: dict[str, Any] = {}
    problems: list[str] = []
    for digest, entry in data.items():
        problem = _entry_problem(digest, entry, check)
        if problem is None:
            entries[digest] = entry
        else:
            problems.append(problem)
    return entries, problems


def _tell_dropped(path: Path, problems: list[str]) -> None:
    warnings.warn(
        f"lightning-ckpt: {len(problems)} damaged entr{'y' if len(problems) == 1 else 'ies'} of the kept timings "
        f"in {path} dropped ({problems[0]}{'; ...' if len(problems) > 1 else ''}); they are measured again when "
        "needed and the file is rewritten without them.",
        stacklevel=3,
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on a lock file beside `path` (`fcntl.flock`), so that one process or
    thread at a time reads, merges and writes it. Where there is no `flock` (not POSIX, or a file
    system without locks) it goes on unlocked: each file is still whole, an entry may be lost."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # pragma: no cover - a file system without locks
            pass
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write(path: Path, entries: dict[str, Any]) -> None:
    """`entries` into a temporary file beside `path`, flushed to disk, then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the new one, whole
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _foreign(entry: dict[str, Any]) -> bool:
    """Whether a kept entry was measured on another machine or under another torch: its key names a
    torch version, device name or core count that this machine does not have (keys without those stay)."""
    key = entry["key"]
    if not isinstance(key, dict) or "torch" not in key or "device" not in key:
        return False
    if key["torch"] != torch.__version__:
        return True
    device = key["device"]
    if device != "cpu" and not (device == "cuda" and torch.cuda.is_available()):
        return True
    here = machine_key(device)
    return any(key.get(f) != here[f] for f in ("device_name", "cpus"))


def _needs_trim(entries: dict[str, Any]) -> bool:
    """More entries than kept, or any of another machine or torch version."""
    return len(entries) > MAX_ENTRIES or any(_foreign(e) for e in entries.values())


def _merge(path: Path, check: Callable[[Any], None], new: dict[str, Any]) -> None:
    """Under the lock: read the file again (what another process kept since stays), drop what is
    damaged or of another machine or torch version (`_foreign`), put `new` in as the newest, keep the
    newest `MAX_ENTRIES`, write it whole."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            entries, _ = _read(path, check)
            entries = {d: e for d, e in entries.items() if not _foreign(e)}
            for digest, entry in new.items():
                entries.pop(digest, None)
                entries[digest] = entry
            while len(entries) > MAX_ENTRIES:
                entries.pop(next(iter(entries)))
            _write(path, entries)
    except OSError as err:  # a read-only home: timings are measured in every run, said once per folder
        if str(path.parent) not in _TOLD:
            _TOLD.add(str(path.parent))
            warnings.warn(
                f"lightning-ckpt: cannot keep measured timings in {path.parent} ({err}); they are measured again in "
                f"every run. Set {CACHE_ENV} to a writable folder, or to 'off' to keep nothing.",
                stacklevel=3,
            )


def kept(
    kind: str, key: dict[str, Any], measure: Callable[[], dict[str, Any]], check: Callable[[Any], None] | None = None
) -> dict[str, Any]:
    """The timing `measure()` returns (a JSON-able dict) for `key`, from the file of `kind` when
    one was kept, else measured now and kept.

    `check(value)` raises `ValueError` or `TypeError` for a kept value its reader cannot use (by
    default: one that is not an object). Every entry of the file is checked when it is read; what
    fails is dropped (one warning names the file), measured again when asked for, and the file
    is rewritten without it. A measured value that fails `check` is returned but not kept."""
    check = check or _is_object
    folder = cache_dir()
    if folder is None:
        return measure()
    path = folder / f"{kind}.json"
    digest = _digest(key)
    entries, problems = _read(path, check)
    if problems:
        _tell_dropped(path, problems)
    entry = entries.get(digest)
    if not _remeasure() and entry is not None and entry["key"] == _json_form(key):
        if problems or _needs_trim(entries):  # later runs read a small file
            _merge(path, check, {})
        return entry["value"]
    value = measure()
    try:
        check(_json_form(value))
    except (TypeError, ValueError, KeyError):
        if problems:
            _merge(path, check, {})
        return value
    _merge(path, check, {digest: {"key": _json_form(key), "value": _json_form(value)}})
    return value
