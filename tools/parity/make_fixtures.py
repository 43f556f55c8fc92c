#!/usr/bin/env python3
"""Build the brume parity fixtures: tiny random-weight diffusers / transformers models + reference I/O.

Usage (from the repository root; CPU only, ~1-3 minutes on 2 cores):

    /work/pyenv/bin/python tools/parity/make_fixtures.py            # writes fixtures/parity/
    /work/pyenv/bin/python tools/parity/make_fixtures.py --out DIR  # somewhere else
    /work/pyenv/bin/python tools/parity/make_fixtures.py --only unet_sd1,vae_kl

Environment: the versions pinned in tools/requirements.txt (torch 2.15.0, diffusers 0.42.1, transformers 5.23.0,
safetensors 0.8.0, numpy 2.4.6). The real configs are read from $BRUME_CONFIGS (default /work/shared/configs).
No network access is needed (HF_HUB_OFFLINE is forced).

For every case, fixtures/parity/<case>/ holds
  model/          the model exactly as `save_pretrained(dir, safe_serialization=True)` writes it
                  (UNet/VAE: config.json + diffusion_pytorch_model.safetensors; CLIP: config.json + model.safetensors;
                  pipelines: the complete diffusers pipeline folder, see the tokenizer note below)
  io.safetensors  inputs `in.<name>` and reference outputs `out.<name>` (float32; ids / timesteps int64)
  meta.json       description, scalars, shapes, library versions, the weight-init recipe, and the float32-vs-float64
                  discrepancy of the reference itself (how much float32 rounding noise the reference carries).

Weights: after construction every parameter is overwritten from a torch.Generator seeded per case (see `randomize_`):
  nn.Embedding weights       ~ N(0, 0.5^2)
  other >=2-D tensors        ~ N(0, 1/fan_in)   (fan_in = in_features, or in_channels/groups * kh * kw)
  1-D "bias" tensors         ~ 0.1 * N(0, 1)
  other 1-D (norm weights)   ~ 1 + 0.1 * N(0, 1)
so that no tensor keeps a default zero / one init and activations stay O(1).

Every case is checked before it is written: outputs finite, std > 1e-3, the saved folder reloads with
`from_pretrained` and reproduces the outputs bit-exactly; the pipelines are re-run from the saved folder with
`DiffusionPipeline.from_pretrained` and must reproduce the same image.

Deterministic: same inputs -> byte-identical files (the script deletes and rewrites the output directory).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import diffusers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

from diffusers import (  # noqa: E402
    AutoencoderKL,
    AutoencoderTiny,
    DDIMScheduler,
    DiffusionPipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer  # noqa: E402

diffusers.utils.logging.set_verbosity_error()
transformers.utils.logging.set_verbosity_error()
try:
    transformers.utils.logging.disable_progress_bar()
except Exception:  # pragma: no cover
    pass

REPO = Path(__file__).resolve().parents[2]
CONFIGS = Path(os.environ.get("BRUME_CONFIGS", "/work/shared/configs"))
DEFAULT_OUT = REPO / "fixtures" / "parity"

EMB_STD = 0.5
BIAS_STD = 0.1
NORM_STD = 0.1

VERSIONS = {
    "torch": torch.__version__,
    "diffusers": diffusers.__version__,
    "transformers": transformers.__version__,
    "safetensors": safetensors.__version__,
    "numpy": np.__version__,
    "python": sys.version.split()[0],
}

INIT_RECIPE = (
    f"every parameter re-drawn from torch.Generator(seed): nn.Embedding ~ N(0,{EMB_STD}^2); other >=2-D ~ "
    f"N(0,1/fan_in) (fan_in = weight[0].numel()); 1-D '*bias' ~ {BIAS_STD}*N(0,1); other 1-D (norm weights) ~ "
    f"1+{NORM_STD}*N(0,1). Parameters drawn in model.named_parameters() order."
)

# Seeds: one per case (weights) and the case seed + 1000 for the inputs.
SEEDS = {
    "clip_sd1": 101,
    "clip_sd2": 102,
    "unet_sd1": 103,
    "unet_sd2": 104,
    "unet_inpaint": 105,
    "unet_lcm": 106,
    "unet_sdxs": 107,
    "unet_midplain": 108,
    "vae_kl": 109,
    "vae_tiny": 110,
    "pipeline_sd1": 111,
    "pipeline_sd2v": 112,
}


# ----------------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------------
def load_cfg(rel: str) -> dict:
    """A real config with the private `_*` keys dropped."""
    d = json.loads((CONFIGS / rel).read_text())
    return {k: v for k, v in d.items() if not k.startswith("_")}


def randomize_(model: nn.Module, seed: int) -> dict:
    """Overwrite every parameter (see module docstring). Returns a small summary for meta.json."""
    g = torch.Generator().manual_seed(seed)
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    counts = {"embedding": 0, "matrix": 0, "bias": 0, "norm_weight": 0}
    other_1d = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if id(p) in emb_ids:
                new = r * EMB_STD
                counts["embedding"] += 1
            elif p.ndim >= 2:
                fan_in = p[0].numel()
                new = r / math.sqrt(fan_in)
                counts["matrix"] += 1
            elif name.endswith("bias"):
                new = r * BIAS_STD
                counts["bias"] += 1
            else:
                new = 1.0 + NORM_STD * r
                counts["norm_weight"] += 1
                if "norm" not in name:
                    other_1d.append(name)
            p.copy_(new.to(p.dtype))
    if other_1d:
        raise RuntimeError(f"unexpected 1-D non-bias parameters (treated as norm weights): {other_1d}")
    counts["n_params"] = int(sum(p.numel() for p in model.parameters()))
    return counts


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_output(name: str, t: torch.Tensor) -> None:
    if t.is_floating_point():
        if not torch.isfinite(t).all():
            raise RuntimeError(f"{name}: non-finite values")
        s = float(t.float().std())
        if not s > 1e-3:
            raise RuntimeError(f"{name}: degenerate output (std {s})")


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a = a.double()
    ref = ref.double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def to64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    return x


def stats(t: torch.Tensor) -> dict:
    if not t.is_floating_point():
        return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
    tf = t.double()
    return {
        "dtype": str(t.dtype).replace("torch.", ""),
        "shape": list(t.shape),
        "std": round(float(tf.std()), 6),
        "max_abs": round(float(tf.abs().max()), 6),
    }


def processors(model: nn.Module) -> list[str]:
    try:
        return sorted({type(p).__name__ for p in model.attn_processors.values()})
    except Exception:
        return []


def write_case(root: Path, case: str, inputs: dict, outputs: dict, meta: dict) -> None:
    d = root / case
    tensors = {}
    for k, v in inputs.items():
        tensors[f"in.{k}"] = v.detach().contiguous().cpu()
    for k, v in outputs.items():
        check_output(f"{case}:out.{k}", v)
        tensors[f"out.{k}"] = v.detach().contiguous().cpu()
    for k, v in tensors.items():
        assert v.dtype in (torch.float32, torch.int64), (k, v.dtype)
    save_file(tensors, str(d / "io.safetensors"))
    meta = {
        "case": case,
        **meta,
        "tensors": {k: stats(v) for k, v in tensors.items()},
        "tolerance": "max|brume - out| / max|out| <= 1e-4 per output",
        "weight_init": INIT_RECIPE,
        "weight_seed": SEEDS[case],
        "input_seed": SEEDS[case] + 1000,
        "versions": VERSIONS,
        "generator": "tools/parity/make_fixtures.py",
    }
    (d / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=False) + "\n")


def f64_report(outputs32: dict, outputs64: dict) -> dict:
    return {k: float(f"{rel_err(outputs64[k], v):.3e}") for k, v in outputs32.items() if v.is_floating_point()}


def assert_same(a: dict, b: dict, what: str) -> None:
    for k in a:
        if not torch.equal(a[k], b[k]):
            raise RuntimeError(f"{what}: '{k}' differs after reload (max diff {(a[k] - b[k]).abs().max()})")


# ----------------------------------------------------------------------------------------------------------------------
# CLIP text encoders
# ----------------------------------------------------------------------------------------------------------------------
def clip_ids(seed: int, bos: int, eos: int, pad: int, vocab: int, short_len: int) -> torch.Tensor:
    """Row 0: BOS, `short_len` tokens, EOS, then padding. Row 1: full 77 (BOS, 75 tokens, EOS).
    Ordinary tokens are drawn from [3, min(bos,eos)) so that EOS is the largest id in each row."""
    g = gen(seed)
    hi = min(bos, eos)
    ids = torch.full((2, 77), pad, dtype=torch.int64)
    ids[0, 0] = bos
    ids[0, 1 : 1 + short_len] = torch.randint(3, hi, (short_len,), generator=g)
    ids[0, 1 + short_len] = eos
    ids[1, 0] = bos
    ids[1, 1:76] = torch.randint(3, hi, (75,), generator=g)
    ids[1, 76] = eos
    assert int(ids.max()) < vocab
    return ids


def clip_forward(model: CLIPTextModel, ids: torch.Tensor) -> dict:
    with torch.no_grad():
        o = model(input_ids=ids, output_hidden_states=True)
        pen = model.final_layer_norm(o.hidden_states[-2])
    return {
        "last_hidden_state": o.last_hidden_state,
        "penultimate": pen,
        "pooler_output": o.pooler_output,
    }


def case_clip(root: Path, case: str, base_cfg: str, overrides: dict, pad: int, desc: str) -> None:
    seed = SEEDS[case]
    cfg = load_cfg(base_cfg)
    cfg.update(overrides)
    model = CLIPTextModel(CLIPTextConfig.from_dict(cfg)).eval()
    init = randomize_(model, seed)
    bos, eos = 998, 999
    ids = clip_ids(seed + 1000, bos=bos, eos=eos, pad=pad, vocab=cfg["vocab_size"], short_len=6)
    out = clip_forward(model, ids)

    # the pooled-output rule that applies to this config
    assert model.config.eos_token_id == 2
    pos = ids.to(torch.int32).argmax(dim=-1)
    assert torch.equal(out["pooler_output"], out["last_hidden_state"][torch.arange(2), pos])
    assert pos.tolist() == [7, 76], pos

    mdir = root / case / "model"
    model.save_pretrained(mdir, safe_serialization=True)
    re = CLIPTextModel.from_pretrained(mdir).eval()
    assert_same(out, clip_forward(re, ids), case)

    out64 = clip_forward(model.double(), ids)

    write_case(
        root,
        case,
        {"input_ids": ids},
        out,
        {
            "description": desc,
            "model_class": "transformers.CLIPTextModel",
            "config_base": base_cfg,
            "overrides": overrides,
            "attn_implementation": model.config._attn_implementation,
            "bos_id": bos,
            "eos_id": eos,
            "pad_id": pad,
            "pooled_rule": "config eos_token_id == 2 -> pooled = last_hidden_state[b, argmax(input_ids[b])] "
            "(first occurrence of the max id; EOS 999 is the largest id in both rows)",
            "pooled_positions": pos.tolist(),
            "penultimate": "final_layer_norm(hidden_states[-2]); hidden_states[0] is the embedding output, "
            "hidden_states[-1] the last layer before final_layer_norm",
            "weight_key_layout": "transformers 5 saves CLIPTextModel keys WITHOUT the 'text_model.' prefix "
            "(e.g. 'embeddings.token_embedding.weight'); checkpoints saved by transformers 4.x have "
            "'text_model.embeddings.token_embedding.weight'",
            "init": init,
            "f32_vs_f64_rel_err": f64_report(out, out64),
        },
    )


# ----------------------------------------------------------------------------------------------------------------------
# UNets
# ----------------------------------------------------------------------------------------------------------------------
def unet_forward(unet, inputs: dict) -> dict:
    with torch.no_grad():
        s = unet(**inputs, return_dict=True).sample
    return {"sample": s}


def case_unet(root: Path, case: str, base_cfg: str, overrides: dict, hw: tuple, timesteps: list,
              seq_len: int, desc: str, extra_meta: dict | None = None, lcm_w: list | None = None) -> None:
    seed = SEEDS[case]
    cfg = load_cfg(base_cfg)
    cfg.update(overrides)
    unet = UNet2DConditionModel.from_config(cfg).eval()
    init = randomize_(unet, seed)
    g = gen(seed + 1000)
    c = unet.config
    inputs = {
        "sample": torch.randn((2, c.in_channels, *hw), generator=g),
        "timestep": torch.tensor(timesteps, dtype=torch.float32),
        "encoder_hidden_states": torch.randn((2, seq_len, c.cross_attention_dim), generator=g),
    }
    meta_extra = {}
    if c.time_cond_proj_dim is not None:
        from diffusers import LatentConsistencyModelPipeline

        w = torch.tensor(lcm_w, dtype=torch.float32)
        emb = LatentConsistencyModelPipeline.get_guidance_scale_embedding(
            None, w, embedding_dim=c.time_cond_proj_dim, dtype=torch.float32
        )
        inputs["timestep_cond"] = emb
        meta_extra["w"] = lcm_w
        meta_extra["timestep_cond"] = (
            "in.timestep_cond = LatentConsistencyModelPipeline.get_guidance_scale_embedding(torch.tensor(w), "
            f"embedding_dim={c.time_cond_proj_dim}) in float32 (w*1000, half=dim/2, freq=exp(-ln(10000)/(half-1)*i), "
            "[sin, cos]); in the LCM pipeline w = guidance_scale - 1 (here w = meta 'w')."
        )
    out = unet_forward(unet, inputs)

    mdir = root / case / "model"
    unet.save_pretrained(mdir, safe_serialization=True)
    re = UNet2DConditionModel.from_pretrained(mdir).eval()
    assert_same(out, unet_forward(re, inputs), case)
    out64 = unet_forward(unet.double(), {k: to64(v) for k, v in inputs.items()})

    meta = {
        "description": desc,
        "model_class": "diffusers.UNet2DConditionModel",
        "config_base": base_cfg,
        "overrides": overrides,
        "attention_processors": processors(re),
        "heads_note": "diffusers passes config.attention_head_dim as the NUMBER of heads (num_attention_heads = "
        "num_attention_heads or attention_head_dim); head dim = block channels / heads",
        "forward_upsample_size": any(d % (2 ** re.num_upsamplers) for d in hw),
        "init": init,
        "f32_vs_f64_rel_err": f64_report(out, out64),
        **meta_extra,
        **(extra_meta or {}),
    }
    write_case(root, case, inputs, out, meta)


# ----------------------------------------------------------------------------------------------------------------------
# VAEs
# ----------------------------------------------------------------------------------------------------------------------
def vae_kl_forward(vae, inputs):
    with torch.no_grad():
        dist = vae.encode(inputs["image"]).latent_dist
        dec = vae.decode(inputs["latents"]).sample
    return {"mean": dist.mean, "logvar": dist.logvar, "decoded": dec}


def vae_tiny_forward(vae, inputs):
    with torch.no_grad():
        lat = vae.encode(inputs["image"]).latents
        dec = vae.decode(inputs["latents"]).sample
    return {"latents": lat, "decoded": dec}


def case_vae(root: Path, case: str, cls, base_cfg: str, overrides: dict, fwd, desc: str, extra_meta: dict) -> None:
    seed = SEEDS[case]
    cfg = load_cfg(base_cfg)
    cfg.update(overrides)
    vae = cls.from_config(cfg).eval()
    init = randomize_(vae, seed)
    g = gen(seed + 1000)
    inputs = {
        "image": torch.rand((1, 3, 32, 32), generator=g) * 2 - 1,
        "latents": torch.randn((1, 4, 4, 4), generator=g),
    }
    out = fwd(vae, inputs)
    mdir = root / case / "model"
    vae.save_pretrained(mdir, safe_serialization=True)
    re = cls.from_pretrained(mdir).eval()
    assert_same(out, fwd(re, inputs), case)
    out64 = fwd(vae.double(), {k: to64(v) for k, v in inputs.items()})
    write_case(
        root,
        case,
        inputs,
        out,
        {
            "description": desc,
            "model_class": f"diffusers.{cls.__name__}",
            "config_base": base_cfg,
            "overrides": overrides,
            "attention_processors": processors(re),
            "scaling_factor": re.config.scaling_factor,
            "init": init,
            "f32_vs_f64_rel_err": f64_report(out, out64),
            **extra_meta,
        },
    )


# ----------------------------------------------------------------------------------------------------------------------
# Pipelines
# ----------------------------------------------------------------------------------------------------------------------
def classic_tokenizer_dir(dst: Path, cfg_dir: str) -> None:
    """The tokenizer folder as the SD Hub repos ship it: vocab.json, merges.txt, tokenizer_config.json,
    special_tokens_map.json (all four copied verbatim)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CONFIGS / "clip_tokenizer" / "vocab.json", dst / "vocab.json")
    shutil.copyfile(CONFIGS / "clip_tokenizer" / "merges.txt", dst / "merges.txt")
    shutil.copyfile(CONFIGS / cfg_dir / "tokenizer_config.json", dst / "tokenizer_config.json")
    shutil.copyfile(CONFIGS / cfg_dir / "tokenizer_special_tokens_map.json", dst / "special_tokens_map.json")


def run_pipe(pipe, p: dict, latents: torch.Tensor, dtype=torch.float32) -> dict:
    steps = []

    def cb(_pipe, i, t, kw):
        steps.append(kw["latents"].detach().clone())
        return {}

    common = dict(
        prompt=p["prompt"],
        negative_prompt=p["negative_prompt"],
        height=p["height"],
        width=p["width"],
        num_inference_steps=p["steps"],
        guidance_scale=p["guidance_scale"],
        eta=p["eta"],
    )
    with torch.no_grad():
        img = pipe(**common, latents=latents.to(dtype), output_type="np", callback_on_step_end=cb).images
        lat = pipe(**common, latents=latents.to(dtype), output_type="latent").images
        pe, ne = pipe.encode_prompt(p["prompt"], torch.device("cpu"), 1, True, p["negative_prompt"])
    timesteps = pipe.scheduler.timesteps.clone()  # set by the last call (same steps)
    return {
        "image": torch.from_numpy(np.ascontiguousarray(img)),
        "latents": lat,
        "step_latents": torch.stack(steps[: p["steps"]]),
        "prompt_embeds": pe,
        "negative_prompt_embeds": ne,
        "timesteps": timesteps,
    }


def case_pipeline(root: Path, case: str, *, te_base: str, te_over: dict, tok_dir: str, unet_base: str,
                  unet_over: dict, sched_cfg: str, sched_over: dict, params: dict, desc: str) -> None:
    seed = SEEDS[case]
    te_cfg = load_cfg(te_base)
    te_cfg.update(te_over)
    text_encoder = CLIPTextModel(CLIPTextConfig.from_dict(te_cfg)).eval()
    init_te = randomize_(text_encoder, seed)

    ucfg = load_cfg(unet_base)
    ucfg.update(unet_over)
    unet = UNet2DConditionModel.from_config(ucfg).eval()
    init_unet = randomize_(unet, seed + 1)

    vcfg = load_cfg("sd15/vae.json")
    vae_over = dict(block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=4, sample_size=64)
    vcfg.update(vae_over)
    vae = AutoencoderKL.from_config(vcfg).eval()
    init_vae = randomize_(vae, seed + 2)

    scfg = load_cfg(sched_cfg)
    scfg.update(sched_over)
    scheduler = DDIMScheduler.from_config(scfg)

    with tempfile.TemporaryDirectory() as td:
        classic_tokenizer_dir(Path(td), tok_dir)
        tokenizer = CLIPTokenizer.from_pretrained(td)

    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)

    latents = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(0))
    out = run_pipe(pipe, params, latents)
    ids = tokenizer(params["prompt"], padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids
    neg_ids = tokenizer(params["negative_prompt"] or "", padding="max_length",
                        max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt").input_ids
    out["input_ids"] = ids
    out["negative_input_ids"] = neg_ids

    # sanity: the pipeline's prompt embeds are the text encoder's last_hidden_state of these ids
    with torch.no_grad():
        assert torch.equal(text_encoder(ids).last_hidden_state, out["prompt_embeds"])
        assert torch.equal(text_encoder(neg_ids).last_hidden_state, out["negative_prompt_embeds"])
    img = out["image"]
    clamped = float(((img <= 0.0) | (img >= 1.0)).double().mean())
    if clamped > 0.5:
        raise RuntimeError(f"{case}: image mostly clamped ({clamped:.2%})")

    mdir = root / case / "model"
    pipe.save_pretrained(mdir, safe_serialization=True)
    # transformers 5 writes the tokenizer as a single 3.6 MB tokenizer.json; replace it by the classic
    # Hub layout (vocab.json + merges.txt + tokenizer_config.json + special_tokens_map.json), which is what the
    # real SD 1.5 / 2.x repositories ship and what brume reads. Reloading below proves diffusers accepts it.
    tok_saved = sorted(p.name for p in (mdir / "tokenizer").iterdir())
    shutil.rmtree(mdir / "tokenizer")
    classic_tokenizer_dir(mdir / "tokenizer", tok_dir)

    re = DiffusionPipeline.from_pretrained(mdir)
    re.set_progress_bar_config(disable=True)
    assert type(re).__name__ == "StableDiffusionPipeline", type(re)
    out_re = run_pipe(re, params, latents)
    for k in ("image", "latents", "prompt_embeds", "negative_prompt_embeds", "timesteps", "step_latents"):
        if not torch.equal(out[k], out_re[k]):
            raise RuntimeError(f"{case}: reloaded pipeline differs in {k}: {(out[k] - out_re[k]).abs().max()}")
    re_ids = re.tokenizer(params["prompt"], padding="max_length", max_length=77, truncation=True,
                          return_tensors="pt").input_ids
    assert torch.equal(re_ids, ids)

    # float64 run of the same pipeline (reference-noise estimate)
    pipe64 = StableDiffusionPipeline(
        vae=vae.double(), text_encoder=text_encoder.double(), tokenizer=tokenizer, unet=unet.double(),
        scheduler=DDIMScheduler.from_config(scfg), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe64.set_progress_bar_config(disable=True)
    out64 = run_pipe(pipe64, params, latents, dtype=torch.float64)

    out["image"] = out["image"].float()
    sch = re.scheduler
    inputs = {"latents": latents}
    meta = {
        "description": desc,
        "pipeline_class": "diffusers.StableDiffusionPipeline",
        **params,
        "latents_seed": "torch.randn((1,4,8,8), generator=torch.Generator().manual_seed(0))",
        "vae_scale_factor": pipe.vae_scale_factor,
        "vae_scaling_factor": vae.config.scaling_factor,
        "scheduler_config": {k: v for k, v in sch.config.items() if not k.startswith("_")},
        "timesteps": out["timesteps"].tolist(),
        "tokenizer": {
            "pad_token": tokenizer.pad_token, "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "model_max_length": tokenizer.model_max_length,
            "files_written_by_transformers_save_pretrained": tok_saved,
            "files_kept": sorted(p.name for p in (mdir / "tokenizer").iterdir()),
        },
        "components": {
            "text_encoder": {"config_base": te_base, "overrides": te_over, "init": init_te, "seed": seed},
            "unet": {"config_base": unet_base, "overrides": unet_over, "init": init_unet, "seed": seed + 1,
                     "attention_processors": processors(re.unet)},
            "vae": {"config_base": "sd15/vae.json", "overrides": vae_over, "init": init_vae, "seed": seed + 2,
                    "attention_processors": processors(re.vae)},
            "scheduler": {"config_base": sched_cfg, "overrides": sched_over},
        },
        "outputs_note": "out.image: output_type='np' [1,H,W,3] in [0,1]; out.latents: output_type='latent' (final "
        "latents, before /scaling_factor and VAE decode); out.step_latents[i]: latents after scheduler step i "
        "(callback_on_step_end); out.prompt_embeds / out.negative_prompt_embeds: pipe.encode_prompt(...) = "
        "text_encoder(ids).last_hidden_state; out.input_ids / out.negative_input_ids: tokenizer(padding="
        "'max_length', max_length=77, truncation=True) of the prompt / of the negative prompt (\"\" when None)",
        "clamped_pixel_fraction": round(clamped, 4),
        "reloaded_with_DiffusionPipeline_from_pretrained": "bit-identical image, latents, embeds, timesteps",
        "f32_vs_f64_rel_err": f64_report(out, {**out64, "image": out64["image"].double()}),
    }
    write_case(root, case, inputs, out, meta)


# ----------------------------------------------------------------------------------------------------------------------
# Case table
# ----------------------------------------------------------------------------------------------------------------------
def build_all(root: Path, only: set | None) -> None:
    def want(c):
        return only is None or c in only

    if want("clip_sd1"):
        case_clip(root, "clip_sd1", "sd15/text_encoder.json",
                  dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                       vocab_size=1000, projection_dim=32),
                  pad=999,
                  desc="SD 1.x text encoder (CLIP ViT-L/14 text tower shape family): quick_gelu, causal mask, "
                  "pad == EOS == 999 (like SD1.5 where pad == EOS == 49407), pooled by argmax(ids).")
    if want("clip_sd2"):
        case_clip(root, "clip_sd2", "sd21_base/text_encoder.json",
                  dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       vocab_size=1000, projection_dim=32),
                  pad=0,
                  desc="SD 2.x text encoder (OpenCLIP ViT-H text tower as CLIPTextModel): exact (erf) gelu, pad id 0 "
                  "(like the SD2 tokenizer's '!'), pooled by argmax(ids).")

    # Widths: the brief's [32, 64] / [32, 64, 64] made the UNets 4.4-6.8 MB each (53 MB in all). unet_sd1 keeps
    # norm groups 8 and 8 heads at [16, 32] (head dims 2 / 4, 2 / 4 channels per group); the structural variants
    # use [8, 16(, 16)] with 4 groups (2 / 4 channels per group) and head dims >= 4.
    sd1_unet = dict(block_out_channels=[16, 32], down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], layers_per_block=2, attention_head_dim=8,
                    cross_attention_dim=24, norm_num_groups=8, use_linear_projection=False,
                    mid_block_type="UNetMidBlock2DCrossAttn", sample_size=8)
    sd1_small = dict(sd1_unet, block_out_channels=[8, 16], attention_head_dim=2, norm_num_groups=4)
    if want("unet_sd1"):
        case_unet(root, "unet_sd1", "sd15/unet.json", sd1_unet, hw=(8, 8), timesteps=[981.0, 1.0], seq_len=7,
                  desc="SD 1.x UNet: conv proj_in/proj_out (use_linear_projection false), int attention_head_dim 8 "
                  "(= 8 heads), UNetMidBlock2DCrossAttn, flip_sin_to_cos true / freq_shift 0.")
    if want("unet_sd2"):
        over = dict(block_out_channels=[8, 16, 16],
                    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
                    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"], layers_per_block=1,
                    attention_head_dim=[2, 4, 4], cross_attention_dim=40, norm_num_groups=4,
                    use_linear_projection=True, upcast_attention=True, transformer_layers_per_block=[2, 1, 3],
                    flip_sin_to_cos=True, freq_shift=0, sample_size=8)
        case_unet(root, "unet_sd2", "sd21_768/unet.json", over, hw=(12, 10), timesteps=[999.0, 20.5], seq_len=5,
                  desc="SD 2.x UNet: linear proj_in/proj_out, per-block head counts [2,4,4], upcast_attention, "
                  "transformer_layers_per_block [2,1,3] (down i uses [i]; the mid block uses [-1] = 3; up block i "
                  "uses reversed(list)[i]: up1 -> 1, up2 -> 2), sample 12x10 so that 10 % 4 != 0 and diffusers "
                  "passes upsample_size (nearest interpolation to an explicit size 3x3 -> 6x5 -> 12x10). "
                  "Second timestep is fractional (20.5).",
                  extra_meta={"layers_per_block": 1,
                              "transformer_depths": {"down": [2, 1], "mid": 3, "up": [None, 1, 2]}})
    if want("unet_inpaint"):
        over = dict(sd1_small, in_channels=9, out_channels=4, flip_sin_to_cos=False, freq_shift=1)
        case_unet(root, "unet_inpaint", "sd15_inpainting/unet.json", over, hw=(8, 12), timesteps=[500.0, 1.0],
                  seq_len=7,
                  desc="SD inpainting UNet (9 input channels = latents 4 + mask 1 + masked-image latents 4), "
                  "SD1 layout at [8, 16] (like unet_lcm); timestep embedding variant flip_sin_to_cos false ([sin, cos]) and "
                  "freq_shift 1 (exponent / (half - 1)). Non-square 8x12 sample.")
    if want("unet_lcm"):
        over = dict(sd1_small, time_cond_proj_dim=16)
        case_unet(root, "unet_lcm", "lcm_dreamshaper_v7/unet.json", over, hw=(8, 8), timesteps=[999.0, 259.0],
                  seq_len=7, lcm_w=[7.0, 0.5],
                  desc="LCM UNet: SD1 layout at [8, 16] + time_cond_proj_dim 16: temb = linear_2(silu(linear_1(t_emb + "
                  "cond_proj(timestep_cond)))) with cond_proj bias-free.")
    sdxs = dict(block_out_channels=[8, 16, 16], down_block_types=["CrossAttnDownBlock2D"] * 3,
                up_block_types=["CrossAttnUpBlock2D"] * 3, layers_per_block=1, mid_block_type=None,
                only_cross_attention=[True, False, False], use_linear_projection=True,
                attention_head_dim=[2, 4, 4], cross_attention_dim=32, norm_num_groups=4, sample_size=8)
    if want("unet_sdxs"):
        case_unet(root, "unet_sdxs", "sdxs_512_0_9/unet.json", sdxs, hw=(8, 12), timesteps=[999.0, 250.0],
                  seq_len=6,
                  desc="SDXS-512 UNet: 3 cross-attn levels, no mid block (mid_block_type null: the bottleneck goes "
                  "straight from the last down block to the first up block), only_cross_attention [true,false,"
                  "false] (down0 and, reversed, up2: attn1 attends to encoder_hidden_states with to_k/to_v of "
                  "width cross_attention_dim, so that transformer block has two cross-attentions), linear "
                  "projections, head counts [2,4,4].")
    if want("unet_midplain"):
        over = dict(sdxs, mid_block_type="UNetMidBlock2D")
        case_unet(root, "unet_midplain", "sdxs_512_0_9/unet.json", over, hw=(8, 12), timesteps=[999.0, 500.0],
                  seq_len=6,
                  desc="unet_sdxs with mid_block_type 'UNetMidBlock2D': UNet2DConditionModel builds it with "
                  "num_layers=0 and add_attention=False, i.e. the mid block is a single ResnetBlock2D (no "
                  "attention), keys mid_block.resnets.0.*.")

    if want("vae_kl"):
        case_vae(root, "vae_kl", AutoencoderKL, "sd15/vae.json",
                 dict(block_out_channels=[8, 16, 16, 16], layers_per_block=1, norm_num_groups=4, latent_channels=4,
                      scaling_factor=0.18215, sample_size=32),
                 vae_kl_forward,
                 desc="AutoencoderKL (SD VAE family): 4 levels -> factor 8; mid-block single-head attention; "
                 "encoder output through quant_conv, decoder input through post_quant_conv.",
                 extra_meta={"outputs_note": "out.mean / out.logvar = encode(image).latent_dist.mean / .logvar "
                             "(moments = quant_conv(encoder(x)) split in 2 along channels; logvar clamped to "
                             "[-30, 20]); out.decoded = decode(latents).sample (no scaling_factor applied: the "
                             "pipeline divides by scaling_factor before decode)"})
    if want("vae_tiny"):
        tcfg = load_cfg("taesd/vae.json")
        case_vae(root, "vae_tiny", AutoencoderTiny, "taesd/vae.json",
                 dict(encoder_block_out_channels=[8, 8, 8, 8], decoder_block_out_channels=[8, 8, 8, 8],
                      num_encoder_blocks=tcfg["num_encoder_blocks"], num_decoder_blocks=tcfg["num_decoder_blocks"],
                      act_fn="relu"),
                 vae_tiny_forward,
                 desc="AutoencoderTiny (TAESD): relu, block counts enc [1,3,3,3] / dec [3,3,3,1].",
                 extra_meta={"outputs_note": "out.latents = encode(image).latents (EncoderTiny maps the [-1,1] "
                             "input to [0,1] first: x.add(1).div(2)); out.decoded = decode(latents).sample "
                             "(DecoderTiny clamps tanh(z/3)*3 first and returns y.mul(2).sub(1)); no "
                             "scaling_factor (1.0) and no latent_magnitude/shift applied"})

    if want("pipeline_sd1"):
        case_pipeline(
            root, "pipeline_sd1",
            te_base="sd15/text_encoder.json",
            te_over=dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
                         vocab_size=49408, projection_dim=8),
            tok_dir="sd15",
            unet_base="sd15/unet.json",
            unet_over=dict(sd1_small, cross_attention_dim=8),
            sched_cfg="sd15/scheduler.json",
            sched_over=dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                            num_train_timesteps=1000, steps_offset=1, set_alpha_to_one=False, clip_sample=False,
                            timestep_spacing="leading", prediction_type="epsilon"),
            params=dict(prompt="a red circle on a blue background", negative_prompt=None, height=64, width=64,
                        steps=5, guidance_scale=7.5, eta=0.0),
            desc="Complete SD 1.5-style StableDiffusionPipeline folder (text encoder quick_gelu hidden 8 with the "
            "real 49408 vocabulary, SD1 UNet, 4-level AutoencoderKL, DDIM epsilon, leading spacing, steps_offset 1) "
            "and a 5-step CFG run.",
        )
    if want("pipeline_sd2v"):
        case_pipeline(
            root, "pipeline_sd2v",
            te_base="sd21_base/text_encoder.json",
            te_over=dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
                         vocab_size=49408, projection_dim=8),
            tok_dir="sd21_base",
            unet_base="sd21_768/unet.json",
            unet_over=dict(block_out_channels=[8, 16], down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                           up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], layers_per_block=2,
                           attention_head_dim=[2, 4], cross_attention_dim=8, norm_num_groups=4,
                           use_linear_projection=True, upcast_attention=True, sample_size=8),
            sched_cfg="sd21_768/scheduler.json",
            sched_over=dict(prediction_type="v_prediction", timestep_spacing="leading"),
            params=dict(prompt="a red circle on a blue background", negative_prompt="blurry", height=64, width=64,
                        steps=4, guidance_scale=5.0, eta=0.0),
            desc="Complete SD 2.x-style (v-prediction, 768 family) StableDiffusionPipeline folder: gelu text encoder "
            "hidden 8, tokenizer padding with '!' (id 0), linear-projection UNet with per-block heads [2,4] and "
            "upcast_attention, DDIM v_prediction; 4-step CFG run with negative prompt 'blurry'.",
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", type=str, default=None, help="comma-separated case names")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # nothing should depend on it; every draw uses an explicit Generator
    only = set(args.only.split(",")) if args.only else None
    if only:
        unknown = only - set(SEEDS)
        if unknown:
            raise SystemExit(f"unknown cases: {sorted(unknown)}")

    root: Path = args.out
    if only is None:
        if root.exists():
            shutil.rmtree(root)
    else:
        for c in only:
            if (root / c).exists():
                shutil.rmtree(root / c)
    root.mkdir(parents=True, exist_ok=True)
    build_all(root, only)

    total = 0
    for case in sorted(p for p in root.iterdir() if p.is_dir()):
        size = sum(f.stat().st_size for f in case.rglob("*") if f.is_file())
        total += size
        print(f"{case.name:16s} {size / 1e6:7.3f} MB")
    print(f"{'total':16s} {total / 1e6:7.3f} MB -> {root}")


if __name__ == "__main__":
    main()
