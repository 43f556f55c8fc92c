"""PyTorch's column of `brume bench kernels`.

Started by the benchmark with a folder holding cases.json and the inputs as raw
little-endian f32 files. Reads one case name per line on stdin, runs that op once
in PyTorch and answers the seconds it took; on a case's first run it also writes
the output to <case>.torch.f32 so brume can report its error. Alternating single
runs this way lets brume interleave PyTorch with its own variants.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def load(folder, name, shape):
    return torch.from_numpy(np.fromfile(folder / name, dtype="<f4").reshape(shape))


def main():
    folder = Path(sys.argv[1])
    cases = json.loads((folder / "cases.json").read_text())
    ops = {}
    for c in cases:
        name = c["name"]
        if c["op"] == "attention":
            q = load(folder, f"{name}.q.f32", c["q"])
            k = load(folder, f"{name}.k.f32", c["k"])
            v = load(folder, f"{name}.v.f32", c["k"])
            scale = c["scale"]
            ops[name] = lambda q=q, k=k, v=v, s=scale: F.scaled_dot_product_attention(q, k, v, scale=s)
            qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
            ops[name + ".bf16"] = lambda q=qb, k=kb, v=vb, s=scale: F.scaled_dot_product_attention(q, k, v, scale=s).float()
        elif c["op"] == "linear":
            x = load(folder, f"{name}.x.f32", c["x"])
            w = load(folder, f"{name}.w.f32", c["w"])
            ops[name] = lambda x=x, w=w: F.linear(x, w)
            xb, wb = x.bfloat16(), w.bfloat16()
            ops[name + ".bf16"] = lambda x=xb, w=wb: F.linear(x, w).float()
        elif c["op"] == "conv2d":
            x = load(folder, f"{name}.x.f32", c["x"])
            w = load(folder, f"{name}.w.f32", c["w"])
            ops[name] = lambda x=x, w=w, p=c["padding"]: F.conv2d(x, w, padding=p)
            xb, wb = x.bfloat16(), w.bfloat16()
            ops[name + ".bf16"] = lambda x=xb, w=wb, p=c["padding"]: F.conv2d(x, w, padding=p).float()
        else:
            x = load(folder, f"{name}.x.f32", c["x"])
            w = load(folder, f"{name}.w.f32", [c["x"][1]])
            b = load(folder, f"{name}.b.f32", [c["x"][1]])
            g, eps, silu = c["groups"], c["eps"], c["silu"]

            def gn(x=x, w=w, b=b, g=g, eps=eps, silu=silu):
                y = F.group_norm(x, g, w, b, eps)
                return F.silu(y) if silu else y

            ops[name] = gn
    written = set()
    print(f"ready torch {torch.__version__} threads {torch.get_num_threads()}", flush=True)
    with torch.inference_mode():
        for line in sys.stdin:
            name = line.strip()
            if name == "quit" or not name:
                break
            t = time.perf_counter()
            out = ops[name]()
            dt = time.perf_counter() - t
            if name not in written:
                out.contiguous().numpy().astype("<f4").tofile(folder / f"{name}.torch.f32")
                written.add(name)
            print(f"{dt:.9f}", flush=True)


if __name__ == "__main__":
    main()
