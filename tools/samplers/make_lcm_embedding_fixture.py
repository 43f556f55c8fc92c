"""diffusers' LCM guidance-scale embedding for a few w and widths.

brume feeds LCM-distilled UNets (time_cond_proj_dim) the guidance as this
sinusoidal w-embedding instead of running an unconditional branch;
`crates/brume/tests/lcm_embedding.rs` checks brume's against these values.

    /work/pyenv/bin/python tools/samplers/make_lcm_embedding_fixture.py
"""

import pathlib

import torch
from diffusers import LatentConsistencyModelPipeline
from safetensors.torch import save_file

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main():
    w = torch.tensor([0.0, 1.5, 4.0, 7.0])
    out = {"in.w": w}
    for dim in (16, 32, 256, 17):
        e = LatentConsistencyModelPipeline.get_guidance_scale_embedding(None, w, embedding_dim=dim)
        out[f"out.dim{dim}"] = e.contiguous().float()
    d = ROOT / "fixtures" / "lcm"
    d.mkdir(parents=True, exist_ok=True)
    save_file(out, d / "guidance_embedding.safetensors")


if __name__ == "__main__":
    main()
