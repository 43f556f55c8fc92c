#!/usr/bin/env python3
"""Reference outputs of diffusers' editing pipelines (img2img, inpainting) on tiny random-weight models.

Usage (from the repository root; CPU only, ~1 minute on 2 cores, no network):

    /work/pyenv/bin/python tools/edit_fixtures/make_edit_fixtures.py            # writes fixtures/edit/
    /work/pyenv/bin/python tools/edit_fixtures/make_edit_fixtures.py --out DIR

Reuses the complete tiny StableDiffusionPipeline folder fixtures/parity/pipeline_sd1/model/ (written by
tools/parity/make_fixtures.py). Writes, under fixtures/edit/:

  input.png, mask.png          (copies live in each case folder) the synthetic 64x64 RGB picture / the 64x64 L mask
  img2img/                     StableDiffusionImg2ImgPipeline, strength 0.6, 10 steps (6 run), seed 7
  img2img_1step/               same, strength 0.5, 2 steps (1 run)
  inpaint_9ch/                 StableDiffusionInpaintPipeline with a 9-channel UNet; model/ is the complete pipeline
                               folder (text encoder / tokenizer / VAE / scheduler copied from pipeline_sd1)
  inpaint_4ch/                 StableDiffusionInpaintPipeline with pipeline_sd1's ordinary 4-channel UNet
  img2img_lcm_pipeline/        LatentConsistencyModelImg2ImgPipeline: pipeline_sd1's text encoder / tokenizer / VAE,
                               the LCM UNet LCM_UNET, LCMScheduler; strength 0.6, 4 steps, guidance 3.5, seed 7;
                               model/ holds model_index.json, scheduler/ and that UNet (unet/: pipeline_sd1's UNet
                               config + time_cond_proj_dim 16, weights drawn anew), nothing of pipeline_sd1
  img2img_lcm_sd_pipeline/     the same components through StableDiffusionImg2ImgPipeline (4-step schedule, 2 run)

Each case folder has io.safetensors (out.*, noise.<k>) and meta.json (parameters, preprocessing facts, noise draw
order). Every random tensor diffusers draws (all go through diffusers.utils.torch_utils.randn_tensor) is captured
in call order as `noise.<k>`; each case is then re-run with randn_tensor replaying those tensors and a DIFFERENT
generator seed, and must reproduce every output bit-exactly (so the recorded draws are all the randomness used).
Every case is also run twice and must give identical tensors. Deterministic: two runs of the script give
byte-identical files (the script deletes and rewrites the output directory).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[2]
THIS_CODE_FILE = (lambda: 0).__code__.co_filename  # co_filename of this script's functions
sys.path.insert(0, str(REPO / "tools" / "parity"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import PIL  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import diffusers  # noqa: E402
import diffusers.utils.torch_utils as torch_utils  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    DiffusionPipeline,
    LatentConsistencyModelImg2ImgPipeline,
    LatentConsistencyModelPipeline,
    LCMScheduler,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextModel, CLIPTokenizer  # noqa: E402

import make_fixtures as mf  # noqa: E402  (tools/parity/make_fixtures.py: randomize_, stats, VERSIONS, ...)

diffusers.utils.logging.disable_progress_bar()

SD1 = REPO / "fixtures" / "parity" / "pipeline_sd1" / "model"
DEFAULT_OUT = REPO / "fixtures" / "edit"
PROMPT = "a red circle on a blue background"
UNET9_SEED = 211  # weight seed of the 9-channel inpainting UNet (randomize_ recipe of tools/parity)
# LCM UNet of the img2img_lcm_* cases: pipeline_sd1's UNet config with time_cond_proj_dim 16, weights drawn anew
# (fixtures/parity/unet_lcm's cross_attention_dim is 24, not pipeline_sd1's CLIP hidden size 8); main() writes it here.
LCM_UNET = REPO / "fixtures" / "edit" / "img2img_lcm_pipeline" / "model" / "unet"
LCM_UNET_SEED = 305
LCM_COND_DIM = 16
LCM_SCHED_KW = {"original_inference_steps": 50, "timestep_scaling": 10.0}  # LCMScheduler.from_config(<sd1 cfg>, **)
LCM_STRENGTH, LCM_STEPS, LCM_GUIDANCE, LCM_SEED = 0.6, 4, 3.5, 7
REPLAY_SEED = 123456  # generator seed of the replay check (must not matter)
H = W = 64

ORIG_RANDN = torch_utils.randn_tensor


# ----------------------------------------------------------------------------------------------------------------------
# synthetic inputs
# ----------------------------------------------------------------------------------------------------------------------
def make_input_image() -> Image.Image:
    """64x64 RGB: blue vertical gradient background with a horizontal ripple, a red disc (radius 18, centre (30, 34)),
    a yellow-ish square in the top-left corner. Pure numpy arithmetic, no RNG."""
    y, x = np.mgrid[0:H, 0:W].astype(np.float64)
    r = 20 + 30 * (x / (W - 1)) + 10 * np.sin(y / 5.0)
    g = 40 + 60 * (y / (H - 1)) + 15 * np.cos(x / 7.0)
    b = 150 + 80 * (1 - y / (H - 1))
    disc = (x - 30) ** 2 + (y - 34) ** 2 <= 18 ** 2
    r = np.where(disc, 220 - 40 * (y - 16) / 36, r)
    g = np.where(disc, 30 + 20 * np.sin(x / 3.0), g)
    b = np.where(disc, 40, b)
    sq = (x < 12) & (y < 12)
    r = np.where(sq, 240, r)
    g = np.where(sq, 210, g)
    b = np.where(sq, 60, b)
    rgb = np.stack([r, g, b], -1).round().clip(0, 255).astype(np.uint8)
    return Image.fromarray(rgb, mode="RGB")


MASK_RECIPE = (
    "64x64 8-bit L, 0 = keep, 255 = repaint: core rectangle rows 16..39 x cols 24..47 = 255; left soft edge "
    "cols 8..23 (rows 16..39) = round(255*(col-7)/17) (15 .. 240, crosses the 0.5 threshold between col 15 (120) and "
    "col 16 (135)); right grey band cols 48..51 (rows 16..39) = 128 (-> 1 after binarisation); bottom grey band "
    "rows 40..43 (cols 8..51) = 127 (-> 0); top soft edge rows 10..15 (cols 24..47) = 40*(row-9) (40..240); rest 0."
)


def make_mask() -> Image.Image:
    m = np.zeros((H, W), np.float64)
    m[16:40, 24:48] = 255
    for c in range(8, 24):
        m[16:40, c] = round(255 * (c - 7) / 17)
    m[16:40, 48:52] = 128
    m[40:44, 8:52] = 127
    for r in range(10, 16):
        m[r, 24:48] = 40 * (r - 9)
    return Image.fromarray(m.astype(np.uint8), mode="L")


# ----------------------------------------------------------------------------------------------------------------------
# randn_tensor capture / replay
# ----------------------------------------------------------------------------------------------------------------------
def _randn_modules() -> list:
    """Every loaded diffusers module that holds the original randn_tensor under that name."""
    return [m for n, m in list(sys.modules.items())
            if n.startswith("diffusers") and m is not None and getattr(m, "randn_tensor", None) is ORIG_RANDN]


class RandnHook:
    """Patch `randn_tensor` in every diffusers module. mode 'capture': call the original and record (tensor, call
    path); mode 'replay': return the recorded tensors in order (the generator is never touched)."""

    def __init__(self, mode: str, replay: list | None = None):
        self.mode = mode
        self.replay = list(replay or [])
        self.draws: list[tuple[torch.Tensor, str]] = []
        self.mods = _randn_modules()

    def __call__(self, shape, generator=None, device=None, dtype=None, layout=None):
        import inspect

        names = []
        f = inspect.currentframe().f_back
        while f is not None:
            q = f.f_code.co_qualname
            if f.f_code.co_filename != THIS_CODE_FILE:  # skip this script's probe wrappers
                names.append(q)
            if q.endswith(".__call__") and "Pipeline" in q:
                break
            f = f.f_back
        path = " > ".join(reversed(names))
        if self.mode == "capture":
            t = ORIG_RANDN(shape, generator=generator, device=device, dtype=dtype, layout=layout)
            self.draws.append((t.detach().clone(), path))
            return t
        k = len(self.draws)
        t = self.replay[k]
        assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, (k, t.shape, shape, t.dtype, dtype)
        self.draws.append((t, path))
        return t.clone()

    def __enter__(self):
        for m in self.mods:
            m.randn_tensor = self
        return self

    def __exit__(self, *a):
        for m in self.mods:
            m.randn_tensor = ORIG_RANDN
        if self.mode == "replay":
            assert len(self.draws) == len(self.replay), (len(self.draws), len(self.replay))


# ----------------------------------------------------------------------------------------------------------------------
# running a pipeline with probes
# ----------------------------------------------------------------------------------------------------------------------
def run_once(pipe, kind: str, kwargs: dict, seed: int, hook: RandnHook) -> dict:
    """One call with output_type 'np' and one with 'latent' (both under the same hook semantics: the hook is
    shared, so its draws list holds the np run's draws followed by the latent run's draws)."""
    probes: dict = {}
    add_noise_calls = []
    orig_add_noise = pipe.scheduler.add_noise

    def add_noise(original_samples, noise, timesteps):
        add_noise_calls.append((original_samples.detach().clone(), noise.detach().clone(), timesteps.clone()))
        return orig_add_noise(original_samples, noise, timesteps)

    orig_pre = pipe.image_processor.preprocess

    def img_pre(*a, **k):
        out = orig_pre(*a, **k)
        probes.setdefault("init_image", out.detach().clone())
        return out

    patches = [(pipe.scheduler, "add_noise", add_noise), (pipe.image_processor, "preprocess", img_pre)]
    if kind == "inpaint":
        orig_mpre = pipe.mask_processor.preprocess

        def mask_pre(*a, **k):
            out = orig_mpre(*a, **k)
            probes.setdefault("mask_condition", out.detach().clone())
            return out

        orig_pml = pipe.prepare_mask_latents

        def pml(mask, masked_image, *a, **k):
            probes.setdefault("masked_image", masked_image.detach().clone())
            m, mil = orig_pml(mask, masked_image, *a, **k)
            probes.setdefault("mask_latent_cfg", m.detach().clone())
            probes.setdefault("masked_image_latents_cfg", mil.detach().clone())
            return m, mil

        patches += [(pipe.mask_processor, "preprocess", mask_pre), (pipe, "prepare_mask_latents", pml)]

    steps, ts = [], []

    def cb(_p, i, t, kw):
        steps.append(kw["latents"].detach().clone())
        ts.append(int(t))
        return {}

    for obj, name, fn in patches:
        setattr(obj, name, fn)
    try:
        with torch.no_grad(), hook:
            n0 = len(hook.draws)
            img = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
                       callback_on_step_end=cb).images
            n_np = len(hook.draws) - n0
            n_add_np = len(add_noise_calls)
            lat = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent").images
    finally:
        for obj, name, _ in patches:
            if name in obj.__dict__:
                delattr(obj, name)

    n_steps = len(ts)
    out = {
        "image": torch.from_numpy(np.ascontiguousarray(img)).float(),
        "latents": lat.detach().clone(),
        "step_latents": torch.stack(steps[:n_steps]),
        "timesteps": torch.tensor(ts, dtype=torch.int64),
        "init_image": probes["init_image"],
    }
    assert torch.equal(out["step_latents"][-1], out["latents"]), "latent run != np run's final latents"
    if kind == "inpaint":
        out["mask_condition"] = probes["mask_condition"]
        out["masked_image"] = probes["masked_image"]
        out["mask_latent"] = probes["mask_latent_cfg"][:1].clone()
        out["masked_image_latents"] = probes["masked_image_latents_cfg"][:1].clone()
        for k, v in (("mask_latent", "mask_latent_cfg"), ("masked_image_latents", "masked_image_latents_cfg")):
            assert probes[v].shape[0] == 2 and torch.equal(probes[v][0], probes[v][1]), k
    if n_add_np:
        out["init_latents"] = add_noise_calls[0][0]
    return {"out": out, "n_draws_np": n_np, "add_noise_calls": add_noise_calls[:n_add_np]}


def run_case(pipe, kind: str, kwargs: dict, seed: int) -> tuple[dict, list]:
    cap = RandnHook("capture")
    r = run_once(pipe, kind, kwargs, seed, cap)
    n = r["n_draws_np"]
    draws = cap.draws[:n]
    # the latent-output run drew exactly the same tensors
    assert len(cap.draws) == 2 * n
    for (a, pa), (b, pb) in zip(draws, cap.draws[n:]):
        assert torch.equal(a, b) and pa == pb
    # noise.k is simply the k-th torch.randn(shape, generator) from a fresh Generator(seed)
    g = torch.Generator("cpu").manual_seed(seed)
    for t, _ in draws:
        assert torch.equal(torch.randn(t.shape, generator=g, dtype=t.dtype), t)
    # second capture run: identical
    r2 = run_once(pipe, kind, kwargs, seed, RandnHook("capture"))
    for k, v in r["out"].items():
        assert torch.equal(v, r2["out"][k]), f"second run differs in {k}"
    # replay with a different seed: randn_tensor returns the recorded tensors -> identical outputs
    noises = [t for t, _ in draws]
    rep = run_once(pipe, kind, kwargs, REPLAY_SEED, RandnHook("replay", noises + noises))
    for k, v in r["out"].items():
        assert torch.equal(v, rep["out"][k]), f"replay differs in {k}"
    return r, draws


def describe_draws(draws: list, kind: str, strength: float, unet_in: int) -> list:
    res = []
    for k, (t, path) in enumerate(draws):
        if "DiagonalGaussianDistribution.sample" in path:
            what = "masked image (masked_image = init_image * (mask_condition < 0.5))" \
                if "prepare_mask_latents" in path else "input image (init_image)"
            purpose = (f"VAE latent_dist.sample of the {what}: latents = scaling_factor * (mean + exp(0.5*logvar) * "
                       f"noise), logvar clamped to [-30, 20]")
        elif "prepare_latents" in path:
            if kind == "img2img":
                purpose = "add_noise noise: latents = scheduler.add_noise(init_latents, noise, timesteps[0])"
            elif strength == 1.0:
                purpose = "initial latents: strength 1.0 -> latents = noise * init_noise_sigma (1.0); the image is " \
                          "NOT encoded here for a 9-channel UNet"
            else:
                purpose = ("add_noise noise: latents = scheduler.add_noise(image_latents, noise, timesteps[0]); "
                           "the SAME tensor is reused (no new draw) to re-noise image_latents to timesteps[i+1] "
                           "after every step but the last" + (" (4-channel UNet blend)" if unet_in == 4 else ""))
        elif "LCMScheduler.step" in path:
            purpose = ("LCM step noise z: prev_sample = sqrt(acp[prev_t]) * denoised + sqrt(1 - acp[prev_t]) * z, "
                       "drawn in every LCMScheduler.step whose step_index != num_inference_steps - 1")
        else:
            purpose = "unexpected"
        res.append({"name": f"noise.{k}", "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                    "call_path": path, "purpose": purpose})
    return res


# ----------------------------------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------------------------------
def write_case(d: Path, out: dict, draws: list, meta: dict, image_png: Path, mask_png: Path | None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(image_png, d / "input.png")
    if mask_png is not None:
        shutil.copyfile(mask_png, d / "mask.png")
    tensors = {}
    for k, v in out.items():
        mf.check_output(f"{d.name}:out.{k}", v)
        tensors[f"out.{k}"] = v.detach().contiguous().cpu()
    for i, (t, _) in enumerate(draws):
        tensors[f"noise.{i}"] = t.contiguous().cpu()
    for k, v in tensors.items():
        assert v.dtype in (torch.float32, torch.int64), (k, v.dtype)
    save_file(tensors, str(d / "io.safetensors"))
    meta = {
        **meta,
        "tensors": {k: mf.stats(v) for k, v in tensors.items()},
        "tolerance": "max|brume - out| / max|out| <= 1e-3 per out.* tensor (noise.* are inputs to replay)",
        "versions": {**mf.VERSIONS, "pillow": PIL.__version__},
        "generator": "tools/edit_fixtures/make_edit_fixtures.py",
    }
    (d / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


COMMON_CHECKS = (
    "checked before writing: two runs give identical tensors; the output_type='latent' run equals the 'np' run's "
    "final latents and drew the same tensors; noise.k == k-th torch.randn(shape, generator=Generator('cpu')."
    "manual_seed(seed)); a re-run with randn_tensor patched to return noise.0, noise.1, ... in order and a "
    f"different generator seed ({REPLAY_SEED}) reproduces every out.* tensor bit-exactly"
)

IMAGE_PREPROCESS = {
    "image_processor": "VaeImageProcessor(vae_scale_factor=8, resample='lanczos', do_normalize=True)",
    "steps": "PIL RGB image -> get_default_height_width: (h - h % 8, w - w % 8) = (64, 64) -> PIL resize((64, 64), "
             "LANCZOS) which is a no-op copy when the size is unchanged (PIL returns self.copy()) -> "
             "np.array(img).astype(float32) / 255 -> NCHW -> 2*x - 1",
    "resized": False,
    "check": "out.init_image == torch.tensor(np.array(input.png)/255 as float32).permute(2,0,1)[None]*2-1 exactly",
    "dtype": "float32",
}

DDIM_NOTE = ("DDIM leading spacing, steps_offset 1: full schedule = arange(steps)*(1000//steps) reversed + 1; "
             "get_timesteps: init_timestep = min(int(steps*strength), steps), t_start = max(steps - init_timestep, "
             "0), run schedule[t_start:] (out.timesteps); noise level for the start = out.timesteps[0]; add_noise: "
             "sqrt(acp[t]) x0 + sqrt(1-acp[t]) noise with acp the float32 alphas_cumprod; eta 0 -> DDIM step draws no "
             "noise; last step prev_t < 0 -> alpha_prev = acp[0]")


def img_tensor_from_png(p: Path) -> torch.Tensor:
    a = np.array(Image.open(p)).astype(np.float32) / 255.0
    return torch.from_numpy(a).permute(2, 0, 1)[None] * 2.0 - 1.0


def case_img2img(root: Path, name: str, image_png: Path, strength: float, steps: int, seed: int) -> dict:
    pipe = StableDiffusionImg2ImgPipeline.from_pretrained(SD1, safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe.scheduler).__name__ == "DDIMScheduler"
    image = Image.open(image_png)
    image.load()
    kwargs = dict(prompt=PROMPT, image=image, strength=strength, num_inference_steps=steps, guidance_scale=7.5,
                  eta=0.0)
    r, draws = run_case(pipe, "img2img", kwargs, seed)
    out = r["out"]
    assert torch.equal(out["init_image"], img_tensor_from_png(image_png))
    with torch.no_grad():
        pe, ne = pipe.encode_prompt(PROMPT, torch.device("cpu"), 1, True, None)
    out["prompt_embeds"] = pe
    out["negative_prompt_embeds"] = ne
    # add_noise happened once, with noise.1
    assert len(r["add_noise_calls"]) == 1
    x0, nz, tt = r["add_noise_calls"][0]
    assert torch.equal(nz, draws[1][0]) and tt.tolist() == [int(out["timesteps"][0])]
    sf = pipe.vae.config.scaling_factor
    full = pipe.scheduler.timesteps  # after the latent run: the full schedule
    meta = {
        "case": name,
        "description": f"StableDiffusionImg2ImgPipeline.from_pretrained(fixtures/parity/pipeline_sd1/model) "
                       f"(DDIM from that folder), strength {strength}, {steps} steps -> {len(out['timesteps'])} run",
        "model": "fixtures/parity/pipeline_sd1/model",
        "pipeline_class": "diffusers.StableDiffusionImg2ImgPipeline",
        "call": {"prompt": PROMPT, "negative_prompt": None, "image": "input.png (PIL RGB, 64x64)",
                 "strength": strength, "num_inference_steps": steps, "guidance_scale": 7.5, "eta": 0.0,
                 "generator": f"torch.Generator('cpu').manual_seed({seed})", "output_type": ["np", "latent"]},
        "prompt": PROMPT, "steps": steps, "strength": strength, "guidance": 7.5, "seed": seed, "eta": 0.0,
        "timesteps_run": out["timesteps"].tolist(),
        "full_schedule": full.tolist(),
        "scheduler_note": DDIM_NOTE,
        "vae_scaling_factor": sf,
        "preprocessing": {"image": IMAGE_PREPROCESS},
        "algorithm": [
            "prompt_embeds = cat([text_encoder('' padded to 77), text_encoder(prompt)]) (CFG on, negative None -> '')",
            "init_image = preprocess(input.png) [1,3,64,64] in [-1,1] (out.init_image)",
            "moments = vae.encode(init_image): mean, logvar; init_latents = scaling_factor * (mean + exp(0.5*logvar) "
            "* noise.0) (out.init_latents)",
            "latents = scheduler.add_noise(init_latents, noise.1, timesteps_run[0])",
            "for t in timesteps_run: eps = unet(cat([latents]*2), t, prompt_embeds) -> uncond + 7.5*(text-uncond); "
            "latents = ddim_step(eps, t, latents)  (out.step_latents[i] after step i)",
            "out.latents = final latents; out.image = (vae.decode(latents / scaling_factor)/2 + 0.5).clamp(0,1) NHWC",
        ],
        "noise_draws": describe_draws(draws, "img2img", strength, 4),
        "outputs_note": "out.image [1,64,64,3] output_type='np'; out.latents output_type='latent'; out.init_latents "
                        "scaled VAE sample (scaling_factor applied, before add_noise); out.init_image the "
                        "preprocessed image; out.step_latents[i] latents after step i; out.timesteps the timesteps "
                        "actually run (int64); out.prompt_embeds / out.negative_prompt_embeds [1,77,8]",
        "checks": COMMON_CHECKS,
    }
    write_case(root / name, out, draws, meta, image_png, None)
    return meta


def build_unet9(model_dir: Path) -> dict:
    """pipeline_sd1's UNet config with in_channels 9, re-randomised (tools/parity randomize_ recipe)."""
    cfg = json.loads((SD1 / "unet" / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg["in_channels"] = 9
    unet = UNet2DConditionModel.from_config(cfg).eval()
    init = mf.randomize_(unet, UNET9_SEED)
    unet.save_pretrained(model_dir / "unet", safe_serialization=True)
    re = UNet2DConditionModel.from_pretrained(model_dir / "unet").eval()
    for (n, a), (_, b) in zip(unet.state_dict().items(), re.state_dict().items()):
        assert torch.equal(a, b), n
    return init


def build_lcm_unet(unet_dir: Path) -> dict:
    """pipeline_sd1's UNet config with time_cond_proj_dim LCM_COND_DIM, re-randomised (tools/parity randomize_ recipe)."""
    cfg = json.loads((SD1 / "unet" / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg["time_cond_proj_dim"] = LCM_COND_DIM
    unet = UNet2DConditionModel.from_config(cfg).eval()
    init = mf.randomize_(unet, LCM_UNET_SEED)
    unet.save_pretrained(unet_dir, safe_serialization=True)
    re = UNet2DConditionModel.from_pretrained(unet_dir).eval()
    for (n, a), (_, b) in zip(unet.state_dict().items(), re.state_dict().items()):
        assert torch.equal(a, b), n
    return init


def write_inpaint_folder(model_dir: Path) -> dict:
    model_dir.mkdir(parents=True)
    for sub in ("text_encoder", "tokenizer", "vae", "scheduler"):
        shutil.copytree(SD1 / sub, model_dir / sub)
    init = build_unet9(model_dir)
    idx = json.loads((SD1 / "model_index.json").read_text())
    idx["_class_name"] = "StableDiffusionInpaintPipeline"
    (model_dir / "model_index.json").write_text(json.dumps(idx, indent=2, sort_keys=True) + "\n")
    return init


def case_inpaint(root: Path, name: str, model_dir: Path, image_png: Path, mask_png: Path, strength: float,
                 steps: int, seed: int, extra_meta: dict) -> dict:
    pipe = DiffusionPipeline.from_pretrained(model_dir, safety_checker=None, requires_safety_checker=False) \
        if model_dir != SD1 else StableDiffusionInpaintPipeline.from_pretrained(
            SD1, safety_checker=None, requires_safety_checker=False)
    assert type(pipe) is StableDiffusionInpaintPipeline, type(pipe)
    pipe.set_progress_bar_config(disable=True)
    unet_in = pipe.unet.config.in_channels
    image = Image.open(image_png)
    image.load()
    mask = Image.open(mask_png)
    mask.load()
    assert mask.mode == "L"
    kwargs = dict(prompt=PROMPT, image=image, mask_image=mask, height=H, width=W, strength=strength,
                  num_inference_steps=steps, guidance_scale=7.5, eta=0.0)
    r, draws = run_case(pipe, "inpaint", kwargs, seed)
    out = r["out"]
    with torch.no_grad():
        pe, ne = pipe.encode_prompt(PROMPT, torch.device("cpu"), 1, True, None)
    out["prompt_embeds"] = pe
    out["negative_prompt_embeds"] = ne

    # ---- preprocessing facts, checked
    img_t = img_tensor_from_png(image_png)
    assert torch.equal(out["init_image"], img_t)
    raw = torch.from_numpy(np.array(mask).astype(np.float32) / 255.0)[None, None]
    binar = raw.clone()
    binar[binar < 0.5] = 0
    binar[binar >= 0.5] = 1
    assert torch.equal(out["mask_condition"], binar)
    assert not torch.equal(raw, binar)
    assert torch.equal(out["masked_image"], img_t * (binar < 0.5))
    ml = torch.nn.functional.interpolate(binar, size=(H // 8, W // 8))  # mode 'nearest'
    assert torch.equal(out["mask_latent"], ml)
    assert torch.equal(ml, binar[:, :, ::8, ::8])  # nearest 64 -> 8 picks pixel 8*i
    ml_raw = torch.nn.functional.interpolate(raw, size=(H // 8, W // 8))
    assert not torch.equal((ml_raw > 0).float(), ml) and not torch.equal(ml_raw, ml), "binarisation should matter"
    sf = pipe.vae.config.scaling_factor

    n_add = len(r["add_noise_calls"])
    if unet_in == 4:
        # add_noise: once in prepare_latents, then after every step but the last (blend), all with noise.1
        assert n_add == 1 + (len(out["timesteps"]) - 1)
        for x0, nz, _ in r["add_noise_calls"]:
            assert torch.equal(x0, out["init_latents"]) and torch.equal(nz, draws[1][0])
    else:
        assert n_add == 0 and strength == 1.0
        assert "init_latents" not in out

    full = pipe.scheduler.timesteps
    prep = {
        "image": IMAGE_PREPROCESS,
        "height_width": f"passed explicitly as {H}x{W} (the default would be unet.config.sample_size * 8 = "
                        f"{pipe.unet.config.sample_size * 8})",
        "mask": {
            "mask_processor": "VaeImageProcessor(vae_scale_factor=8, do_normalize=False, do_binarize=True, "
                              "do_convert_grayscale=True)",
            "steps": "PIL mask -> resize((64, 64), LANCZOS) (no-op copy at 64x64; resize comes BEFORE the "
                     "grayscale conversion) -> convert('L') (no-op for an L image) -> np.array/255 float32 -> "
                     "[1,1,64,64] -> NO normalisation -> binarise: x[x < 0.5] = 0; x[x >= 0.5] = 1 "
                     "(8-bit: <= 127 -> 0, >= 128 -> 1) (out.mask_condition)",
            "binarise_threshold": 0.5,
            "binarise_rule": "value >= 0.5 -> 1 (repaint), value < 0.5 -> 0 (keep)",
            "resized": False,
        },
        "masked_image": "masked_image = init_image * (mask_condition < 0.5)  (init_image in [-1,1], so masked "
                        "pixels become 0 = mid grey, NOT -1) (out.masked_image)",
        "mask_to_latent": "F.interpolate(mask_condition, size=(64//8, 64//8)) with the default mode 'nearest' "
                          "(source index floor(dst*64/8) = 8*i: pixel (8i, 8j)); applied to the BINARISED mask "
                          "(out.mask_latent [1,1,8,8], values 0/1); duplicated x2 for CFG",
        "masked_image_latents": "scaling_factor * vae.encode(masked_image).latent_dist.sample(generator) "
                                "(a generator draw even for the 4-channel UNet, where it is then unused) "
                                "(out.masked_image_latents); duplicated x2 for CFG",
        "mask_recipe": MASK_RECIPE,
    }
    algo = ["prompt_embeds = cat([text_encoder(''), text_encoder(prompt)]) (CFG on)",
            "init_image, mask_condition, masked_image, mask_latent as in 'preprocessing'"]
    if unet_in == 9:
        algo += [
            "strength 1.0 (is_strength_max): latents = noise.0 * init_noise_sigma (1.0); image NOT encoded",
            "masked_image_latents = scaling_factor * (mean + exp(0.5*logvar) * noise.1) of vae.encode(masked_image)",
            "for t in timesteps_run: x = cat([latents]*2); x = cat([x, mask_latent x2, masked_image_latents x2], "
            "dim=1) -> [2,9,8,8] (channel order: 4 latents, 1 mask, 4 masked-image latents); eps = unet(x, t, "
            "prompt_embeds); CFG 7.5; latents = ddim_step(eps, t, latents) (no blending)",
            "decode / postprocess as in txt2img (out.image; no overlay since padding_mask_crop is None)",
        ]
    else:
        algo += [
            "image_latents = scaling_factor * (mean + exp(0.5*logvar) * noise.0) of vae.encode(init_image) "
            "(out.init_latents)",
            "latents = scheduler.add_noise(image_latents, noise.1, timesteps_run[0])",
            "masked_image_latents = VAE sample of masked_image with noise.2 (computed, unused by a 4-ch UNet)",
            "for i, t in enumerate(timesteps_run): eps = unet(cat([latents]*2), t, prompt_embeds) (4 channels, no "
            "concat); CFG 7.5; latents = ddim_step(eps, t, latents); init_proper = image_latents if i is the last "
            "step else scheduler.add_noise(image_latents, noise.1, timesteps_run[i+1]); latents = (1 - mask_latent) "
            "* init_proper + mask_latent * latents (out.step_latents[i] is after this blend)",
            "decode / postprocess as in txt2img (out.image; no overlay)",
        ]
    meta = {
        "case": name,
        "pipeline_class": "diffusers.StableDiffusionInpaintPipeline",
        "unet_in_channels": unet_in,
        "call": {"prompt": PROMPT, "negative_prompt": None, "image": "input.png (PIL RGB)",
                 "mask_image": "mask.png (PIL L)", "height": H, "width": W, "strength": strength,
                 "num_inference_steps": steps, "guidance_scale": 7.5, "eta": 0.0,
                 "generator": f"torch.Generator('cpu').manual_seed({seed})", "output_type": ["np", "latent"]},
        "prompt": PROMPT, "steps": steps, "strength": strength, "guidance": 7.5, "seed": seed, "eta": 0.0,
        "timesteps_run": out["timesteps"].tolist(),
        "full_schedule": full.tolist(),
        "scheduler_note": DDIM_NOTE,
        "vae_scaling_factor": sf,
        "preprocessing": prep,
        "algorithm": algo,
        "noise_draws": describe_draws(draws, "inpaint", strength, unet_in),
        "outputs_note": "out.image [1,64,64,3] (np); out.latents (latent); out.init_image [1,3,64,64] in [-1,1]; "
                        "out.mask_condition [1,1,64,64] binarised; out.masked_image [1,3,64,64]; out.mask_latent "
                        "[1,1,8,8]; out.masked_image_latents [1,4,8,8] (scaled); out.step_latents[i] after step i; "
                        "out.timesteps run (int64); out.prompt_embeds / negative [1,77,8]"
                        + ("; out.init_latents [1,4,8,8] = scaled VAE sample of init_image" if unet_in == 4 else ""),
        "checks": COMMON_CHECKS,
        **extra_meta,
    }
    write_case(root / name, out, draws, meta, image_png, mask_png)
    return meta


# ----------------------------------------------------------------------------------------------------------------------
# LCM img2img: the LCM-distilled tiny UNet with pipeline_sd1's text encoder / tokenizer / VAE, LCMScheduler
# ----------------------------------------------------------------------------------------------------------------------
def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def lcm_unet_check() -> dict:
    """The LCM UNet must take pipeline_sd1's prompt embeddings and latents: cross_attention_dim == pipeline_sd1 UNet's
    == CLIP hidden size, in/out channels equal, time_cond_proj_dim set."""
    lcm = json.loads((LCM_UNET / "config.json").read_text())
    sd1 = json.loads((SD1 / "unet" / "config.json").read_text())
    te = json.loads((SD1 / "text_encoder" / "config.json").read_text())
    res = {"lcm_unet": _rel(LCM_UNET), "pipeline_sd1_unet": _rel(SD1 / "unet")}
    for k in ("cross_attention_dim", "in_channels", "out_channels", "block_out_channels", "sample_size"):
        res[k] = {"lcm": lcm[k], "pipeline_sd1": sd1[k]}
    res["text_encoder_hidden_size"] = te["hidden_size"]
    res["time_cond_proj_dim"] = lcm["time_cond_proj_dim"]
    bad = [k for k in ("cross_attention_dim", "in_channels", "out_channels") if lcm[k] != sd1[k]]
    if lcm["cross_attention_dim"] != te["hidden_size"]:
        bad.append("cross_attention_dim != text_encoder hidden_size")
    if not lcm.get("time_cond_proj_dim"):
        bad.append("time_cond_proj_dim not set")
    if bad:
        raise SystemExit(f"{_rel(LCM_UNET)} does not fit pipeline_sd1 ({'; '.join(bad)}): {json.dumps(res)}")
    res["matches"] = True
    return res


def make_lcm_scheduler() -> LCMScheduler:
    """LCMScheduler.from_config(<pipeline_sd1 scheduler config>, original_inference_steps=50, timestep_scaling=10)."""
    return LCMScheduler.from_config(json.loads((SD1 / "scheduler" / "scheduler_config.json").read_text()),
                                    **LCM_SCHED_KW)


def lcm_scheduler_config(s: LCMScheduler) -> dict:
    return json.loads(s.to_json_string())  # what save_pretrained writes to scheduler_config.json


def lcm_components() -> dict:
    return dict(vae=AutoencoderKL.from_pretrained(SD1 / "vae").eval(),
                text_encoder=CLIPTextModel.from_pretrained(SD1 / "text_encoder").eval(),
                tokenizer=CLIPTokenizer.from_pretrained(SD1 / "tokenizer"),
                unet=UNet2DConditionModel.from_pretrained(LCM_UNET).eval(),
                scheduler=make_lcm_scheduler())


def write_lcm_model_folder(model_dir: Path) -> None:
    """model_index.json (LatentConsistencyModelPipeline.save_config) + scheduler/scheduler_config.json, no weights;
    checked by assembling a complete folder (pipeline_sd1's text_encoder/tokenizer/vae, LCM_UNET) and loading it."""
    import tempfile

    c = lcm_components()
    pipe = LatentConsistencyModelPipeline(**c, safety_checker=None, feature_extractor=None,
                                          requires_safety_checker=False)
    model_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_config(model_dir)  # writes model_index.json only
    c["scheduler"].save_pretrained(model_dir / "scheduler")
    assert sorted(p.name for p in model_dir.iterdir()) == ["model_index.json", "scheduler", "unet"]
    with tempfile.TemporaryDirectory() as td:
        t = Path(td)
        shutil.copytree(model_dir, t, dirs_exist_ok=True)
        for sub in ("text_encoder", "tokenizer", "vae"):
            shutil.copytree(SD1 / sub, t / sub)
        if not (t / "unet").exists():
            shutil.copytree(LCM_UNET, t / "unet")
        re = DiffusionPipeline.from_pretrained(t, safety_checker=None, requires_safety_checker=False)
        assert type(re) is LatentConsistencyModelPipeline, type(re)
        assert type(re.scheduler) is LCMScheduler
        assert lcm_scheduler_config(re.scheduler) == lcm_scheduler_config(c["scheduler"])
        for m in ("unet", "vae", "text_encoder"):
            for (n, a), (_, b) in zip(getattr(pipe, m).state_dict().items(), getattr(re, m).state_dict().items()):
                assert torch.equal(a, b), (m, n)


def case_img2img_lcm(root: Path, name: str, which: str, image_png: Path, unet_check: dict) -> dict:
    strength, steps, guidance, seed = LCM_STRENGTH, LCM_STEPS, LCM_GUIDANCE, LCM_SEED
    c = lcm_components()
    sched_cfg = lcm_scheduler_config(c["scheduler"])
    cls = LatentConsistencyModelImg2ImgPipeline if which == "lcm" else StableDiffusionImg2ImgPipeline
    pipe = cls(**c, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    image = Image.open(image_png)
    image.load()

    unet_calls = []  # (sample, t, encoder_hidden_states, timestep_cond, model output) of every UNet call
    orig_fwd = pipe.unet.forward

    def fwd(sample, timestep, *a, **k):
        o = orig_fwd(sample, timestep, *a, **k)
        tc = k.get("timestep_cond")
        unet_calls.append((sample.detach().clone(), int(timestep), k["encoder_hidden_states"].detach().clone(),
                           None if tc is None else tc.detach().clone(), o[0].detach().clone()))
        return o

    pipe.unet.forward = fwd
    kwargs = dict(prompt=PROMPT, image=image, strength=strength, num_inference_steps=steps, guidance_scale=guidance)
    r, draws = run_case(pipe, "img2img", kwargs, seed)
    del pipe.unet.forward
    out = r["out"]
    assert torch.equal(out["init_image"], img_tensor_from_png(image_png))
    ts = out["timesteps"].tolist()
    n = len(ts)
    sch = pipe.scheduler
    full = sch.timesteps.tolist()  # after the last call

    # ---- timesteps, derived independently
    k_skip = sch.config.num_train_timesteps // sch.config.original_inference_steps  # 20
    origin_full = (np.arange(1, sch.config.original_inference_steps + 1) * k_skip - 1)[::-1]
    pick = np.floor(np.linspace(0, len(origin_full), steps, endpoint=False)).astype(np.int64)
    sched_full = origin_full[pick].tolist()  # [999, 759, 499, 259]: the schedule at strength 1
    if which == "lcm":
        n_origin = int(sch.config.original_inference_steps * strength)  # 30
        origin = (np.arange(1, n_origin + 1) * k_skip - 1)[::-1]
        pick_s = np.floor(np.linspace(0, len(origin), steps, endpoint=False)).astype(np.int64)
        assert ts == full == origin[pick_s].tolist() and n == steps
        step_idx = list(range(n))  # scheduler step_index of each step run; num_inference_steps = 4
    else:
        init_t = min(int(steps * strength), steps)
        t_start = steps - init_t
        assert full == sched_full and ts == sched_full[t_start:] and sch.begin_index == t_start
        step_idx = list(range(t_start, steps))
    assert sch.num_inference_steps == steps
    assert max(ts) < 1000 * strength if which == "lcm" else True
    noisy_steps = [i for i, si in enumerate(step_idx) if si != steps - 1]  # steps that draw z
    prev_ts = [ts[i + 1] if i + 1 < n else ts[i] for i in range(n)]

    # ---- draws: VAE sample, add_noise noise, then one per LCM step but the scheduler's last
    assert len(draws) == 2 + len(noisy_steps), len(draws)
    assert "DiagonalGaussianDistribution.sample" in draws[0][1] and draws[1][1].endswith("prepare_latents")
    assert all(p.endswith("LCMScheduler.step") for _, p in draws[2:])
    assert len(r["add_noise_calls"]) == 1
    x0, nz, tt = r["add_noise_calls"][0]
    assert torch.equal(nz, draws[1][0]) and tt.tolist() == [ts[0]] and torch.equal(x0, out["init_latents"])

    # ---- UNet calls: no CFG (batch 1, prompt embeds only), timestep_cond = w-embedding of guidance - 1
    with torch.no_grad():
        pe, ne = pipe.encode_prompt(PROMPT, torch.device("cpu"), 1, False, None)
        w_emb = pipe.get_guidance_scale_embedding(torch.tensor([guidance - 1.0]),
                                                  embedding_dim=pipe.unet.config.time_cond_proj_dim)
    assert ne is None
    assert len(unet_calls) == 6 * n and [cl[1] for cl in unet_calls[:n]] == ts
    for s_, _, ehs, tc, _ in unet_calls:
        assert s_.shape[0] == 1 and torch.equal(ehs, pe) and torch.equal(tc, w_emb)

    # ---- the LCM step, re-computed (float32, same op order as the scheduler up to rounding)
    acp = sch.alphas_cumprod
    sd = sch.config.timestep_scaling
    zs = iter([t for t, _ in draws[2:]])
    x = sch.alphas_cumprod[ts[0]].sqrt() * out["init_latents"] + (1 - acp[ts[0]]).sqrt() * draws[1][0]
    for i, t in enumerate(ts):
        s_, _, _, _, eps = unet_calls[i]
        assert torch.allclose(s_, x, rtol=0, atol=1e-5), i
        c_skip = 0.25 / ((t * sd) ** 2 + 0.25)
        c_out = (t * sd) / ((t * sd) ** 2 + 0.25) ** 0.5
        den = c_out * (s_ - (1 - acp[t]).sqrt() * eps) / acp[t].sqrt() + c_skip * s_
        x = acp[prev_ts[i]].sqrt() * den + (1 - acp[prev_ts[i]]).sqrt() * next(zs) if i in noisy_steps else den
        assert torch.allclose(out["step_latents"][i], x, rtol=0, atol=1e-5), i
        x = out["step_latents"][i]

    out["prompt_embeds"] = pe
    out["w_embedding"] = w_emb
    sf = pipe.vae.config.scaling_factor
    nd = describe_draws(draws, "img2img", strength, 4)
    for j, i in enumerate(noisy_steps):
        nd[2 + j]["purpose"] += (f"; step {i} (scheduler step_index {step_idx[i]}): t = {ts[i]} -> prev_t = "
                                 f"{prev_ts[i]}")
        nd[2 + j]["step"] = i
    z_steps = ", ".join(f"step {i} (t {ts[i]} -> {prev_ts[i]}): noise.{2 + j}" for j, i in enumerate(noisy_steps))
    lcm_math = (f"LCM step at t with prev_t: x0 = (x - sqrt(1-acp[t]) eps) / sqrt(acp[t]) (epsilon prediction, "
                f"clip_sample False, thresholding False); s = t * timestep_scaling ({sd}); c_skip = 0.25/(s^2 + "
                f"0.25); c_out = s/sqrt(s^2 + 0.25) (sigma_data 0.5); denoised = c_out x0 + c_skip x; "
                f"x_prev = sqrt(acp[prev_t]) denoised + sqrt(1-acp[prev_t]) z with a NEW generator draw z when "
                f"step_index != num_inference_steps - 1 ({steps - 1}), else x_prev = denoised (no draw); prev_t = "
                f"the scheduler's next timestep (the step's own t on its last entry). acp = float32 alphas_cumprod of "
                f"scaled_linear betas 0.00085..0.012 over 1000; final_alpha_cumprod (set_alpha_to_one False -> "
                f"acp[0]) is never used here. scale_model_input is the identity. steps_offset / timestep_spacing / "
                f"set_alpha_to_one of the DDIM config are carried in the LCM config but unused by its set_timesteps.")
    if which == "lcm":
        note = (f"LatentConsistencyModelImg2ImgPipeline passes strength to LCMScheduler.set_timesteps({steps}, "
                f"strength={strength}) (there is no get_timesteps truncation): k = num_train_timesteps // "
                f"original_inference_steps = 1000 // {sch.config.original_inference_steps} = {k_skip}; origin grid "
                f"= [i*{k_skip} - 1 for i in 1..int({sch.config.original_inference_steps}*{strength}) = "
                f"{n_origin}] = {origin[-1]}..{origin[0]}, reversed; indices floor(linspace(0, {n_origin}, {steps}, "
                f"endpoint=False)) = {pick_s.tolist()} -> timesteps {ts}; all {n} run, scheduler step_index 0.."
                f"{n - 1} (begin_index None, found by index_for_timestep); the start noise level is timesteps[0] = "
                f"{ts[0]} (latent_timestep = timesteps[:1]), so every step runs below 1000*strength = "
                f"{1000 * strength:g}. Step noise: {z_steps}; the last step ({ts[-1]}) draws none and returns "
                f"denoised. The pipeline decodes the last step's `denoised` (== its prev_sample). "
                f"Draw order: noise.0 VAE latent_dist.sample of init_image, noise.1 add_noise noise, then one per "
                f"LCM step but the last. " + lcm_math)
    else:
        note = (f"StableDiffusionImg2ImgPipeline: LCMScheduler.set_timesteps({steps}) (strength 1): k = 1000 // "
                f"{sch.config.original_inference_steps} = {k_skip}; origin grid [i*{k_skip} - 1 for i in 1.."
                f"{sch.config.original_inference_steps}] reversed, indices floor(linspace(0, "
                f"{sch.config.original_inference_steps}, {steps}, endpoint=False)) = {pick.tolist()} -> full "
                f"schedule {sched_full}; get_timesteps: init_timestep = min(int({steps}*{strength}), {steps}) = "
                f"{init_t}, t_start = {t_start}, run schedule[{t_start}:] = {ts} and set_begin_index({t_start}), so "
                f"the scheduler's step_index runs {step_idx[0]}..{step_idx[-1]} with num_inference_steps {steps}; "
                f"start noise level timesteps[0] = {ts[0]}. Step noise: {z_steps}; the last step ({ts[-1]}, "
                f"step_index {steps - 1}) draws none and its prev_sample is denoised. No CFG "
                f"(do_classifier_free_guidance = guidance_scale > 1 and time_cond_proj_dim is None -> False); "
                f"timestep_cond = get_guidance_scale_embedding(guidance_scale - 1). The pipeline decodes the final "
                f"latents (= the last denoised). Draw order: noise.0 VAE latent_dist.sample of init_image, noise.1 "
                f"add_noise noise, then one per LCM step whose step_index != {steps - 1}. " + lcm_math)
    pipe_name = "LatentConsistencyModelImg2ImgPipeline" if which == "lcm" else "StableDiffusionImg2ImgPipeline"
    meta = {
        "case": name,
        "description": f"diffusers.{pipe_name}(vae, text_encoder, tokenizer (pipeline_sd1), unet ({_rel(LCM_UNET)}, "
                       f"LCM-distilled, time_cond_proj_dim {unet_check['time_cond_proj_dim']}), scheduler "
                       f"LCMScheduler), strength {strength}, {steps} steps -> {n} run, guidance {guidance} as "
                       f"w-embedding (no CFG)",
        "model": {"text_encoder": _rel(SD1 / "text_encoder"), "tokenizer": _rel(SD1 / "tokenizer"),
                  "vae": _rel(SD1 / "vae"), "unet": _rel(LCM_UNET),
                  "scheduler": f"LCMScheduler.from_config({_rel(SD1 / 'scheduler')} config, "
                               + ", ".join(f"{k}={v}" for k, v in LCM_SCHED_KW.items()) + ")"},
        "model_folder": (f"{name}/model: model_index.json + scheduler/scheduler_config.json only; assemble with "
                         f"text_encoder/, tokenizer/, vae/ of {_rel(SD1)} and unet/ = {_rel(LCM_UNET)}"
                         if which == "lcm" else None),
        "model_index_class": "LatentConsistencyModelPipeline" if which == "lcm" else "StableDiffusionPipeline",
        "pipeline_class": f"diffusers.{pipe_name}",
        "pipeline_init": "safety_checker=None, feature_extractor=None, requires_safety_checker=False",
        "call": {"prompt": PROMPT, "negative_prompt": None, "image": "input.png (PIL RGB, 64x64)",
                 "strength": strength, "num_inference_steps": steps, "guidance_scale": guidance,
                 "eta": "not passed (LCMScheduler.step has no eta)",
                 "generator": f"torch.Generator('cpu').manual_seed({seed})", "output_type": ["np", "latent"]},
        "prompt": PROMPT, "steps": steps, "strength": strength, "guidance": guidance, "seed": seed, "eta": None,
        "timesteps_run": ts,
        "full_schedule": full,
        "schedule_at_strength_1": sched_full,
        "scheduler_step_index": step_idx,
        "prev_timesteps": prev_ts,
        "scheduler_note": note,
        "scheduler_config": sched_cfg,
        "unet_check": unet_check,
        "guidance_embedding": {"w": guidance - 1.0, "embedding_dim": pipe.unet.config.time_cond_proj_dim,
                               "formula": "w*1000, half = dim/2, freq_i = exp(-ln(10000)/(half-1) * i), "
                                          "[sin(w*1000*freq), cos(w*1000*freq)] (out.w_embedding [1,16])",
                               "cfg": False},
        "vae_scaling_factor": sf,
        "preprocessing": {"image": IMAGE_PREPROCESS},
        "algorithm": [
            "prompt_embeds = text_encoder(prompt padded to 77) [1,77,8] (no CFG, no negative prompt)",
            f"w_embedding = get_guidance_scale_embedding(guidance - 1 = {guidance - 1:g}, 16) (timestep_cond of "
            "every UNet call)",
            "init_image = preprocess(input.png) [1,3,64,64] in [-1,1] (out.init_image)",
            "init_latents = scaling_factor * (mean + exp(0.5*logvar) * noise.0) of vae.encode(init_image) "
            "(out.init_latents)",
            "latents = scheduler.add_noise(init_latents, noise.1, timesteps_run[0]) = sqrt(acp[t0]) x0 + "
            "sqrt(1-acp[t0]) noise.1",
            f"for i, t in enumerate(timesteps_run): eps = unet(latents, t, prompt_embeds, timestep_cond=w_embedding) "
            f"(batch 1); latents = lcm_step(eps, t, latents, prev_t = prev_timesteps[i], z = next noise if "
            f"scheduler_step_index[i] != {steps - 1}) (out.step_latents[i] after step i)",
            "out.latents = final latents (= last denoised); out.image = (vae.decode(latents / scaling_factor)/2 + "
            "0.5).clamp(0,1) NHWC",
        ],
        "noise_draws": nd,
        "outputs_note": "out.image [1,64,64,3] output_type='np'; out.latents output_type='latent'; out.init_latents "
                        "scaled VAE sample (before add_noise); out.init_image the preprocessed image; "
                        "out.step_latents[i] latents after step i (LCM prev_sample); out.timesteps the timesteps run "
                        "(int64); out.prompt_embeds [1,77,8]; out.w_embedding [1,16] the UNet's timestep_cond",
        "checks": COMMON_CHECKS + "; timesteps re-derived from the LCM formulas; every UNet call has batch 1, "
                  "encoder_hidden_states == out.prompt_embeds and timestep_cond == out.w_embedding; the single "
                  "add_noise call used out.init_latents, noise.1 and timesteps_run[0]; every step re-computed from "
                  "the UNet output with the LCM formulas matches out.step_latents within 1e-5",
    }
    if which == "lcm":
        meta["lcm_origin_grid"] = origin.tolist()
    write_case(root / name, out, draws, meta, image_png, None)
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # nothing depends on it
    root: Path = args.out
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)

    image_png, mask_png = root / "input.png", root / "mask.png"
    make_input_image().save(image_png)
    make_mask().save(mask_png)

    summary = {}
    summary["img2img"] = case_img2img(root, "img2img", image_png, strength=0.6, steps=10, seed=7)
    summary["img2img_1step"] = case_img2img(root, "img2img_1step", image_png, strength=0.5, steps=2, seed=7)
    assert summary["img2img_1step"]["timesteps_run"] == [1]

    mdir = root / "inpaint_9ch" / "model"
    init9 = write_inpaint_folder(mdir)
    for sub in ("text_encoder", "tokenizer", "vae", "scheduler"):
        for f in (SD1 / sub).iterdir():
            assert (mdir / sub / f.name).read_bytes() == f.read_bytes()
    summary["inpaint_9ch"] = case_inpaint(
        root, "inpaint_9ch", mdir, image_png, mask_png, strength=1.0, steps=8, seed=11,
        extra_meta={"description": "StableDiffusionInpaintPipeline with a 9-channel UNet (pipeline_sd1's UNet config "
                    "with in_channels 9, weights re-drawn), strength 1.0, 8 steps",
                    "model": "fixtures/edit/inpaint_9ch/model (complete pipeline folder; text_encoder/, tokenizer/, "
                    "vae/, scheduler/ are byte copies of fixtures/parity/pipeline_sd1/model; unet/ new; "
                    "model_index.json _class_name StableDiffusionInpaintPipeline)",
                    "unet9": {"config": "fixtures/parity/pipeline_sd1/model/unet/config.json with in_channels 9",
                              "weight_seed": UNET9_SEED, "init": init9, "weight_init": mf.INIT_RECIPE}})
    summary["inpaint_4ch"] = case_inpaint(
        root, "inpaint_4ch", SD1, image_png, mask_png, strength=0.75, steps=8, seed=13,
        extra_meta={"description": "StableDiffusionInpaintPipeline.from_pretrained(fixtures/parity/pipeline_sd1/"
                    "model) (ordinary 4-channel UNet: the original is re-noised outside the mask after every step), "
                    "strength 0.75, 8 steps", "model": "fixtures/parity/pipeline_sd1/model"})
    global LCM_UNET
    LCM_UNET = root / "img2img_lcm_pipeline" / "model" / "unet"
    lcm_init = build_lcm_unet(LCM_UNET)
    lcm_check = dict(lcm_unet_check(), weight_seed=LCM_UNET_SEED, init=lcm_init, weight_init=mf.INIT_RECIPE)
    write_lcm_model_folder(root / "img2img_lcm_pipeline" / "model")
    summary["img2img_lcm_pipeline"] = case_img2img_lcm(root, "img2img_lcm_pipeline", "lcm", image_png, lcm_check)
    summary["img2img_lcm_sd_pipeline"] = case_img2img_lcm(root, "img2img_lcm_sd_pipeline", "sd", image_png,
                                                          lcm_check)
    # the shared copies live in the case folders
    image_png.unlink()
    mask_png.unlink()

    total = 0
    for f in sorted(root.rglob("*")):
        if f.is_file():
            total += f.stat().st_size
            print(f"{f.stat().st_size:9d}  {hashlib.sha256(f.read_bytes()).hexdigest()[:16]}  {f.relative_to(root)}")
    shared = sum(f.stat().st_size for f in mdir.rglob("*") if f.is_file() and f.parent.name != "unet"
                 and f.name != "model_index.json")
    print(f"total {total / 1e6:.3f} MB, of which {shared / 1e6:.3f} MB are copies of pipeline_sd1 files -> {root}")
    for c, m in summary.items():
        print(c, m["timesteps_run"], [(d["name"], d["shape"], d["call_path"].split(" > ", 1)[-1]) for d in
                                      m["noise_draws"]])


if __name__ == "__main__":
    main()
