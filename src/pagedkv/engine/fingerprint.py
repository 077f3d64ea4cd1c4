"""A checkpoint's identity: a fingerprint of its weights and tokenizer, never its path.

The fingerprint seeds the prefix-hash root and names the KV tiers' namespace
(``EngineConfig.model_id``), so KV computed with other weights is never served, from the device
pool, the disk or Redis, after a model folder is overwritten; and two copies of the same
checkpoint in different folders share their KV.

What is hashed (xxh3-128), in sorted file-name order, for each file:
``name, size, xxh3-128 of its whole content``. The files: ``config.json``, the weights
(``*.safetensors``, ``model.safetensors.index.json``, ``*.gguf``), and the tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, ``tokenizer.model``,
``special_tokens_map.json``). The path of one file (a GGUF checkpoint) hashes that file alone,
without its name.

Cost: headers and sizes alone cannot tell two checkpoints of the same shapes apart (a fine-tune,
another seed), so every byte is read once. A file of at least ``CACHE_MIN_BYTES`` has its content
hash cached in ``pagedkv.config.cache_dir()/fingerprints``, keyed by (resolved path, size,
mtime_ns, ctime_ns, inode): a rewrite changes ctime, which no copy tool preserves, so a cached
hash is never reused for new content. Smaller files are hashed each time (a 100 MB file
takes ~0.1 s from the page cache). A cache that cannot be written is skipped (logged at DEBUG).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import xxhash

from pagedkv.config import cache_dir
from pagedkv.errors import ModelLoadError

logger = logging.getLogger(__name__)

CACHE_MIN_BYTES = 64 << 20
_CHUNK_BYTES = 16 << 20
_FILES = (
    "config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
)
_PATTERNS = ("*.safetensors", "*.gguf")


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The files whose bytes name a checkpoint (folder or single GGUF file), sorted."""
    path = Path(model_path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} does not exist")
    found = {path / n for n in _FILES if (path / n).is_file()}
    for pattern in _PATTERNS:
        found.update(p for p in path.glob(pattern) if p.is_file())
    if not found:
        raise ModelLoadError(f"{path} holds no checkpoint files (config.json, *.safetensors)")
    return sorted(found)


def checkpoint_fingerprint(model_path: str | Path) -> str:
    """``"xxh3-128:<32 hex digits>"`` naming the checkpoint's content (module docstring)."""
    digest = xxhash.xxh3_128()
    in_folder = Path(model_path).is_dir()  # a single file's own name is not part of it
    for file in checkpoint_files(model_path):
        size = file.stat().st_size
        digest.update(json.dumps([file.name if in_folder else "", size]).encode("utf-8"))
        digest.update(bytes.fromhex(file_content_hash(file)))
    return f"xxh3-128:{digest.hexdigest()}"


def file_content_hash(file: Path) -> str:
    """xxh3-128 hex digest of a file's bytes; cached for large files (module docstring)."""
    st = file.stat()
    if st.st_size < CACHE_MIN_BYTES:
        return _hash_bytes(file)
    key = [str(file.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    entry = (
        cache_dir()
        / "fingerprints"
        / f"{xxhash.xxh3_64_hexdigest(json.dumps(key).encode('utf-8'))}.json"
    )
    try:
        cached = json.loads(entry.read_text(encoding="utf-8"))
        if cached.get("key") == key and isinstance(cached.get("xxh3_128"), str):
            return str(cached["xxh3_128"])
    except (OSError, ValueError, AttributeError):
        pass  # no entry yet, or an unreadable one: hash again
    value = _hash_bytes(file)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "xxh3_128": value}), encoding="utf-8")
        os.replace(tmp, entry)
    except OSError as exc:
        logger.debug("cannot cache the fingerprint of %s in %s: %s", file, entry, exc)
    return value


def _hash_bytes(file: Path) -> str:
    digest = xxhash.xxh3_128()
    buf = bytearray(_CHUNK_BYTES)
    view = memoryview(buf)
    try:
        with file.open("rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                digest.update(view[:n])
    except OSError as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    return digest.hexdigest()
