"""Where built tiny checkpoints live and how they are written (once, atomically)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """Where built checkpoints live: ``$DITSERVE_CACHE_DIR`` or ``~/.cache/ditserve``."""
    return Path(os.environ.get("DITSERVE_CACHE_DIR", Path.home() / ".cache" / "ditserve"))


def arch_tag(arch) -> str:
    """12 hex digits naming an architecture dataclass (its repr)."""
    return hashlib.sha1(repr(arch).encode()).hexdigest()[:12]


def save_atomically(pipe, target: Path, extra_files: dict[str, str] | None = None) -> Path:
    """Write ``pipe`` with ``save_pretrained`` (plus ``extra_files``: name -> text) into
    ``target`` unless it is already there.

    Concurrent builders (two replicas starting together) each write a temporary directory
    and rename it into place; the first rename wins, the others are discarded.
    """
    if (target / "model_index.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model_index.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
