"""Whole txt2img runs of diffusers' StableDiffusionPipeline with every sampler.

On the tiny `fixtures/parity/pipeline_sd1/model`, each of brume's samplers is
run as diffusers runs it (scheduler class built `from_config` of the model's
own scheduler config, as users swap schedulers), with
`generator=torch.Generator("cpu").manual_seed(seed)`. brume's test
`crates/brume/tests/parity_sampler_pipelines.rs` must land on the same final
latents with `--rng torch` and the same seed (<= 1e-3 relative).

    /work/pyenv/bin/python tools/samplers/make_pipeline_fixtures.py
"""

import json
import pathlib

import diffusers
import torch
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    LCMScheduler,
    StableDiffusionPipeline,
    TCDScheduler,
    UniPCMultistepScheduler,
)
from safetensors.torch import save_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "parity" / "pipeline_sd1" / "model"
OUT = ROOT / "fixtures" / "sampler_pipelines"

# brume --sampler name -> (diffusers class, extra config)
SAMPLERS = {
    "ddim": (DDIMScheduler, {}),
    "ddpm": (DDPMScheduler, {}),
    "euler": (EulerDiscreteScheduler, {}),
    "euler_a": (EulerAncestralDiscreteScheduler, {}),
    "heun": (HeunDiscreteScheduler, {}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "use_karras_sigmas": False}),
    "dpmpp_2m_karras": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "use_karras_sigmas": True}),
    "dpmpp_2m_sde": (DPMSolverMultistepScheduler, {"algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": False}),
    "unipc": (UniPCMultistepScheduler, {}),
    "lcm": (LCMScheduler, {}),
    "tcd": (TCDScheduler, {}),
}
PROMPT = "a red circle on a blue background"
SEED, STEPS, GUIDANCE = 3, 6, 7.5


def main():
    torch.set_num_threads(2)
    pipe = StableDiffusionPipeline.from_pretrained(MODEL, torch_dtype=torch.float32, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    base = dict(pipe.scheduler.config)
    OUT.mkdir(parents=True, exist_ok=True)
    tensors, meta = {}, {"diffusers": diffusers.__version__, "torch": torch.__version__, "prompt": PROMPT,
                         "seed": SEED, "steps": STEPS, "guidance": GUIDANCE, "eta": 0.0, "samplers": {}}
    for name, (cls, extra) in SAMPLERS.items():
        pipe.scheduler = cls.from_config(base, **extra)
        lat = pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=GUIDANCE, eta=0.0,
                   generator=torch.Generator("cpu").manual_seed(SEED), output_type="latent").images
        assert torch.isfinite(lat).all(), name
        tensors[f"{name}.latents"] = lat.contiguous().float()
        meta["samplers"][name] = {"class": cls.__name__, "extra": extra,
                                  "timesteps": [float(t) for t in pipe.scheduler.timesteps]}
    save_file(tensors, OUT / "io.safetensors")
    (OUT / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
