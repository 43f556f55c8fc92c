#!/usr/bin/env python3
"""Build tiny LDM-layout single-file Stable Diffusion checkpoints for brume's loader tests.

For each fixture (an SD1-style model with an OpenAI-CLIP text tower and an SD2-style
model with an OpenCLIP text tower) this script:

1. builds tiny random diffusers components (UNet2DConditionModel, AutoencoderKL,
   transformers CLIPTextModel), re-randomises every parameter and rounds it to fp16;
2. converts their state dicts to the ORIGINAL LDM key layout with our own reverse
   mapping (below), adds keys a real checkpoint carries that a loader must ignore,
   and writes `fixtures/ldm/<name>/model.safetensors`;
3. proves the file is a genuine LDM checkpoint by loading it back with diffusers'
   own single-file loaders (`UNet2DConditionModel.from_single_file`,
   `AutoencoderKL.from_single_file` and `create_diffusers_clip_model_from_ldm`, all
   with `config=` pointing at the fixture's `config/` folder) and requiring every
   tensor to equal the original model's;
4. writes `expected.json` (per component: every diffusers tensor name and shape,
   plus the facts brume's `ldm::infer` must read off the file) and `config/` (the
   diffusers config.json of each component);
5. writes `io.safetensors`: seeded inputs and the float32 CPU outputs of the
   models diffusers loaded from the file (text encoder, UNet, VAE encode/decode).

Run from the repository root:  .venv/bin/python tools/ldm/make_ldm_fixtures.py
The output is deterministic (fixed seeds); re-running rewrites the fixtures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.loaders.single_file_utils import (
    convert_ldm_clip_checkpoint,
    convert_ldm_unet_checkpoint,
    convert_ldm_vae_checkpoint,
    convert_open_clip_checkpoint,
    create_diffusers_clip_model_from_ldm,
)
from transformers import CLIPTextConfig, CLIPTextModel

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "fixtures" / "ldm"

UNET = "model.diffusion_model."
VAE = "first_stage_model."
CLIP = "cond_stage_model.transformer.text_model."
OPEN_CLIP = "cond_stage_model.model."

# The text-encoder names brume expects: the on-disk diffusers layout
# (`text_encoder/model.safetensors` of the diffusers SD repos). transformers >= 5.6
# flattened CLIPTextModel so its in-memory state dict lacks this prefix.
TEXT_PREFIX = "text_model."


# --------------------------------------------------------------------------- models

FIXTURES = {
    "sd1_tiny": dict(
        family="sd1",
        seed=1,
        unet=dict(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            block_out_channels=(8, 16, 16),
            layers_per_block=2,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=2,
            norm_num_groups=4,
        ),
        vae=dict(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=(8, 16, 16, 16),
            layers_per_block=2,
            norm_num_groups=4,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
        ),
        text=dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            hidden_act="quick_gelu",
            projection_dim=32,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
    ),
    "sd2_tiny": dict(
        family="sd2",
        seed=2,
        unet=dict(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            block_out_channels=(8, 16, 16),
            layers_per_block=2,
            # The middle level has no attention: its upsampler sits at `.1.conv`.
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=(2, 4, 4),
            use_linear_projection=True,
            transformer_layers_per_block=(1, 2, 2),
            norm_num_groups=4,
        ),
        vae=dict(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=(8, 16, 16, 16),
            layers_per_block=1,
            norm_num_groups=4,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
        ),
        text=dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            # OpenCLIP tower has one more resblock; diffusers drops the last one.
            num_hidden_layers=3,
            num_attention_heads=4,
            max_position_embeddings=77,
            hidden_act="gelu",
            projection_dim=32,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
    ),
}


def is_norm_weight(name: str, t: torch.Tensor) -> bool:
    return t.ndim == 1 and name.endswith(".weight")


def rerandomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """N(0, 1/fan_in) for matrices/kernels, 1 + 0.1 N for norm weights, 0.1 N for
    biases; then round to fp16 so the fp16 file holds the exact values."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim >= 2:
                fan_in = p[0].numel()
                v = torch.randn(p.shape, generator=gen) / fan_in**0.5
            elif is_norm_weight(name, p):
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            else:
                v = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(v.half().float())


def random_like(shape, name, gen) -> torch.Tensor:
    if len(shape) >= 2:
        fan_in = 1
        for s in shape[1:]:
            fan_in *= s
        v = torch.randn(shape, generator=gen) / fan_in**0.5
    elif len(shape) == 1 and name.endswith("weight"):
        v = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    else:
        v = 0.1 * torch.randn(shape, generator=gen)
    return v.half().float()


# ------------------------------------------------------------ diffusers -> LDM (ours)

UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}


def unet_resnet_tail(tail: str) -> str:
    module, rest = tail.split(".", 1)
    return f"{UNET_RESNET[module]}.{rest}"


def unet_to_ldm(sd: dict, cfg: dict) -> dict:
    """diffusers UNet2DConditionModel names -> LDM `model.diffusion_model.*` names."""
    per = cfg["layers_per_block"] + 1  # LDM slots per level: resnets + (down|up)sampler
    up_attn = ["CrossAttn" in t for t in cfg["up_block_types"]]
    fixed = {
        "conv_in": "input_blocks.0.0",
        "time_embedding.linear_1": "time_embed.0",
        "time_embedding.linear_2": "time_embed.2",
        "conv_norm_out": "out.0",
        "conv_out": "out.2",
    }
    out = {}
    for name, t in sd.items():
        parts = name.split(".")
        stem, leaf = ".".join(parts[:-1]), parts[-1]
        if stem in fixed:
            new = f"{fixed[stem]}.{leaf}"
        elif parts[0] == "down_blocks":
            b, kind, j = int(parts[1]), parts[2], int(parts[3])
            tail = ".".join(parts[4:])
            slot = 1 + b * per + j
            if kind == "resnets":
                new = f"input_blocks.{slot}.0.{unet_resnet_tail(tail)}"
            elif kind == "attentions":
                new = f"input_blocks.{slot}.1.{tail}"
            elif kind == "downsamplers":  # down_blocks.b.downsamplers.0.conv.X
                new = f"input_blocks.{1 + b * per + per - 1}.0.op.{parts[-1]}"
            else:
                raise KeyError(name)
        elif parts[0] == "mid_block":
            kind, j = parts[1], int(parts[2])
            tail = ".".join(parts[3:])
            if kind == "resnets":
                new = f"middle_block.{2 * j}.{unet_resnet_tail(tail)}"
            else:
                new = f"middle_block.1.{tail}"
        elif parts[0] == "up_blocks":
            i, kind, j = int(parts[1]), parts[2], int(parts[3])
            tail = ".".join(parts[4:])
            if kind == "resnets":
                new = f"output_blocks.{i * per + j}.0.{unet_resnet_tail(tail)}"
            elif kind == "attentions":
                new = f"output_blocks.{i * per + j}.1.{tail}"
            elif kind == "upsamplers":  # up_blocks.i.upsamplers.0.conv.X
                sub = 2 if up_attn[i] else 1
                new = f"output_blocks.{i * per + per - 1}.{sub}.conv.{parts[-1]}"
            else:
                raise KeyError(name)
        else:
            raise KeyError(name)
        out[UNET + new] = t
    return out


VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def vae_to_ldm(sd: dict, cfg: dict) -> dict:
    """diffusers AutoencoderKL names -> LDM `first_stage_model.*` names. The mid-block
    attention projections become 1x1 convolutions [C, C, 1, 1] as in LDM."""
    n = len(cfg["block_out_channels"])
    out = {}
    for name, t in sd.items():
        parts = name.split(".")
        side = parts[0]  # encoder | decoder | quant_conv | post_quant_conv
        if side in ("quant_conv", "post_quant_conv"):
            new = name
        elif parts[1] in ("conv_in", "conv_out"):
            new = name
        elif parts[1] == "conv_norm_out":
            new = f"{side}.norm_out.{parts[2]}"
        elif parts[1] in ("down_blocks", "up_blocks"):
            k, kind = int(parts[2]), parts[3]
            level = k if side == "encoder" else n - 1 - k  # decoder up blocks run reversed
            where = "down" if side == "encoder" else "up"
            if kind == "resnets":
                j, module = int(parts[4]), parts[5]
                module = "nin_shortcut" if module == "conv_shortcut" else module
                new = f"{side}.{where}.{level}.block.{j}.{module}.{parts[-1]}"
            else:  # downsamplers.0.conv.X / upsamplers.0.conv.X
                op = "downsample" if side == "encoder" else "upsample"
                new = f"{side}.{where}.{level}.{op}.conv.{parts[-1]}"
        elif parts[1] == "mid_block":
            kind, j = parts[2], int(parts[3])
            if kind == "resnets":
                new = f"{side}.mid.block_{j + 1}.{'.'.join(parts[4:])}"
            else:
                module = ".".join(parts[4:-1])
                new = f"{side}.mid.attn_1.{VAE_ATTN[module]}.{parts[-1]}"
                if t.ndim == 2:
                    t = t.reshape(*t.shape, 1, 1)
        else:
            raise KeyError(name)
        out[VAE + new] = t
    return out


def clip_to_ldm(sd: dict) -> dict:
    """transformers CLIPTextModel (flattened names) -> SD1 `cond_stage_model.transformer.text_model.*`."""
    out = {CLIP + name: t for name, t in sd.items()}
    # SD1 checkpoints carry the (int64) position_ids buffer; loaders must skip it.
    n = sd["embeddings.position_embedding.weight"].shape[0]
    out[CLIP + "embeddings.position_ids"] = torch.arange(n, dtype=torch.int64)[None, :]
    return out


OPEN_CLIP_LAYER = {
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
    "self_attn.out_proj": "attn.out_proj",
}


def open_clip_to_ldm(sd: dict, cfg: dict, gen: torch.Generator) -> dict:
    """transformers CLIPTextModel -> SD2 OpenCLIP `cond_stage_model.model.*`: q/k/v fused
    into `attn.in_proj_weight` [3d, d] / `in_proj_bias` [3d], one extra (final) resblock
    that diffusers does not use, plus `text_projection` and `logit_scale`."""
    d = cfg["hidden_size"]
    out = {
        OPEN_CLIP + "token_embedding.weight": sd["embeddings.token_embedding.weight"],
        OPEN_CLIP + "positional_embedding": sd["embeddings.position_embedding.weight"],
        OPEN_CLIP + "ln_final.weight": sd["final_layer_norm.weight"],
        OPEN_CLIP + "ln_final.bias": sd["final_layer_norm.bias"],
    }
    n = cfg["num_hidden_layers"]
    for i in range(n):
        src = f"encoder.layers.{i}."
        dst = f"{OPEN_CLIP}transformer.resblocks.{i}."
        for module, ldm in OPEN_CLIP_LAYER.items():
            for leaf in ("weight", "bias"):
                out[f"{dst}{ldm}.{leaf}"] = sd[f"{src}{module}.{leaf}"]
        for leaf in ("weight", "bias"):
            qkv = [sd[f"{src}self_attn.{p}_proj.{leaf}"] for p in "qkv"]
            out[f"{dst}attn.in_proj_{leaf}"] = torch.cat(qkv, dim=0)
    # The final OpenCLIP resblock (SD2 takes the penultimate layer's output).
    last = f"{OPEN_CLIP}transformer.resblocks.{n}."
    shapes = {
        "attn.in_proj_weight": (3 * d, d),
        "attn.in_proj_bias": (3 * d,),
        "attn.out_proj.weight": (d, d),
        "attn.out_proj.bias": (d,),
        "ln_1.weight": (d,),
        "ln_1.bias": (d,),
        "ln_2.weight": (d,),
        "ln_2.bias": (d,),
        "mlp.c_fc.weight": (cfg["intermediate_size"], d),
        "mlp.c_fc.bias": (cfg["intermediate_size"],),
        "mlp.c_proj.weight": (d, cfg["intermediate_size"]),
        "mlp.c_proj.bias": (d,),
    }
    for name, shape in shapes.items():
        out[last + name] = random_like(shape, name, gen)
    out[OPEN_CLIP + "text_projection"] = random_like((d, cfg["projection_dim"]), "text_projection", gen)
    out[OPEN_CLIP + "logit_scale"] = torch.tensor(4.6052)
    return out


def ignorable_extras(unet_ldm: dict) -> dict:
    """Keys real LDM checkpoints carry that brume must skip silently."""
    steps = 1000
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, steps, dtype=torch.float64) ** 2
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
    # One flattened EMA copy like `model_ema.diffusion_modeltime_embed0weight`.
    ema_src = UNET + "time_embed.0.weight"
    ema_name = "model_ema." + "".join(ema_src.split(".")[1:])
    return {
        "betas": betas.float(),
        "alphas_cumprod": alphas_cumprod.float(),
        "model_ema.decay": torch.tensor(0.9999, dtype=torch.float32),
        "model_ema.num_updates": torch.tensor(1234, dtype=torch.int32),
        ema_name: unet_ldm[ema_src].clone(),
    }


# ------------------------------------------------------------------------ checking


def text_state_dict(model: CLIPTextModel) -> dict:
    """Text-encoder state dict under the on-disk diffusers names (`text_model.` prefix)."""
    sd = model.state_dict()
    return {(k if k.startswith(TEXT_PREFIX) else TEXT_PREFIX + k): v for k, v in sd.items()}


def require_equal(what: str, want: dict, got: dict) -> None:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        raise SystemExit(f"{what}: key sets differ; missing={missing[:8]} extra={extra[:8]}")
    for k in sorted(want):
        a, b = want[k], got[k]
        if a.shape != b.shape or not torch.equal(a.float(), b.float()):
            raise SystemExit(f"{what}: tensor {k} differs ({tuple(a.shape)} vs {tuple(b.shape)})")
    print(f"  {what}: {len(want)} tensors identical")


def prove(path: Path, config_dir: Path, family: str, unet, vae, text, text_cfg):
    """Load the LDM file back with diffusers' own single-file code and compare.
    Returns the (unet, vae, text encoder) that diffusers loaded from the file."""
    from safetensors.torch import load_file

    checkpoint = load_file(str(path))
    kw = dict(config=str(config_dir), local_files_only=True)

    # 1. The public from_single_file loaders (the path StableDiffusionPipeline.from_single_file uses).
    unet2 = UNet2DConditionModel.from_single_file(str(path), subfolder="unet", **kw)
    require_equal("unet via UNet2DConditionModel.from_single_file", unet.state_dict(), unet2.state_dict())
    vae2 = AutoencoderKL.from_single_file(str(path), subfolder="vae", **kw)
    require_equal("vae via AutoencoderKL.from_single_file", vae.state_dict(), vae2.state_dict())
    text2 = create_diffusers_clip_model_from_ldm(
        CLIPTextModel, dict(checkpoint), subfolder="text_encoder", **kw
    )
    require_equal("text encoder via create_diffusers_clip_model_from_ldm", text.state_dict(), text2.state_dict())

    # 2. The raw conversion functions, to see that they produce no stray tensors.
    u = convert_ldm_unet_checkpoint(dict(checkpoint), dict(unet.config))
    require_equal("unet via convert_ldm_unet_checkpoint", unet.state_dict(), u)
    v = convert_ldm_vae_checkpoint(dict(checkpoint), dict(vae.config))
    require_equal("vae via convert_ldm_vae_checkpoint", vae.state_dict(), v)
    want_text = text_state_dict(text)
    if family == "sd1":
        t = convert_ldm_clip_checkpoint(dict(checkpoint))
        t = {k: v for k, v in t.items() if not k.endswith("position_ids")}  # a buffer, not a parameter
        require_equal("text encoder via convert_ldm_clip_checkpoint", want_text, t)
    else:
        t = convert_open_clip_checkpoint(text, dict(checkpoint), prefix=OPEN_CLIP)
        # diffusers drops the final resblock only by the hard-coded name `resblocks.23`;
        # for this tiny tower the final resblock is N (= num_hidden_layers).
        dropped = f"{TEXT_PREFIX}encoder.layers.{text_cfg['num_hidden_layers']}."
        t = {k: v for k, v in t.items() if not k.startswith(dropped)}
        require_equal("text encoder via convert_open_clip_checkpoint", want_text, t)
    return unet2, vae2, text2


# ------------------------------------------------------------------ reference I/O

# Inputs come from their own generator so the model bytes never depend on them.
IO_SEED_OFFSET = 1000
UNET_TIMESTEPS = (999.0, 37.0)
UNET_CONTEXT_LEN = 5  # deliberately not 77: the UNet must take any context length
TEXT_WORDS = 7  # ids between BOS and EOS


def text_ids(text_cfg: dict, gen: torch.Generator) -> torch.Tensor:
    """[1, 77] int64: BOS, TEXT_WORDS word ids (random in [2, vocab-1), the last one
    forced to vocab-1 so the top embedding row is used), EOS, then pad up to 77.
    With bos=0, eos=pad=1 transformers pools at the FIRST id equal to eos_token_id
    (the `eos_token_id != 2` rule), i.e. at index TEXT_WORDS + 1."""
    vocab, n = text_cfg["vocab_size"], text_cfg["max_position_embeddings"]
    bos, eos, pad = text_cfg["bos_token_id"], text_cfg["eos_token_id"], text_cfg["pad_token_id"]
    assert (bos, eos, pad) == (0, 1, 1), "text_ids assumes bos=0, eos=pad=1"
    words = torch.randint(2, vocab - 1, (TEXT_WORDS,), generator=gen)
    words[-1] = vocab - 1
    ids = [bos] + words.tolist() + [eos] + [pad] * (n - TEXT_WORDS - 2)
    return torch.tensor([ids], dtype=torch.int64)


def io_inputs(spec: dict) -> dict:
    gen = torch.Generator().manual_seed(IO_SEED_OFFSET + spec["seed"])
    u, v = spec["unet"], spec["vae"]
    down = 2 ** (len(v["block_out_channels"]) - 1)  # VAE spatial factor
    ids = text_ids(spec["text"], gen)
    size = u["sample_size"]
    vs = v["sample_size"]
    return {
        "in.input_ids": ids,
        "in.sample": torch.randn((2, u["in_channels"], size, size), generator=gen),
        "in.timestep": torch.tensor(UNET_TIMESTEPS, dtype=torch.float32),
        "in.encoder_hidden_states": torch.randn((2, UNET_CONTEXT_LEN, u["cross_attention_dim"]), generator=gen),
        "in.image": torch.rand((1, v["in_channels"], vs, vs), generator=gen) * 2.0 - 1.0,
        "in.latents": torch.randn((1, v["latent_channels"], vs // down, vs // down), generator=gen),
    }


def io_outputs(inputs: dict, unet, vae, text) -> dict:
    """Float32 CPU forward passes (single thread, for reproducible bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            t = text(input_ids=inputs["in.input_ids"])
            e = unet(inputs["in.sample"], inputs["in.timestep"], encoder_hidden_states=inputs["in.encoder_hidden_states"]).sample
            dist = vae.encode(inputs["in.image"]).latent_dist
            d = vae.decode(inputs["in.latents"]).sample
    finally:
        torch.set_num_threads(threads)
    return {
        "out.text_hidden": t.last_hidden_state,
        "out.text_pooled": t.pooler_output,
        "out.unet": e,
        "out.vae_mean": dist.mean,
        "out.vae_logvar": dist.logvar,
        "out.vae_decoded": d,
    }


def write_io(dest: Path, spec: dict, loaded, originals) -> None:
    """io.safetensors: seeded inputs and the outputs of the models diffusers /
    transformers loaded from model.safetensors, run in float32 on CPU."""
    inputs = io_inputs(spec)
    out = io_outputs(inputs, *(m.float().eval() for m in loaded))
    # Sanity: the in-memory originals hold the same values, so must agree.
    ref = io_outputs(inputs, *originals)
    for k, x in out.items():
        if x.dtype != torch.float32 or not torch.isfinite(x).all() or x.std().item() <= 1e-3:
            raise SystemExit(f"{k}: bad output (dtype {x.dtype}, std {x.std().item()})")
        diff = (x - ref[k]).abs().max().item()
        if diff > 1e-5:
            raise SystemExit(f"{k}: loaded model differs from original by {diff}")
    logvar = out["out.vae_logvar"]
    assert logvar.min() > -30.0 and logvar.max() < 20.0, "logvar clamp would be active"
    pooled_at = TEXT_WORDS + 1
    assert torch.equal(out["out.text_pooled"][0], out["out.text_hidden"][0, pooled_at])
    tensors = {k: v.contiguous() for k, v in sorted({**inputs, **out}.items())}
    path = dest / "io.safetensors"
    save_file(tensors, str(path), metadata={"generator": "tools/ldm/make_ldm_fixtures.py (see tools/ldm/README.md)"})
    os.chmod(path, 0o644)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    print(f"  wrote {shown(path)} ({path.stat().st_size} bytes): {shapes}")


def shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------ main


def inferred_facts(spec: dict, unet, vae, text_cfg: dict) -> dict:
    u, v = unet.config, vae.config
    n = len(u.block_out_channels)
    tl = u.transformer_layers_per_block
    tl = [tl] * n if isinstance(tl, int) else list(tl)
    down_attn = ["CrossAttn" in t for t in u.down_block_types]
    return {
        "family": spec["family"],
        "unet_in_channels": u.in_channels,
        "unet_out_channels": u.out_channels,
        "unet_block_out_channels": list(u.block_out_channels),
        "unet_layers_per_block": u.layers_per_block,
        "unet_down_attention": down_attn,
        "unet_up_attention": ["CrossAttn" in t for t in u.up_block_types],
        "unet_has_mid_attention": True,
        "unet_cross_attention_dim": u.cross_attention_dim,
        "unet_use_linear_projection": bool(u.use_linear_projection),
        # Only blocks with attention show their depth in the file; a block without
        # attention reads as the middle block's depth, which is what diffusers takes
        # from transformer_layers_per_block[-1].
        "unet_transformer_layers": [tl[i] if down_attn[i] else tl[-1] for i in range(n)],
        "vae_block_out_channels": list(v.block_out_channels),
        "vae_layers_per_block": v.layers_per_block,
        "vae_latent_channels": v.latent_channels,
        "text_hidden_size": text_cfg["hidden_size"],
        "text_layers": text_cfg["num_hidden_layers"],
        "text_intermediate_size": text_cfg["intermediate_size"],
        "text_vocab_size": text_cfg["vocab_size"],
        "text_max_positions": text_cfg["max_position_embeddings"],
    }


def compact_json(obj) -> str:
    """JSON with one line per tensor / fact, to keep the fixtures small but diffable."""
    lines = ["{"]
    top = list(obj.items())
    for i, (key, value) in enumerate(top):
        comma = "," if i + 1 < len(top) else ""
        if isinstance(value, dict):
            lines.append(f" {json.dumps(key)}: {{")
            inner = list(value.items())
            for j, (k2, v2) in enumerate(inner):
                c2 = "," if j + 1 < len(inner) else ""
                if isinstance(v2, dict):
                    lines.append(f"  {json.dumps(k2)}: {{")
                    items = list(v2.items())
                    for m, (k3, v3) in enumerate(items):
                        c3 = "," if m + 1 < len(items) else ""
                        lines.append(f"   {json.dumps(k3)}: {json.dumps(v3, separators=(',', ':'))}{c3}")
                    lines.append(f"  }}{c2}")
                else:
                    lines.append(f"  {json.dumps(k2)}: {json.dumps(v2, separators=(',', ':'))}{c2}")
            lines.append(f" }}{comma}")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == obj
    return text


def build(name: str, spec: dict, out_root: Path) -> None:
    print(f"{name}:")
    torch.manual_seed(spec["seed"])
    gen = torch.Generator().manual_seed(spec["seed"])

    unet = UNet2DConditionModel(**spec["unet"]).eval()
    vae = AutoencoderKL(**spec["vae"]).eval()
    text = CLIPTextModel(CLIPTextConfig(**spec["text"])).eval()
    for m in (unet, vae, text):
        rerandomise(m, gen)

    ldm = {}
    ldm.update(unet_to_ldm(unet.state_dict(), dict(unet.config)))
    ldm.update(vae_to_ldm(vae.state_dict(), dict(vae.config)))
    text_sd = {k.removeprefix(TEXT_PREFIX): v for k, v in text.state_dict().items()}
    if spec["family"] == "sd1":
        ldm.update(clip_to_ldm(text_sd))
    else:
        ldm.update(open_clip_to_ldm(text_sd, spec["text"], gen))
    ldm.update(ignorable_extras(ldm))
    # Parameters are stored fp16 (exact: rerandomise rounded them); schedule
    # buffers and scalars keep their own dtypes as in real checkpoints.
    keep = ("betas", "alphas_cumprod")
    ldm = {
        k: (v.half() if v.is_floating_point() and v.ndim > 0 and k not in keep else v).contiguous()
        for k, v in sorted(ldm.items())
    }

    dest = out_root / name
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "config").mkdir(parents=True)
    path = dest / "model.safetensors"
    save_file(ldm, str(path))
    os.chmod(path, 0o644)

    unet.save_config(str(dest / "config" / "unet"))
    vae.save_config(str(dest / "config" / "vae"))
    text.config.save_pretrained(str(dest / "config" / "text_encoder"))

    loaded = prove(path, dest / "config", spec["family"], unet, vae, text, spec["text"])

    expected = {
        "description": f"What brume's LDM loader must produce from model.safetensors ({spec['family']}); "
        "generated by tools/ldm/make_ldm_fixtures.py",
        "inferred": inferred_facts(spec, unet, vae, spec["text"]),
        "components": {
            "unet": {k: list(v.shape) for k, v in sorted(unet.state_dict().items())},
            "vae": {k: list(v.shape) for k, v in sorted(vae.state_dict().items())},
            "text_encoder": {k: list(v.shape) for k, v in sorted(text_state_dict(text).items())},
        },
    }
    (dest / "expected.json").write_text(compact_json(expected))
    counts = {c: len(v) for c, v in expected["components"].items()}
    print(f"  wrote {shown(path)} ({path.stat().st_size} bytes, {len(ldm)} LDM tensors), expected {counts}")
    write_io(dest, spec, loaded, (unet, vae, text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--only", choices=sorted(FIXTURES), action="append")
    args = ap.parse_args()
    for name in args.only or sorted(FIXTURES):
        build(name, FIXTURES[name], args.out)


if __name__ == "__main__":
    main()
