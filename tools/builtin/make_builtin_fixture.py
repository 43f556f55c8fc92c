"""Reference images of brume's built-in model made by diffusers itself.

Proves that the shipped `models/builtin/` folder is a standard diffusers model:
diffusers' StableDiffusionPipeline loads it and, from the same seed
(torch.Generator("cpu").manual_seed), makes the images brume's test
`crates/brume/tests/parity_builtin.rs` must reproduce (max relative
difference <= 1e-3). Re-run whenever models/builtin changes:

    /work/pyenv/bin/python tools/builtin/make_builtin_fixture.py
"""

import json
import pathlib

import diffusers
import torch
from diffusers import DDIMScheduler, LCMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from safetensors.torch import save_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "builtin"
OUT = ROOT / "fixtures" / "builtin"
CASES = [
    # (prompt, seed, steps, guidance)
    ("a large red circle on the left on a blue background", 1, 20, 5.0),
    ("a small yellow star above a green square on a white background", 2, 20, 5.0),
]
# The LCM-distilled UNet (unet_lcm/ with scheduler_lcm/), when the model has one: guidance is
# embedded (w = guidance - 1), no unconditional pass.
LCM_CASES = [
    ("a large red circle on the left on a blue background", 1, 4, 3.5),
    ("a small blue triangle on the right on a yellow background", 3, 1, 3.5),
]


def main():
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    pipe = StableDiffusionPipeline.from_pretrained(MODEL, torch_dtype=torch.float32, safety_checker=None)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    OUT.mkdir(parents=True, exist_ok=True)
    tensors, meta = {}, {"diffusers": diffusers.__version__, "torch": torch.__version__, "cases": []}
    for i, (prompt, seed, steps, guidance) in enumerate(CASES):
        kw = dict(prompt=prompt, num_inference_steps=steps, guidance_scale=guidance, eta=0.0)
        img = pipe(**kw, generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images
        lat = pipe(**kw, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent").images
        tensors[f"out.{i}.image"] = torch.from_numpy(img).contiguous().float()
        tensors[f"out.{i}.latents"] = lat.contiguous().float()
        meta["cases"].append({"prompt": prompt, "seed": seed, "steps": steps, "guidance": guidance, "sampler": "ddim"})
    if (MODEL / "unet_lcm").is_dir():
        lcm = StableDiffusionPipeline.from_pretrained(
            MODEL,
            unet=UNet2DConditionModel.from_pretrained(MODEL, subfolder="unet_lcm"),
            scheduler=LCMScheduler.from_pretrained(MODEL, subfolder="scheduler_lcm"),
            torch_dtype=torch.float32,
            safety_checker=None,
        )
        lcm.set_progress_bar_config(disable=True)
        for prompt, seed, steps, guidance in LCM_CASES:
            i = len(meta["cases"])
            kw = dict(prompt=prompt, num_inference_steps=steps, guidance_scale=guidance)
            img = lcm(**kw, generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images
            lat = lcm(**kw, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent").images
            tensors[f"out.{i}.image"] = torch.from_numpy(img).contiguous().float()
            tensors[f"out.{i}.latents"] = lat.contiguous().float()
            meta["cases"].append({"prompt": prompt, "seed": seed, "steps": steps, "guidance": guidance,
                                  "sampler": "lcm", "unet": "unet_lcm"})
    save_file(tensors, OUT / "io.safetensors")
    (OUT / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
