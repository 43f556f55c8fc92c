#!/usr/bin/env python3
"""Build the sampler parity fixtures: diffusers scheduler loops driven by a synthetic model.

Usage (from the repository root; CPU only, a few seconds, no network):

    /work/pyenv/bin/python tools/samplers/make_sampler_fixtures.py             # writes fixtures/samplers/
    /work/pyenv/bin/python tools/samplers/make_sampler_fixtures.py --out DIR

For every case, fixtures/samplers/<case>.safetensors holds float32 tensors
  sample.0                  the initial sample (seeded N(0,1) times init_noise_sigma)
  in.<i>, scaled.<i>        the sample entering evaluation i, and scale_model_input of it
  out.<i>                   the synthetic model output at evaluation i
  noise.<i>                 the noise diffusers drew inside step i (only where it drew some)
  prev.<i>                  step(...).prev_sample of evaluation i
  add.x0, add.noise         add_noise inputs, add.<k> its result at timesteps[k]
and fixtures/samplers/<case>.json the case parameters: the scheduler config (as diffusers registered it, with
`_class_name`), brume's sampler name, steps, eta, timesteps, init_noise_sigma, the indices with noise and the
add_noise indices.

The synthetic model is out = 0.9 * x * cos(t / 300) + 0.1 * sin(x + t / 100), computed in float32 on the scaled
input x at timestep t: cheap, smooth and timestep dependent, so every coefficient of a sampler shows in the result.
Noise drawn inside `step` is captured by wrapping the module-level `randn_tensor` each scheduler module imports.
Deterministic: two runs give byte-identical files.
"""
from __future__ import annotations

import argparse
import inspect
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

import diffusers
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    LCMScheduler,
    TCDScheduler,
    UniPCMultistepScheduler,
)

SHAPE = (1, 4, 8, 8)

# Stable Diffusion 1.5's schedule (its scheduler_config.json, minus the PNDM-only fields).
SD15 = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    steps_offset=1,
    timestep_spacing="leading",
    prediction_type="epsilon",
)
SD21V = dict(SD15, prediction_type="v_prediction")
TRAILING = dict(SD15, timestep_spacing="trailing", steps_offset=0)
LINSPACE = dict(SD15, timestep_spacing="linspace", steps_offset=0)
LINSPACE_V = dict(LINSPACE, prediction_type="v_prediction")

# (case, class, brume sampler name, config overrides, steps, eta passed to step (TCD only))
CASES = [
    ("ddim_sd15_4", DDIMScheduler, "ddim", dict(SD15, clip_sample=False, set_alpha_to_one=False), 4, None),
    ("ddpm_sd15_4", DDPMScheduler, "ddpm", dict(SD15, clip_sample=False), 4, None),
    ("ddpm_sd21v_2", DDPMScheduler, "ddpm", dict(SD21V, clip_sample=False), 2, None),
    ("ddpm_linspace_4", DDPMScheduler, "ddpm", dict(LINSPACE), 4, None),
    ("ddpm_trailing_4", DDPMScheduler, "ddpm", dict(TRAILING, clip_sample=False), 4, None),
    ("euler_sd15_4", EulerDiscreteScheduler, "euler", SD15, 4, None),
    ("euler_sd21v_4", EulerDiscreteScheduler, "euler", SD21V, 4, None),
    ("euler_linspace_4", EulerDiscreteScheduler, "euler", LINSPACE, 4, None),
    ("euler_trailing_1", EulerDiscreteScheduler, "euler", TRAILING, 1, None),
    ("euler_karras_20", EulerDiscreteScheduler, "euler", dict(SD15, use_karras_sigmas=True), 20, None),
    (
        "euler_karras_sigma_min_4",
        EulerDiscreteScheduler,
        "euler",
        dict(LINSPACE_V, use_karras_sigmas=True, final_sigmas_type="sigma_min"),
        4,
        None,
    ),
    ("euler_a_sd15_4", EulerAncestralDiscreteScheduler, "euler_a", SD15, 4, None),
    ("euler_a_linspace_v_4", EulerAncestralDiscreteScheduler, "euler_a", LINSPACE_V, 4, None),
    ("euler_a_trailing_1", EulerAncestralDiscreteScheduler, "euler_a", TRAILING, 1, None),
    ("heun_sd15_4", HeunDiscreteScheduler, "heun", SD15, 4, None),
    ("heun_linspace_v_4", HeunDiscreteScheduler, "heun", LINSPACE_V, 4, None),
    ("heun_karras_trailing_4", HeunDiscreteScheduler, "heun", dict(TRAILING, use_karras_sigmas=True), 4, None),
    ("dpmpp_2m_sd15_20", DPMSolverMultistepScheduler, "dpmpp_2m", SD15, 20, None),
    ("dpmpp_2m_linspace_v_4", DPMSolverMultistepScheduler, "dpmpp_2m", LINSPACE_V, 4, None),
    ("dpmpp_2m_trailing_2", DPMSolverMultistepScheduler, "dpmpp_2m", TRAILING, 2, None),
    ("dpmpp_2m_karras_sd15_20", DPMSolverMultistepScheduler, "dpmpp_2m_karras", dict(SD15, use_karras_sigmas=True), 20, None),
    ("dpmpp_2m_karras_sd21v_4", DPMSolverMultistepScheduler, "dpmpp_2m_karras", dict(SD21V, use_karras_sigmas=True), 4, None),
    ("dpmpp_2m_sde_sd15_4", DPMSolverMultistepScheduler, "dpmpp_2m_sde", dict(SD15, algorithm_type="sde-dpmsolver++"), 4, None),
    (
        "dpmpp_2m_sde_linspace_v_20",
        DPMSolverMultistepScheduler,
        "dpmpp_2m_sde",
        dict(LINSPACE_V, algorithm_type="sde-dpmsolver++"),
        20,
        None,
    ),
    ("unipc_sd15_20", UniPCMultistepScheduler, "unipc", SD15, 20, None),
    ("unipc_linspace_v_4", UniPCMultistepScheduler, "unipc", LINSPACE_V, 4, None),
    ("unipc_trailing_1", UniPCMultistepScheduler, "unipc", TRAILING, 1, None),
    ("unipc_karras_4", UniPCMultistepScheduler, "unipc", dict(SD15, use_karras_sigmas=True), 4, None),
    ("lcm_1", LCMScheduler, "lcm", dict(SD15, original_inference_steps=50), 1, None),
    ("lcm_4", LCMScheduler, "lcm", dict(SD15, original_inference_steps=50), 4, None),
    ("lcm_v_4", LCMScheduler, "lcm", dict(SD21V, original_inference_steps=50), 4, None),
    ("tcd_4", TCDScheduler, "tcd", dict(SD15, original_inference_steps=50), 4, 0.3),
    ("tcd_1", TCDScheduler, "tcd", dict(SD15, original_inference_steps=50), 1, 0.3),
]


def model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=torch.float32)
    return 0.9 * x * torch.cos(t / 300) + 0.1 * torch.sin(x + t / 100)


class NoiseRecorder:
    """Wraps a scheduler module's `randn_tensor` and keeps what it returned."""

    def __init__(self, module):
        self.module = module
        self.original = getattr(module, "randn_tensor", None)  # Heun draws no noise and imports none
        self.drawn: list[torch.Tensor] = []

    def __enter__(self):
        if self.original is None:
            return self

        def wrapped(*args, **kwargs):
            out = self.original(*args, **kwargs)
            self.drawn.append(out.detach().clone())
            return out

        self.module.randn_tensor = wrapped
        return self

    def __exit__(self, *exc):
        if self.original is not None:
            self.module.randn_tensor = self.original


def registered_config(sched) -> dict:
    """The config as `save_config` would write it, minus values JSON cannot hold that equal the defaults."""
    cfg = {k: v for k, v in dict(sched.config).items() if not k.startswith("_")}
    if cfg.get("lambda_min_clipped") == float("-inf"):
        del cfg["lambda_min_clipped"]  # JSON has no -inf; absent means the same default
    return {"_class_name": type(sched).__name__, **cfg}


def make_case(name, cls, kind, overrides, steps, eta, seed):
    sched = cls(**overrides)
    sched.set_timesteps(steps)
    module = __import__(cls.__module__, fromlist=["randn_tensor"])
    timesteps = [float(t) for t in sched.timesteps]
    init_sigma = float(sched.init_noise_sigma)

    gen = torch.Generator().manual_seed(seed)
    sample = torch.randn(SHAPE, generator=gen, dtype=torch.float32) * sched.init_noise_sigma
    step_gen = torch.Generator().manual_seed(seed + 1)
    tensors = {"sample.0": sample.clone()}
    noise_at = []
    with NoiseRecorder(module) as rec:
        for i, t in enumerate(sched.timesteps):
            tensors[f"in.{i}"] = sample.clone()
            scaled = sched.scale_model_input(sample, t)
            out = model(scaled, t)
            kwargs = {"generator": step_gen} if "generator" in inspect.signature(sched.step).parameters else {}
            if eta is not None:
                kwargs["eta"] = eta
            before = len(rec.drawn)
            sample = sched.step(out, t, sample, **kwargs).prev_sample
            if len(rec.drawn) > before:
                assert len(rec.drawn) == before + 1, "one noise draw per step at most"
                tensors[f"noise.{i}"] = rec.drawn[-1].to(torch.float32).clone()
                noise_at.append(i)
            tensors[f"scaled.{i}"] = scaled.clone()
            tensors[f"out.{i}"] = out.clone()
            tensors[f"prev.{i}"] = sample.clone()
            assert torch.isfinite(sample).all()

    # add_noise at a couple of start indices, the way img2img uses it (set_begin_index first where it exists).
    g = torch.Generator().manual_seed(seed + 2)
    x0 = torch.randn(SHAPE, generator=g)
    noise = torch.randn(SHAPE, generator=g)
    tensors["add.x0"] = x0
    tensors["add.noise"] = noise
    add_at = sorted({0, len(timesteps) // 2})
    for k in add_at:
        s = cls(**overrides)
        s.set_timesteps(steps)
        if hasattr(s, "set_begin_index"):
            s.set_begin_index(k)
        tensors[f"add.{k}"] = s.add_noise(x0, noise, s.timesteps[k : k + 1])

    meta = {
        "case": name,
        "sampler": kind,
        "steps": steps,
        "eta": 0.0 if eta is None else eta,
        "config": registered_config(sched),
        "timesteps": timesteps,
        "init_noise_sigma": init_sigma,
        "evaluations": len(timesteps),
        "noise_at": noise_at,
        "add_noise_at": add_at,
        "seed": seed,
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__},
    }
    return {k: v.contiguous() for k, v in tensors.items()}, meta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fixtures/samplers")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for n, (name, cls, kind, overrides, steps, eta) in enumerate(CASES):
        tensors, meta = make_case(name, cls, kind, overrides, steps, eta, seed=1000 + n)
        save_file(tensors, str(out / f"{name}.safetensors"))
        (out / f"{name}.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        print(f"{name}: {meta['evaluations']} evaluations, noise at {meta['noise_at']}")


if __name__ == "__main__":
    main()
