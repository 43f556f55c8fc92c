#!/usr/bin/env python3
"""Reference draws of torch's CPU generator for brume's `--rng torch` (TorchRng).

Usage (from the repository root; CPU only, a few seconds, no network):

    /work/pyenv/bin/python tools/torch_rng/make_fixtures.py            # writes fixtures/torch_rng/randn.safetensors
    /work/pyenv/bin/python tools/torch_rng/make_fixtures.py --out DIR

Every draw is `torch.randn(shape, generator=g, dtype=torch.float32)` with
`g = torch.Generator("cpu").manual_seed(seed)`. Tensor names (all flattened to 1-D):

    single/<seed>/<shape>/<part>        one draw from a fresh generator
    seq<k>/<seed>/<step>/<shape>/<part> draw number <step> of a sequence from one generator

<shape> is the dims joined by 'x' (e.g. 1x4x64x64). <part>:

    full   F32, every value (draws of at most 1024 elements, plus one full 1x4x64x64 draw)
    head   F32, the first 64 values        } larger draws
    tail   F32, the last 64 values         }
    bits   I64 [sum of the f32 bit patterns, sum of (i+1) * bits_i], both mod 2^64 (as signed)  -- every draw
    sums   F64 [sum, sum of squares] of the values in float64 (math.fsum)                        -- every draw

`bits` makes the check of a draw stored only in part still bitwise; `sums` is a readable sanity value.
The output is deterministic (same torch, same bytes).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct

import numpy as np
import torch

SEEDS = [0, 1, 42, 12345, 2**32 + 7, 2**63 - 1]
SHAPES = [[1], [2], [15], [16], [17], [31], [33], [1, 4, 8, 8], [1, 4, 64, 64], [2, 4, 96, 96]]
# Consecutive draws from one generator. They cover the cached second normal of the
# small path surviving across calls and across large draws (which never touch it).
SEQUENCES = [
    (42, [[1, 4, 64, 64], [1, 4, 64, 64], [5]]),
    (0, [[3], [1], [17], [2]]),
    (12345, [[1], [1, 4, 8, 8], [1], [7]]),
    (2**63 - 1, [[5], [1, 4, 64, 64], [15], [33]]),
]
FULL_LIMIT = 1024
FULL_BIG = (42, [1, 4, 64, 64])  # at least one latent-sized draw stored whole
EDGE = 64


def shape_name(shape):
    return "x".join(str(d) for d in shape)


def record(out, prefix, values, full):
    v = values.reshape(-1)
    assert v.dtype == np.float32
    if full:
        out[f"{prefix}/full"] = v.copy()
    else:
        out[f"{prefix}/head"] = v[:EDGE].copy()
        out[f"{prefix}/tail"] = v[-EDGE:].copy()
    bits = v.view(np.uint32).astype(np.uint64)
    idx = np.arange(1, len(v) + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        s1 = int(bits.sum(dtype=np.uint64))
        s2 = int((bits * idx).sum(dtype=np.uint64))
    out[f"{prefix}/bits"] = np.array([s1, s2], dtype=np.uint64).view(np.int64)
    d = v.astype(np.float64)
    out[f"{prefix}/sums"] = np.array([math.fsum(d), math.fsum(d * d)], dtype=np.float64)


def write_safetensors(path, tensors, metadata):
    """safetensors with a sorted, compact header, so that reruns give identical bytes."""
    dtypes = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.int64): "I64"}
    header, blobs, offset = {"__metadata__": dict(sorted(metadata.items()))}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        blob = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtypes[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def draw(g, shape):
    return torch.randn(shape, generator=g, dtype=torch.float32).numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fixtures/torch_rng")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {}
    for seed in SEEDS:
        for shape in SHAPES:
            g = torch.Generator("cpu").manual_seed(seed)
            v = draw(g, shape)
            full = v.size <= FULL_LIMIT or (seed, shape) == FULL_BIG
            record(out, f"single/{seed}/{shape_name(shape)}", v, full)
    for k, (seed, shapes) in enumerate(SEQUENCES):
        g = torch.Generator("cpu").manual_seed(seed)
        for step, shape in enumerate(shapes):
            v = draw(g, shape)
            # Replaying the prefix must give the same draw (the generator state is all there is).
            record(out, f"seq{k}/{seed}/{step}/{shape_name(shape)}", v, v.size <= FULL_LIMIT)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "randn.safetensors")
    meta = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    write_safetensors(path, out, meta)
    print(f"wrote {path}: {len(out)} tensors, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
