"""What tells one checkpoint's weights from another's, cheaply, for the KV
namespace (actors/block_pool.py `kv_namespace`): two checkpoints with the same
`config.json` but other weights (a fine-tune saved with its base's config, a
preset built again by a newer builder) make other KV for the same tokens, and a
KV store on disk or a shared path outlives deployments.

Each safetensors file's header (every tensor's name, dtype, shape and offsets)
and, of every tensor, its first and last `SAMPLE_BYTES`: a fine-tune, a merged
LoRA included, changes every entry of the matrices it trains, so any trained
tensor shows in its samples; a re-sharded copy is another checkpoint here (no
hit shared, nothing wrong served). Reading them is two small reads a tensor,
not the weights: about 600 for a 0.5B Qwen2.5, 37k for a 30B-A3B mixture, read
where the weights are loaded anyway. The same bytes at another path, on another
node, or copied with other times give the same fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

SAMPLE_BYTES = 256


def weights_fingerprint(model_dir: str | Path) -> bytes:
    """A digest of the folder's safetensors weights (of nothing, where it has none)."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as file:
            try:
                (header_bytes,) = struct.unpack("<Q", file.read(8))
                if header_bytes > os.fstat(file.fileno()).st_size - 8:  # (read whole, it took all memory)
                    raise ValueError(f"a header of {header_bytes} bytes, past the file's end")
                header = file.read(header_bytes)
                tensors = json.loads(header)
                spans = sorted((info["data_offsets"] for name, info in tensors.items() if name != "__metadata__"))
            except (struct.error, ValueError, TypeError, KeyError, AttributeError, RecursionError):
                file.seek(0)  # (not a safetensors file: loading it says so; here its first bytes stand for it)
                digest.update(file.read(1 << 16))
                continue
            digest.update(header)
            for begin, end in spans:
                for start in dict.fromkeys((begin, max(begin, end - SAMPLE_BYTES))):
                    file.seek(8 + header_bytes + start)
                    digest.update(file.read(min(SAMPLE_BYTES, end - start)))
    return digest.digest()
