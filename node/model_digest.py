"""A model folder's identity: one SHA-256 over every file that decides what KV a prompt makes.

Two replicas may exchange KV blocks only if a prompt's KV means the same on both: the same token
ids (the tokenizer files), the same architecture (``config.json``) and the same weights (the
``*.safetensors``). The served model name does not say so: a rollout to a new revision keeps it.
:func:`model_digest` hashes, in file-name order:

- each of :data:`SMALL_FILES` present: its name and contents (read at each start: kilobytes to a
  few megabytes);
- each ``*.safetensors``: its name, size, the SHA-256 of its header (tensor names, dtypes, shapes
  and offsets, read at each start) and the SHA-256 of its whole contents.

The contents hash is the costly part (16 GB of weights for an 8B model, 141 GB for a 70B). It is
paid once per file, never at each start:

- a file in the Hugging Face hub cache (``models--org--name/snapshots/<rev>/f`` links to
  ``blobs/<sha256>``, how :mod:`cadenza.node.hub` downloads) is named by the SHA-256 of its
  contents (the LFS object id the Hub publishes): the name is used, the file is not read;
- any other file is hashed once and the result kept in ``<cache>/weights-sha256/`` (the user's
  cadenza cache, :func:`cadenza.node.embedded.cache_dir`), keyed by its real path, size,
  ``mtime_ns``, ``ctime_ns``, inode and device: a later start with the same file reads it back,
  and a file changed in any way (even with its mtime put back, which resets ``ctime``) is hashed
  again. Files under :data:`CACHE_MIN_BYTES` are hashed every time (cheaper than the bookkeeping).
  An unwritable cache only costs the hash at each start.

A hub snapshot and a plain copy of the same files have the same digest (both are SHA-256 of the
contents). Not a defence against someone who can write the files or the cache (they can change
the weights themselves); it tells two honest replicas apart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import time
from pathlib import Path

from cadenza.node.embedded import cache_dir

log = logging.getLogger(__name__)

# Files besides the weights that change what a prompt's KV is: the architecture, and the token ids
# (tokenizer, its settings, the chat template that wraps messages).
SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
               "special_tokens_map.json", "chat_template.jinja")
CACHE_MIN_BYTES = 64 * 2**20  # smaller weights files are hashed at each start
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header longer than this is not one
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def model_digest(folder: str | Path, cache: Path | None = None) -> str:
    """The hex SHA-256 identifying ``folder``'s model (see the module docstring).

    Args:
        folder: a Hugging Face model folder (``config.json``, ``*.safetensors``, tokenizer).
        cache: where contents hashes are kept (None: ``<cadenza cache>/weights-sha256``).

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``folder``.
        ValueError: a ``*.safetensors`` file whose header cannot be read.
    """
    folder = Path(folder)
    cache = cache if cache is not None else cache_dir() / "weights-sha256"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    started, how = time.perf_counter(), {"hub": 0, "cached": 0, "hashed": 0}
    digest = hashlib.sha256(b"cadenza model digest 1\0")
    for name in SMALL_FILES:
        if (folder / name).is_file():
            _part(digest, name.encode(), (folder / name).read_bytes())
    for path in weights:
        contents, source = file_sha256(path, cache)
        how[source] += 1
        _part(digest, path.name.encode(), str(path.stat().st_size).encode(), _header_sha256(path),
              bytes.fromhex(contents))
    log.info("model digest of %s: %s (%d weights files: %d named by the hub cache, %d from the digest cache, "
             "%d hashed; %.2f s)", folder, digest.hexdigest()[:16], len(weights), how["hub"], how["cached"],
             how["hashed"], time.perf_counter() - started)
    return digest.hexdigest()


def file_sha256(path: Path, cache: Path) -> tuple[str, str]:
    """``(hex SHA-256 of the file's contents, where it came from)``: ``hub`` (the blob's name),
    ``cached`` (an earlier start hashed this very file) or ``hashed`` (read now, then cached)."""
    real = Path(os.path.realpath(path))
    if real.parent.name == "blobs" and _SHA256.match(real.name):
        return real.name, "hub"
    st = real.stat()
    if st.st_size < CACHE_MIN_BYTES:
        return _hash_file(real), "hashed"
    key = {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
           "inode": st.st_ino, "device": st.st_dev}
    entry = cache / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest() + ".json")
    try:
        found = json.loads(entry.read_text())
        if found.get("key") == key and _SHA256.match(str(found.get("sha256"))):
            return found["sha256"], "cached"
    except (OSError, ValueError):
        pass  # not cached yet (or unreadable): hash it
    sha = _hash_file(real)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache, suffix=".tmp", delete=False) as f:
            json.dump({"key": key, "sha256": sha}, f)
        os.replace(f.name, entry)  # atomic: replicas starting together never read half an entry
    except OSError as exc:
        log.warning("cannot cache the SHA-256 of %s in %s (%s): it is hashed again at each start", real, cache, exc)
    return sha, "hashed"


def _hash_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _header_sha256(path: Path) -> bytes:
    """SHA-256 of a safetensors file's header: an 8-byte little-endian length, then that much JSON."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", prefix)
        header = f.read(n) if n <= MAX_HEADER_BYTES else b""
    if not 0 < len(header) == n:
        raise ValueError(f"{path}: not a safetensors file (a header of {n} bytes)")
    return hashlib.sha256(header).digest()


def _part(digest, *fields: bytes) -> None:
    """Each field length-prefixed, so no two different inputs hash the same stream."""
    for field in fields:
        digest.update(struct.pack("<Q", len(field)))
        digest.update(field)
