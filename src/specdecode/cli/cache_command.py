"""`specdecode cache list|clear`: what the package keeps in the user's cache, shown and removed
(`specdecode.cache`)."""

from __future__ import annotations

import argparse
import time

from specdecode import cache
from specdecode.cache import KINDS, format_size
from specdecode.errors import SpecdecodeError

ONE_BY_ONE = ("gguf-models", "models")  # kinds listed item by item (the rest hold many small files)


def run_list(args: argparse.Namespace) -> None:
    """Each kind: its folder, size and what it is; then each thing in it, largest first."""
    root = _root()
    print(f"{root}: {format_size(cache.total_size())} in all, limit {format_size(cache.limit())}")
    for kind, what in KINDS.items():
        found = cache.entries(kind)
        size = sum(entry.size for entry in found)
        count = f"{len(found)} item{'s' * (len(found) != 1)}"
        used = f", last used {_when(max(entry.used for entry in found))}" if found else ""
        print(f"\n{kind}: {format_size(size)}, {count}{used}: {what}")
        print(f"  {root / kind}")
        for entry in found if kind in ONE_BY_ONE else ():
            what = cache.describe(kind, entry.path)
            line = f"  {format_size(entry.size):>10}  used {_when(entry.used)}  {entry.path.name}"
            print(f"{line}  {what}" if what else line)
    for path in cache.others():
        print(f"\nnot specdecode's own kind (left by another version?): {path}")


def run_clear(args: argparse.Namespace) -> None:
    """Remove the kinds asked for (all by default), saying how much each freed."""
    root = _root()
    freed = 0
    for kind in dict.fromkeys(args.kind or KINDS):
        size = sum(entry.size for entry in cache.entries(kind))
        if size == 0 and not (root / kind).exists():
            continue
        if not args.dry_run:
            cache.clear(kind)
        freed += size
        print(f"{'would remove' if args.dry_run else 'removed'} {root / kind} ({format_size(size)})")
    print(f"{'would free' if args.dry_run else 'freed'} {format_size(freed)}")


def _root():
    try:
        return cache.root()
    except RuntimeError:  # no home directory, and no XDG_CACHE_HOME
        raise SpecdecodeError("no cache directory: set XDG_CACHE_HOME (or HOME)") from None


def _when(stamp: float) -> str:
    """An access time as a local date and minute."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp)) if stamp else "unknown"
