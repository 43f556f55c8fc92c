#!/usr/bin/env python3
"""Train brume's built-in text-to-image model on the procedural `brume-world` dataset.

A complete Stable Diffusion 1.x model at tiny widths, in diffusers format:
CLIP tokenizer (the real SD1.5 one) + CLIPTextModel + AutoencoderKL (factor 8) +
UNet2DConditionModel (epsilon, DDIM) + an LCM-distilled UNet (`unet_lcm/`, LCMScheduler).

Stages (each gets a share of `--budget-minutes`; see README.md):
  data    render the training set with `brume-world dataset` (two shards in parallel) and the held-out
          renders with `brume-world held-out` / `render`, load them, tokenize the captions
  vae     train the autoencoder (L1 + L2 + edge + small KL), report held-out PSNR
  encode  encode the training set once (latent mean and std), set vae.scaling_factor = 1/std
  text    pre-train the CLIP text encoder to state every attribute of its caption (from the scene specs)
  unet    train the UNet on cached latents and the frozen encoder's outputs (epsilon, offset noise, 10% caption dropout,
          AdamW, EMA), judge held-out samples, checkpoint a full pipeline to OUT/stage2/
  lcm     LCM distillation (diffusers' train_lcm_distill_sd recipe): DDIM solver over 50 teacher steps,
          CFG teacher, w-embedding, huber consistency loss against an EMA target
  export  fp16 diffusers folder written to OUT/.model.tmp-PID, loaded back with
          StableDiffusionPipeline.from_pretrained (DDIM and LCM), then renamed to OUT/model

`--device cuda` runs the stages up to the UNet's on a GPU (with `--stop-after unet`; the data parallel ranks and
the LCM stage are CPU-only), for experiments such as tools/train/gpu_width.sh; `--vae-from DIR` starts from a
trained autoencoder instead of the vae stage.

Everything is seeded. Training stages run until their time share is spent (so the step counts depend on
the machine; they are logged and written to OUT/model/training.json). Pass --vae-steps / --unet-steps /
--lcm-steps to fix them instead (bit-reproducible on the same hardware and thread count).
"""

import argparse
import copy
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# libgomp's default active spin-waiting collapses throughput (3x measured) as soon as anything else runs on the
# 2 cores; passive waiting costs almost nothing when the machine is idle. Must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_SRC = REPO / "fixtures/parity/pipeline_sd1/model/tokenizer"
TEXT_CONFIG_SRC = REPO / "fixtures/parity/pipeline_sd1/model/text_encoder/config.json"

# Stage shares of the total budget (relative weights; normalised). data/encode/export are fixed costs
# that are reserved; training stages get whatever the cumulative schedule leaves them.
DEFAULT_SHARES = "data=3,vae=12,encode=2,text=2,unet=28,lcm=8,export=2"

T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------------
# model definitions


def text_config(hidden, layers, heads):
    from transformers import CLIPTextConfig

    base = json.loads(TEXT_CONFIG_SRC.read_text())
    for k in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        base.pop(k, None)
    base.update(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        projection_dim=hidden,
        vocab_size=49408,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        eos_token_id=2,
        bos_token_id=0,
        pad_token_id=1,
    )
    return CLIPTextConfig(**base)


def make_vae(a):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * len(a.vae_channels),
        up_block_types=["UpDecoderBlock2D"] * len(a.vae_channels),
        block_out_channels=a.vae_channels,
        layers_per_block=1,
        act_fn="silu",
        latent_channels=4,
        norm_num_groups=a.vae_groups,
        sample_size=a.size,
        scaling_factor=0.18215,  # replaced by 1/std of the trained latents
        force_upcast=True,
    )


def make_unet(a, cross_dim, time_cond_proj_dim=None):
    from diffusers import UNet2DConditionModel

    n = len(a.unet_channels)
    down = ["CrossAttnDownBlock2D"] * (n - 1) + ["DownBlock2D"]
    up = ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * (n - 1)
    return UNet2DConditionModel(
        sample_size=a.size // 8,
        in_channels=4,
        out_channels=4,
        down_block_types=down,
        up_block_types=up,
        mid_block_type="UNetMidBlock2DCrossAttn",
        block_out_channels=a.unet_channels,
        layers_per_block=a.unet_layers,
        attention_head_dim=a.unet_heads,  # SD1 naming: this is the number of heads
        cross_attention_dim=cross_dim,
        norm_num_groups=a.unet_groups,
        time_cond_proj_dim=time_cond_proj_dim,
    )


def ddim_scheduler():
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type="epsilon",
        timestep_spacing="leading",
    )


def lcm_scheduler():
    from diffusers import LCMScheduler

    # As LCM-Dreamshaper-v7 (configs/lcm_dreamshaper_v7/scheduler.json).
    return LCMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=True,
        steps_offset=1,
        prediction_type="epsilon",
        timestep_spacing="leading",
        original_inference_steps=50,
    )


def n_params(m):
    return sum(p.numel() for p in m.parameters())


# --------------------------------------------------------------------------------------------------
# budget


class Budget:
    """Cumulative schedule: stage k must end by T0 + (share_0 + ... + share_k) * budget, so time a
    stage saves (or overruns) moves to (or is taken from) the next one."""

    def __init__(self, minutes, shares):
        self.total = minutes * 60.0
        items = [kv.split("=") for kv in shares.split(",")]
        w = {k: float(v) for k, v in items}
        s = sum(w.values())
        self.order = [k for k, _ in items]
        self.share = {k: v / s for k, v in w.items()}
        self.timing = {}

    def deadline(self, stage):
        cum = 0.0
        for k in self.order:
            cum += self.share[k]
            if k == stage:
                return T0 + cum * self.total
        raise KeyError(stage)

    def left(self, stage):
        return self.deadline(stage) - time.time()

    def begin(self, stage):
        self._t = time.time()
        log(f"=== stage {stage}: {self.left(stage):.0f}s until its deadline "
            f"({self.share[stage] * self.total:.0f}s share, {self.total - (time.time() - T0):.0f}s of budget left)")

    def end(self, stage):
        dt = time.time() - self._t
        self.timing[stage] = round(dt, 1)
        log(f"=== stage {stage} done in {dt:.1f}s (deadline slack {self.left(stage):+.0f}s)")


def cosine_lr(peak, step, warmup, frac, floor=0.05):
    return peak * min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def progress(start, deadline, step, max_steps):
    """Fraction of a stage done: by steps when a step count is fixed, else by time."""
    if max_steps:
        return step / max_steps
    return (time.time() - start) / max(1e-6, deadline - start)


def autocast(a):
    """bf16 autocast for a training forward pass when `--bf16` asks for it.

    Weights, optimizer state and losses stay fp32; only the convolutions and matmuls run in bf16. On a CPU with
    AVX512-BF16 a VAE step is 1.3x faster and a UNet step ~1.08x; the time-boxed stages turn that into steps.
    """
    return torch.autocast(torch.device(a.device).type, dtype=torch.bfloat16, enabled=a.bf16)


def use_attention(model, a):
    """Selects the attention implementation of a diffusers model for training (`--attention`).

    `math` is diffusers' plain AttnProcessor (batched matmul + softmax). At this UNet's sizes (256 tokens, head
    dims 32-128, batch 64) PyTorch's fused CPU SDPA spends ~190 ms per step in its backward alone, a quarter of
    the step (torch profiler, 2 cores); the plain path materialises 64 x 256 x 256 scores (16 MB), which is
    nothing here, and made a batch-64 bf16 step 1.36x faster (0.81-0.85 s -> 0.57-0.62 s, alternated). The
    maths is the same, so the exported weights' format does not depend on it; the precision is not: under bf16
    autocast the plain path rounds the scores to bf16 before the softmax (output error 2.1e-2 against fp32 for
    one layer, the fused SDPA 1.3e-2), a suspect in run 9's weaker text binding (tools/train/README.md)."""
    if a.attention == "math":
        from diffusers.models.attention_processor import AttnProcessor

        model.set_attn_processor(AttnProcessor())
    elif a.attention == "math32":
        model.set_attn_processor(Fp32ScoresAttention())
    return model


class Fp32ScoresAttention:
    """`--attention math32`: the plain path (batched matmul + softmax, so the fast backward of `math`) with
    the scores, the softmax and the weighted sum of values in fp32 even under bf16 autocast; only the q/k/v
    and output projections run in bf16. This takes suspect (1) of run 9 (bf16-rounded scores blurring the text
    binding) out of a run without giving back the plain path's speed: at this UNet's sizes the fp32 score
    matmuls are a small part of a step. Covers what this UNet's attention layers use: self- and
    cross-attention on (batch, tokens, channels), no attention mask, no spatial or cross norms."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        if hidden_states.ndim != 3 or attention_mask is not None or attn.spatial_norm is not None \
                or attn.group_norm is not None or attn.norm_cross or attn.residual_connection:
            raise ValueError("--attention math32 covers plain (batch, tokens, channels) attention only")
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q = attn.head_to_batch_dim(attn.to_q(hidden_states))
        k = attn.head_to_batch_dim(attn.to_k(context))
        v = attn.head_to_batch_dim(attn.to_v(context))
        with torch.autocast(q.device.type, enabled=False):  # diffusers' own scores + softmax, on fp32 factors
            out = torch.bmm(attn.get_attention_scores(q.float(), k.float()), v.float())
        out = attn.batch_to_head_dim(out)
        out = attn.to_out[1](attn.to_out[0](out))
        return out / attn.rescale_output_factor


def training_forward(model, a, what):
    """The callable a training loop runs its forward (and so backward) through: `model` itself, or under
    `--compile` a torch.compile'd wrapper sharing its parameters. Compilation fuses the UNet's many small
    element-wise ops (group norm, SiLU, residual adds); with `--attention math` it took a batch-64 bf16 step
    from 0.57-0.61 s to 0.43 s, for ~70 s of compilation on the first step. If compiling fails, the loop
    falls back to the eager model and says so instead of losing the run."""
    if not a.compile:
        return model
    compiled = torch.compile(model)
    state = {"fn": compiled, "checked": False}

    def call(*args, **kw):
        if state["checked"]:
            return state["fn"](*args, **kw)
        t0 = time.time()
        try:
            out = compiled(*args, **kw)
            log(f"{what}: compiled training forward in {time.time() - t0:.0f}s (first step)")
        except Exception as e:  # noqa: BLE001 - any compiler failure: train eagerly rather than die
            log(f"{what}: torch.compile failed ({type(e).__name__}: {e}); training eagerly")
            state["fn"] = model
            out = model(*args, **kw)
        state["checked"] = True
        return out

    return call


def stage_running(start, deadline, step, max_steps):
    if max_steps:
        return step < max_steps
    return time.time() < deadline


# --------------------------------------------------------------------------------------------------
# data


def world_bin(a):
    if a.world_bin:
        return a.world_bin
    target = os.environ.get("CARGO_TARGET_DIR", "/tmp/target-world")
    exe = Path(target) / "release" / "brume-world"
    if not exe.exists():
        log(f"building brume-world into {target}")
        subprocess.run(["cargo", "build", "--release", "-p", "brume-world"], cwd=REPO, check=True,
                       env={**os.environ, "CARGO_TARGET_DIR": target})
    return str(exe)


def load_png(path):
    return np.asarray(Image.open(path).convert("RGB"))


def stage_data(a, budget):
    budget.begin("data")
    exe = world_bin(a)
    data = Path(a.data)
    data.mkdir(parents=True, exist_ok=True)
    shards = []
    per = [a.count // a.data_shards + (1 if i < a.count % a.data_shards else 0) for i in range(a.data_shards)]
    procs = []
    for i, n in enumerate(per):
        seed = a.data_seed + i
        d = data / f"seed{seed}"
        shards.append((d, n))
        procs.append(subprocess.Popen([exe, "dataset", "--out", str(d), "--count", str(n), "--size", str(a.size),
                                       "--seed", str(seed), "--omit-size", str(a.omit_size),
                                       "--omit-position", str(a.omit_position)], stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"brume-world dataset failed: {err}")
        log(err.strip())

    # held-out prompts: never in the training set (the generator excludes them); rendered with their seeds
    ho_dir = data / f"heldout{a.size}"
    ho_dir.mkdir(exist_ok=True)
    ho = [json.loads(l) for l in subprocess.run([exe, "held-out", "--count", str(a.heldout)], check=True,
                                                capture_output=True, text=True).stdout.splitlines()]
    for i, r in enumerate(ho):
        p = ho_dir / f"{i:04d}.png"
        if not p.exists():
            subprocess.run([exe, "render", "--caption", r["caption"], "--seed", str(r["seed"]), "--out", str(p),
                            "--size", str(a.size)], check=True)
        r["file"] = str(p)

    captions, files, specs, scenes = [], [], [], []
    for d, n in shards:
        recs = [json.loads(l) for l in (d / "captions.jsonl").read_text().splitlines()][:n]
        captions += [r["caption"] for r in recs]
        specs += [r["spec"] for r in recs]
        scenes += [r["scene"] for r in recs]
        files += [d / r["file"] for r in recs]
    ho_captions = {r["caption"] for r in ho}
    leak = sum(c in ho_captions for c in captions)
    log(f"{len(files)} training images, {len(set(captions))} distinct captions, {len(ho)} held-out prompts "
        f"({leak} held-out captions appear verbatim in training)")

    t = time.time()
    with ThreadPoolExecutor(a.threads) as ex:
        images = np.stack(list(ex.map(load_png, files, chunksize=256)))
    ho_images = np.stack([load_png(r["file"]) for r in ho])
    log(f"loaded {images.shape} uint8 ({images.nbytes / 2**20:.0f} MiB) in {time.time() - t:.1f}s")

    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(TOKENIZER_SRC)
    uniq = sorted(set(captions) | {""} | {r["caption"] for r in ho})
    ids = tok(uniq, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    lookup = {c: i for i, c in enumerate(uniq)}
    tokens = ids[[lookup[c] for c in captions]]
    empty = ids[lookup[""]]
    longest = int((ids != tok.pad_token_id).sum(1).max()) + 1
    log(f"tokenized: longest caption {longest} tokens (of 77)")
    budget.end("data")
    return dict(images=images, captions=captions, specs=specs, scenes=scenes, tokens=tokens, empty=empty, heldout=ho,
                ho_images=ho_images, tokenizer=tok, exe=exe)


def to_tensor(u8):
    return torch.from_numpy(np.ascontiguousarray(u8)).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)


# --------------------------------------------------------------------------------------------------
# judge (brume-world's prompt-adherence check)


def judge_verdicts(exe, images, captions, out_dir):
    """images: float [-1,1] NCHW or uint8 NHWC. Saves PNGs, runs `brume-world judge`; returns its verdict per image."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(images, torch.Tensor):
        images = ((images.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    verdicts = []
    for i, (im, c) in enumerate(zip(images, captions)):
        p = out_dir / f"{i:03d}.png"
        Image.fromarray(im).save(p)
        r = subprocess.run([exe, "judge", "--image", str(p), "--caption", c], capture_output=True, text=True)
        verdicts.append(json.loads(r.stdout))
    return verdicts


def summarise_verdicts(verdicts):
    """(all-correct fraction, mean attribute score, per-attribute accuracy over the prompts that state it)."""
    ok, score, attrs = 0, 0.0, {}
    for v in verdicts:
        ok += bool(v["all_correct"])
        score += float(v["score"])
        for k, x in v["attributes"].items():
            attrs.setdefault(k.split("_", 1)[1], []).append(bool(x))
    n = max(1, len(verdicts))
    return ok / n, score / n, {k: round(sum(x) / len(x), 3) for k, x in sorted(attrs.items())}


def judge_images(exe, images, captions, out_dir):
    """judge_verdicts, summarised (see summarise_verdicts)."""
    return summarise_verdicts(judge_verdicts(exe, images, captions, out_dir))


def grid(images, path, cols=8):
    if isinstance(images, torch.Tensor):
        images = ((images.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    n, h, w, _ = images.shape
    rows = (n + cols - 1) // cols
    g = np.zeros((rows * h, cols * w, 3), np.uint8)
    for i, im in enumerate(images):
        g[(i // cols) * h:(i // cols + 1) * h, (i % cols) * w:(i % cols + 1) * w] = im
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(g).save(path)


# --------------------------------------------------------------------------------------------------
# stage 1: VAE


def vae_psnr(vae, ho, bs=50):
    vae.eval()
    out = []
    dev = vae.device
    with torch.no_grad():
        for i in range(0, len(ho), bs):
            x = to_tensor(ho[i:i + bs]).to(dev)
            out.append(vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1).cpu())
    vae.train()
    y = torch.cat(out)
    x = to_tensor(ho)
    mse = ((y - x) / 2).pow(2).mean((1, 2, 3))
    return float((10 * torch.log10(1 / mse.clamp_min(1e-10))).mean()), y


def edge_l1(y, x):
    """L1 distance between the horizontal and vertical differences of two image batches (sharp edges)."""
    return ((y[..., :, 1:] - y[..., :, :-1]) - (x[..., :, 1:] - x[..., :, :-1])).abs().mean() + \
        ((y[..., 1:, :] - y[..., :-1, :]) - (x[..., 1:, :] - x[..., :-1, :])).abs().mean()


def hard_patches(y, x, frac):
    """Mean squared error of the worst `frac` of 8x8 patches (one latent cell each): a small star or diamond is a
    few of an image's 256 cells, so the mean losses barely see it turn into a blob."""
    cells = F.avg_pool2d((y - x).pow(2).mean(1, keepdim=True), 8).flatten()
    return cells.topk(max(1, int(cells.numel() * frac))).values.mean()


# brume-world draws small objects with radius 0.09-0.12 of the image side and large ones with 0.19-0.22.
SMALL_RADIUS = 0.15


def small_object_pixels(scenes, size, extra):
    """Per-pixel weights of the VAE's L1 and L2 losses, [N, size, size]: 1, plus `extra` within 2 px of a small
    object's disk (see object_weights: the same reason one level down, where the shipped VAE keeps 65 % of small
    shapes and every large one)."""
    c = (np.arange(size, dtype=np.float32) + 0.5) / size
    cy, cx = np.meshgrid(c, c, indexing="ij")
    w = np.ones((len(scenes), size, size), np.float32)
    for i, sc in enumerate(scenes):
        for o in sc["objects"]:
            if o["r"] < SMALL_RADIUS:
                w[i][np.hypot(cx - o["cx"], cy - o["cy"]) < o["r"] + 2.0 / size] += extra
    return w


def stage_vae(a, budget, D, work):
    budget.begin("vae")
    if a.vae_from:
        return vae_from(a, budget, D)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    vae = make_vae(a)
    with torch.no_grad():  # start with a nearly deterministic posterior (std e^-3): the decoder sees signal, not noise
        vae.quant_conv.bias[vae.config.latent_channels:].fill_(a.vae_logvar_init)
    log(f"VAE {a.vae_channels} groups {a.vae_groups}: {n_params(vae) / 1e6:.2f}M params")
    vae.to(a.device)
    opt = torch.optim.AdamW(vae.parameters(), lr=a.vae_lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    images, ho = D["images"], D["ho_images"][:a.psnr_images]
    n, size, crop, bs = len(images), a.size, a.vae_crop, a.vae_batch
    deadline = budget.deadline("vae") - a.vae_reserve  # final PSNR, judge, save
    start = last = time.time()
    step, hist = 0, []

    while stage_running(start, deadline, step, a.vae_steps):
        frac = progress(start, deadline, step, a.vae_steps)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(a.vae_lr, step, 100, frac)
        full = frac >= 1 - a.vae_full_frac  # last part on whole images: GroupNorm sees full-image statistics
        if full and crop < size:
            bs_now = max(1, bs * crop * crop // (size * size))
        else:
            bs_now = bs
        idx = rng.integers(0, n, bs_now)
        if crop < size and not full:  # random crops aligned to the 8-px latent grid
            ox = rng.integers(0, (size - crop) // 8 + 1, bs_now) * 8
            oy = rng.integers(0, (size - crop) // 8 + 1, bs_now) * 8
            batch = np.stack([images[i, y:y + crop, x:x + crop] for i, x, y in zip(idx, ox, oy)])
        else:
            batch = images[idx]
        x = to_tensor(batch).to(a.device)
        with autocast(a):
            dist = vae.encode(x).latent_dist
            y = vae.decode(dist.sample()).sample.float()
        if a.vae_small_weight > 0:
            px = small_object_pixels([D["scenes"][i] for i in idx], size, a.vae_small_weight)
            if crop < size and not full:
                px = np.stack([m[y0:y0 + crop, x0:x0 + crop] for m, x0, y0 in zip(px, ox, oy)])
            wpx = torch.from_numpy(px)[:, None].to(a.device)
            l1 = ((y - x).abs() * wpx).mean()
            l2 = ((y - x).pow(2) * wpx).mean()
        else:
            l1 = (y - x).abs().mean()
            l2 = (y - x).pow(2).mean()
        edge = edge_l1(y, x)
        kl = dist.kl().mean() / dist.mean[0].numel()  # per latent element
        loss = l1 + l2 + a.vae_edge * edge + a.vae_kl * kl
        if a.vae_hard_weight > 0 and full:
            # Only in the whole-image phase: from the first step it held the VAE back (an A/B at step 250:
            # held-out PSNR 13.1 vs 16.8 dB).
            loss = loss + a.vae_hard_weight * hard_patches(y, x, a.vae_hard_frac)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        step += 1
        hist.append([l1.item(), l2.item(), edge.item(), kl.item()])
        if time.time() - last > a.log_every:
            last = time.time()
            m = np.mean(hist[-50:], 0)
            psnr, _ = vae_psnr(vae, ho[:20])
            log(f"vae step {step} ({step / (time.time() - start):.2f} it/s, lr {opt.param_groups[0]['lr']:.2e}) "
                f"l1 {m[0]:.4f} l2 {m[1]:.5f} edge {m[2]:.4f} kl {m[3]:.2f} | held-out PSNR(20) {psnr:.2f} dB")
    psnr, rec = vae_psnr(vae, ho)
    log(f"vae: {step} steps ({bs}x{crop}^2 crops, then {max(1, bs * crop * crop // (size * size))}x{size}^2 whole images "
        f"for the last {a.vae_full_frac:.0%}); held-out reconstruction PSNR {psnr:.2f} dB "
        f"over {len(ho)} renders {'(target 30 dB met)' if psnr >= 30 else '(BELOW the 30 dB target)'}")
    ref_judge = judge_images(D["exe"], D["ho_images"][:a.judge_images], [r["caption"] for r in D["heldout"][:a.judge_images]],
                             work / "judge_renders")
    log(f"judge on the held-out renders themselves (sanity): all-correct {ref_judge[0]:.3f}, score {ref_judge[1]:.3f}, per attribute {ref_judge[2]}")
    rec_judge = judge_images(D["exe"], rec[:a.judge_images], [r["caption"] for r in D["heldout"][:a.judge_images]],
                             work / "judge_vae")
    log(f"vae: judge on reconstructions of held-out renders: all-correct {rec_judge[0]:.3f}, score {rec_judge[1]:.3f}, per attribute {rec_judge[2]}")
    grid(torch.cat([to_tensor(ho[:8]), rec[:8]]), work.parent / "samples" / "vae_reconstructions.png")
    vae.eval().requires_grad_(False)
    torch.save(vae.state_dict(), work / "vae.pt")
    budget.end("vae")
    return vae, dict(steps=step, psnr_db=round(psnr, 2), psnr_images=len(ho), judge_reconstructions=rec_judge,
                     final_losses=dict(zip(["l1", "l2", "edge", "kl"], np.mean(hist[-50:], 0).round(5).tolist()))
                     if hist else None)


def vae_from(a, budget, D):
    """`--vae-from DIR`: an already trained autoencoder instead of the vae stage, for experiments on the later
    stages (the VAE is the stage they cannot change); its held-out PSNR is measured as the stage would."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(a.vae_from, dtype=torch.float32).to(a.device)
    psnr, _ = vae_psnr(vae, D["ho_images"][:a.psnr_images])  # leaves the model in train mode
    vae.eval().requires_grad_(False)
    log(f"vae: loaded {a.vae_from} ({n_params(vae) / 1e6:.2f}M params); held-out reconstruction PSNR {psnr:.2f} dB")
    budget.end("vae")
    return vae, dict(loaded_from=str(a.vae_from), psnr_db=round(psnr, 2), psnr_images=min(len(D["ho_images"]), a.psnr_images))


# --------------------------------------------------------------------------------------------------
# encode


def stage_encode(a, budget, D, vae, work):
    budget.begin("encode")
    images = D["images"]
    means, stds = [], []
    t = last = time.time()
    deadline = budget.deadline("encode")
    need = min(len(images), a.min_encoded)
    with torch.no_grad():  # the dataset is a random stream, so any prefix is a random subset
        for i in range(0, len(images), 64):
            if i >= need and time.time() > deadline:
                log(f"encode: deadline reached, training on the first {i} of {len(images)} images")
                break
            d = vae.encode(to_tensor(images[i:i + 64]).to(a.device)).latent_dist
            means.append(d.mean.cpu().clone())
            stds.append(d.std.cpu().clone())
            if time.time() - last > a.log_every:
                last = time.time()
                log(f"encode: {i + 64} images ({(i + 64) / (time.time() - t):.0f} img/s)")
    mean, std = torch.cat(means), torch.cat(stds)
    D["tokens"] = D["tokens"][:len(mean)]
    g = torch.Generator().manual_seed(a.seed)
    sample = mean + std * torch.randn(mean.shape, generator=g)
    sf = float(1.0 / sample.std())
    vae.register_to_config(scaling_factor=sf)
    log(f"encoded {len(mean)} images in {time.time() - t:.1f}s ({len(mean) / (time.time() - t):.0f} img/s); "
        f"latent mean {float(sample.mean()):.3f} std {float(sample.std()):.3f} (posterior std mean {float(std.mean()):.4f}) "
        f"-> scaling_factor {sf:.5f}")
    torch.save(dict(mean=mean, std=std, scaling_factor=sf), work / "latents.pt")
    budget.end("encode")
    return mean, std, sf


# --------------------------------------------------------------------------------------------------
# sampling helpers


def make_pipe(te, tok, unet, vae, scheduler):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tok, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sample_heldout(pipe, D, n, steps, guidance, seed, bs=16):
    """Images [-1,1] NCHW for the first n held-out prompts (seeded per prompt)."""
    ho = D["heldout"][:n]
    out = []
    with torch.no_grad():
        for i in range(0, n, bs):
            prompts = [r["caption"] for r in ho[i:i + bs]]
            gens = [torch.Generator().manual_seed(seed + i + j) for j in range(len(prompts))]
            im = pipe(prompts, num_inference_steps=steps, guidance_scale=guidance, generator=gens,
                      output_type="pt", height=D["size"], width=D["size"]).images
            out.append(im.cpu() * 2 - 1)
    return torch.cat(out)


def evaluate(pipe, D, work, tag, steps, guidance, a):
    t = time.time()
    im = sample_heldout(pipe, D, a.judge_images, steps, guidance, a.seed)
    acc, score, attrs = judge_images(D["exe"], im, [r["caption"] for r in D["heldout"][:a.judge_images]],
                                     work / f"judge_{tag}")
    log(f"eval {tag}: {steps} steps, guidance {guidance}: judge all-correct {acc:.3f}, score {score:.3f} "
        f"on {a.judge_images} held-out prompts ({time.time() - t:.1f}s); per attribute {attrs}")
    return dict(steps=steps, guidance=guidance, all_correct=round(acc, 4), score=round(score, 4), attributes=attrs), im



# --------------------------------------------------------------------------------------------------
# stage 2a: text encoder pre-training on the world's ground truth


def spec_labels(spec):
    """The attributes a caption states, one value per field ("-" where the caption has none)."""
    bg, objs = spec["background"], spec["objects"]
    vals = [bg["colour"], bg["kind"]]
    for i in range(2):
        o = objs[i] if i < len(objs) else None
        vals += [o["colour"], o["shape"], o["size"] or "-"] if o else ["-", "-", "-"]
    return vals + [spec["position"] or "-", spec["relation"] or "-"]


SHAPE_WORDS = ("circle", "square", "triangle", "star", "ring", "cross", "diamond")


def noun_labels(specs, tokens, tokenizer):
    """Where each object's shape word sits in its tokenized caption, and that object's colour, shape and size.

    Returns `at` (captions x 77, true at shape words), `labels` (captions x 77 x 3 class indices, read where `at`
    is true) and the three vocabularies. The grammar names objects in the spec's order (checked on the 30 000
    captions of run 8: every colour word before a shape word is that object's), so the k-th shape word is the
    k-th object; a caption whose shape words do not name its objects in order is left without noun labels
    rather than mislabelled."""
    ids = {tokenizer(w).input_ids[1]: w for w in SHAPE_WORDS}
    objs = [o for s in specs for o in s["objects"]]
    vocab = [sorted({o["colour"] for o in objs}), sorted({o["shape"] for o in objs}), sorted({o["size"] or "-" for o in objs})]
    at_noun = torch.zeros(tokens.shape, dtype=torch.bool)
    labels = torch.zeros(*tokens.shape, 3, dtype=torch.long)
    skipped = 0
    for i, spec in enumerate(specs):
        row = tokens[i].tolist()
        at = [p for p, t in enumerate(row) if t in ids]
        obs = spec["objects"]
        names = [ids[row[p]] for p in at]
        if names != [o["shape"] for o in obs]:
            skipped += 1
            continue
        for p, o in zip(at, obs):
            at_noun[i, p] = True
            labels[i, p] = torch.tensor([vocab[0].index(o["colour"]), vocab[1].index(o["shape"]), vocab[2].index(o["size"] or "-")])
    if skipped:
        log(f"text: {skipped} captions' shape words did not match their objects; no noun labels for them")
    return at_noun, labels, vocab


def stage_text(a, budget, D):
    """Teach the from-scratch CLIP text encoder what the captions say before the UNet needs it.

    Trained jointly from scratch, the text encoder gets its only signal through the UNet's
    cross-attention, which is weak and slow: the first full run's samples ignored the prompt (background
    colour at chance after 46k samples). The world's captions come with the scene spec they were rendered
    from, so the encoder is first trained to state every attribute (background colour and kind, each
    object's colour, shape and size, position, relation) from each token position at and after the
    end-of-text token, which under CLIP's causal mask are the positions that have read the whole caption.
    That is the role a pretrained CLIP plays for Stable Diffusion; the UNet stage then fine-tunes it.

    With `--text-noun-weight` > 0 each object's shape-word token is also trained to state that object's
    colour, shape and size (its adjectives precede it, so under the causal mask it has read them). Trained on
    the end-of-text positions alone, the noun tokens carry whatever is left over, and the UNet's
    cross-attention, which binds a place in the picture to some tokens, finds no token that says "yellow small
    triangle" as one unit: two-object prompts swapped or mixed their colours (run 8: 95 % of single objects'
    colours right, 60 % of the pairs')."""
    from transformers import CLIPTextModel

    budget.begin("text")
    torch.manual_seed(a.seed + 2)
    g = torch.Generator().manual_seed(a.seed + 2)
    dev = torch.device(a.device)
    te = CLIPTextModel(text_config(a.text_hidden, a.text_layers, a.text_heads))
    labels = [spec_labels(s) for s in D["specs"][:len(D["tokens"])]]  # the encode stage may have cut the set
    fields = list(zip(*labels))
    vocab = [sorted(set(f)) for f in fields]
    y = torch.tensor([[v.index(x) for v, x in zip(vocab, row)] for row in labels]).to(dev)
    heads = torch.nn.ModuleList([torch.nn.Linear(a.text_hidden, len(v)) for v in vocab])
    tokens = D["tokens"]
    eot = D["tokenizer"].eos_token_id
    first_eot = (tokens == eot).int().argmax(1)
    after = torch.arange(tokens.shape[1])[None, :] >= first_eot[:, None]  # positions that saw the whole caption
    n = len(tokens)
    val = torch.arange(n - min(1000, n // 10), n).to(dev)
    te.to(dev)
    heads.to(dev)
    tokens, after = tokens.to(dev), after.to(dev)
    params = list(te.parameters()) + list(heads.parameters())
    nouns = a.text_noun_weight > 0
    if nouns:
        noun, noun_y, noun_vocab = noun_labels(D["specs"][:n], D["tokens"], D["tokenizer"])
        noun_heads = torch.nn.ModuleList([torch.nn.Linear(a.text_hidden, len(v)) for v in noun_vocab]).to(dev)
        noun, noun_y = noun.to(dev), noun_y.to(dev)
        params += list(noun_heads.parameters())
    opt = torch.optim.AdamW(params, lr=a.text_lr, betas=(0.9, 0.99), weight_decay=0.01, fused=True)
    deadline = budget.deadline("text") - 5
    start = last = time.time()
    step, hist = 0, []
    bs = a.text_batch

    def forward(idx):
        h = te(tokens[idx]).last_hidden_state
        m = after[idx]
        hs = h[m]  # (positions, hidden)
        rows = m.nonzero()[:, 0]
        losses, accs = [], []
        for f, head in enumerate(heads):
            logit = head(hs)
            t = y[idx][rows, f]
            losses.append(F.cross_entropy(logit, t))
            accs.append((logit.argmax(1) == t).float().mean())
        loss = torch.stack(losses).mean()
        if nouns:
            at = noun[idx]
            hn, tn = h[at], noun_y[idx][at]
            nl = []
            for f, head in enumerate(noun_heads):
                logit = head(hn)
                nl.append(F.cross_entropy(logit, tn[:, f]))
                accs.append((logit.argmax(1) == tn[:, f]).float().mean())
            loss = loss + a.text_noun_weight * torch.stack(nl).mean()
        return loss, torch.stack(accs)

    while stage_running(start, deadline, step, a.text_steps):
        frac = progress(start, deadline, step, a.text_steps)
        lr = cosine_lr(a.text_lr, step, 50, frac, floor=0.1)
        for pg in opt.param_groups:
            pg["lr"] = lr
        idx = torch.randint(0, n - len(val), (bs,), generator=g).to(dev)
        loss, acc = forward(idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        hist.append([loss.item(), acc.min().item()])
        if time.time() - last > a.log_every:
            last = time.time()
            m = np.mean(hist[-50:], 0)
            log(f"text step {step} (lr {lr:.2e}) loss {m[0]:.4f} worst-field accuracy {m[1]:.3f}")
    te.eval()
    with torch.no_grad():
        _, vacc = forward(val)
    names = ["background_colour", "background_kind", "colour_1", "shape_1", "size_1", "colour_2", "shape_2",
             "size_2", "position", "relation"] + (["noun_colour", "noun_shape", "noun_size"] if nouns else [])
    acc = {k: round(float(v), 4) for k, v in zip(names, vacc)}
    log(f"text: {step} steps x {bs}; held-out caption accuracy per field {acc}")
    te.train()
    info = dict(steps=step, batch=bs, val_accuracy=acc,
                final_loss=round(float(np.mean([h[0] for h in hist[-50:]])), 5) if hist else None)
    budget.end("text")
    return te, info


# --------------------------------------------------------------------------------------------------
# stage 2: UNet + text encoder


class EMA:
    def __init__(self, params, decay):
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]
        self.decay, self.n = decay, 0

    @torch.no_grad()
    def update(self):
        self.n += 1
        d = min(self.decay, (1 + self.n) / (10 + self.n))
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1 - d)

    @torch.no_grad()
    def copy_to(self, params):
        for s, p in zip(self.shadow, params):
            p.copy_(s)


def alphas_cumprod():
    return ddim_scheduler().alphas_cumprod.float()


def training_noise(shape, g, offset):
    """Gaussian noise plus `offset` x a per-sample, per-channel constant ("offset noise").

    SD 1.5's schedule never reaches zero SNR: at t=961 (DDIM's first step) sqrt(alpha_bar) is 0.08,
    and a flat-colour image's latent channel means (std ~1 across this world's images) survive in the
    noisy latent's mean above the noise's own spatial mean (std 1/16 on a 16x16 latent). Trained on
    plain noise, the UNet reads the background colour from that leak instead of from the text, and at
    sampling time, from pure noise, the background follows the seed: run 2 named it right 28% of the
    time. The constant term drowns the leak in training, so the colour has to come from the prompt."""
    n = torch.randn(shape, generator=g)
    if offset > 0:
        n = n + offset * torch.randn(shape[0], shape[1], 1, 1, generator=g)
    return n


def object_weights(scenes, cells, extra):
    """Per-latent-cell weights of the UNet loss, [N, 1, cells, cells]: 1, plus `extra` on every cell within half a
    cell of a small object's disk.

    Why: a small object covers ~9 of a 16x16 latent's 256 cells, so in a plain mean over cells whether it comes out
    a star or a blob barely moves the loss; the run-13 model drew 86 % of large shapes right but 41 % of small
    ones, where its VAE alone keeps 65 %. The scene geometry is known, so the loss can say where to look."""
    c = (np.arange(cells, dtype=np.float32) + 0.5) / cells
    cy, cx = np.meshgrid(c, c, indexing="ij")
    w = np.ones((len(scenes), 1, cells, cells), np.float32)
    for i, sc in enumerate(scenes):
        for o in sc["objects"]:
            if o["r"] < SMALL_RADIUS:
                w[i, 0][np.hypot(cx - o["cx"], cy - o["cy"]) < o["r"] + 0.5 / cells] += extra
    return torch.from_numpy(w)


def unet_batch(a, ac, g, bs, lat_mean, lat_std, sf, hidden, hidden_empty, tokens, empty, weights=None):
    """One training batch: noisy latents, timesteps, noise, the text condition (cached hidden states when the
    encoder is frozen, else token ids with the dropped captions emptied) and the loss weights per latent cell
    (None without `--unet-small-weight`)."""
    n = len(hidden) if hidden is not None else len(tokens)
    dev = hidden.device if hidden is not None else tokens.device
    idx = torch.randint(0, n, (bs,), generator=g)
    z = (lat_mean[idx] + lat_std[idx] * torch.randn(bs, *lat_mean.shape[1:], generator=g)) * sf
    drop = torch.rand(bs, generator=g) < a.cfg_dropout
    idx_d, drop_d = idx.to(dev), drop.to(dev)
    if hidden is not None:
        cond = hidden[idx_d].clone()
        cond[drop_d] = hidden_empty
    else:
        cond = tokens[idx_d].clone()
        cond[drop_d] = empty
    noise = training_noise(z.shape, g, a.offset_noise)
    t = torch.randint(0, 1000, (bs,), generator=g)
    abar = ac[t].view(-1, 1, 1, 1)
    zt = abar.sqrt() * z + (1 - abar).sqrt() * noise
    cells = None if weights is None else weights[idx].to(dev)
    return zt.to(dev), t.to(dev), noise.to(dev), abar.to(dev), cond, cells


def unet_loss(a, fwd, zt, t, noise, abar, h, cells=None):
    """(loss, plain per-sample MSE). `cells` reweights the squared error within each sample (normalised to mean 1
    per sample, so the weight between samples and timesteps stays the min-SNR rule's)."""
    with autocast(a):
        pred = fwd(zt, t, h).sample.float()
    snr = abar.flatten() / (1 - abar.flatten())
    w = torch.clamp(snr, max=a.min_snr) / snr if a.min_snr > 0 else torch.ones_like(snr)
    err = (pred - noise).pow(2)
    mse = err.mean((1, 2, 3))
    if cells is not None:
        cells = cells / cells.mean((1, 2, 3), keepdim=True)
        return (w * (err * cells).mean((1, 2, 3))).mean(), mse
    return (w * mse).mean(), mse


def average_grads(params, ranks):
    """Sums every rank's gradients (one all-reduce of one flat buffer) and divides by the rank count, so each rank
    steps with the gradient of the whole batch and the replicas stay identical."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([x.reshape(-1) for x in grads])
    dist.all_reduce(flat)
    flat /= ranks
    off = 0
    for x in grads:
        x.copy_(flat[off:off + x.numel()].view_as(x))
        off += x.numel()


RANK_TIMEOUT_S = 300


def unet_rank(rank, ranks, a, store, state, shared):
    """A data-parallel helper rank of the UNet stage (`--ranks`): a replica of the UNet on one thread that computes
    the gradient of its share of each batch and averages it with rank 0's. Rank 0 decides when to stop and the
    learning rate, and sends both before every step."""
    join_ranks(rank, ranks, store)
    torch.manual_seed(a.seed + 1)
    unet = use_attention(make_unet(a, a.text_hidden), a)
    unet.load_state_dict(state)
    unet.train()
    fwd = training_forward(unet, a, f"unet rank {rank}")
    params = list(unet.parameters())
    opt = torch.optim.AdamW(params, lr=a.unet_lr, betas=(0.9, 0.999), weight_decay=0.01, fused=True)
    ac = alphas_cumprod()
    g = torch.Generator().manual_seed(a.seed + 1 + 7919 * rank)

    def step():
        zt, t, noise, abar, h, cells = unet_batch(a, ac, g, a.unet_batch // ranks, shared["lat_mean"],
                                                  shared["lat_std"], shared["sf"], shared["hidden"],
                                                  shared["hidden_empty"], None, None, shared["weights"])
        loss, _ = unet_loss(a, fwd, zt, t, noise, abar, h, cells)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        average_grads(params, ranks)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    follow_rank0(opt, step)


def join_ranks(rank, ranks, store):
    """A helper rank's one thread and its place in the process group of `start_ranks`."""
    import datetime
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))


def caption_states(te, tokens):
    """The text encoder's hidden states of every caption, 512 at a time, for stages that compute them once."""
    return torch.cat([te(tokens[i:i + 512]).last_hidden_state for i in range(0, len(tokens), 512)])


def lead_step(lr):
    """Rank 0's half of `follow_rank0`: one more step, at learning rate `lr`."""
    import torch.distributed as dist

    dist.broadcast(torch.tensor([1.0, lr], dtype=torch.float64), 0)


def follow_rank0(opt, step):
    """A helper rank's loop: before every step rank 0 broadcasts (1, learning rate); (0, _) ends the stage
    (`stop_ranks`)."""
    import torch.distributed as dist

    ctl = torch.zeros(2, dtype=torch.float64)
    while True:
        dist.broadcast(ctl, 0)
        if ctl[0] == 0:
            break
        for pg in opt.param_groups:
            pg["lr"] = float(ctl[1])
        step()
    dist.destroy_process_group()


def start_ranks(a, work, unet, shared, fn=None, ranks=None):
    """Starts ranks 1.. of `--ranks` (spawned processes, one thread each, running `fn`, by default the UNet
    stage's `unet_rank`; `ranks` overrides the count) and joins them as rank 0.

    Why: on these 2 cores one process with 2 threads leaves a third of the machine idle in a UNet this small
    (threads wait at every op's end); two 1-thread processes with a gradient all-reduce per step trained
    1.32-1.39x more samples per second (tools/train/step_bench.py, 2026-12-03). Returns the processes."""
    import datetime
    import torch.distributed as dist
    import torch.multiprocessing as tmp

    store = work / f".ranks-{os.getpid()}"
    store.unlink(missing_ok=True)
    for v in shared.values():
        if torch.is_tensor(v):
            v.share_memory_()
    ctx = tmp.get_context("spawn")
    fn, ranks = fn or unet_rank, ranks or a.ranks
    if isinstance(unet, dict):  # several models' states (the LCM stage's)
        state = {name: {k: v.detach().clone() for k, v in m.state_dict().items()} for name, m in unet.items()}
    else:
        state = {k: v.detach().clone() for k, v in unet.state_dict().items()}
    procs = [ctx.Process(target=fn, args=(r, ranks, a, str(store), state, shared), daemon=True)
             for r in range(1, ranks)]
    for pr in procs:
        pr.start()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=ranks,
                            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    log(f"{fn.__name__.split('_')[0]}: {ranks} data-parallel ranks of 1 thread")
    return procs, store


def run_collective(collective, step, procs, store, a, ranks, what):
    """Runs one collective with the helper ranks; the rank count to go on with (`ranks`, or 1 once they are lost:
    a lost helper must not lose the run)."""
    try:
        collective()
        return ranks
    except Exception as e:  # noqa: BLE001 - any failure of the process group
        log(f"{what}: data-parallel ranks failed at step {step} ({type(e).__name__}: {e}); continuing alone")
        stop_ranks(procs, store, ok=False)
        torch.set_num_threads(a.threads)
        return 1


def stop_ranks(procs, store, ok):
    import torch.distributed as dist

    if ok:
        dist.broadcast(torch.zeros(2, dtype=torch.float64), 0)
    dist.destroy_process_group()
    for pr in procs:
        pr.join(timeout=30)
        if pr.is_alive():
            pr.kill()
    store.unlink(missing_ok=True)


def stage_unet(a, budget, D, lat_mean, lat_std, sf, work, te):
    budget.begin("unet")
    torch.manual_seed(a.seed + 1)
    g = torch.Generator().manual_seed(a.seed + 1)
    unet = use_attention(make_unet(a, a.text_hidden), a).to(a.device)
    fwd = training_forward(unet, a, "unet")
    log(f"text encoder {n_params(te) / 1e6:.2f}M params, UNet {a.unet_channels} x{a.unet_layers}: "
        f"{n_params(unet) / 1e6:.2f}M params")
    tokens, empty = D["tokens"].to(a.device), D["empty"].to(a.device)
    frozen = a.text_lr_mult == 0
    hidden = hidden_empty = None
    if frozen:
        # The pre-trained encoder already states every attribute; freezing it lets its outputs be computed once
        # per caption (about 12% more UNet steps in the same time) instead of on every step.
        te.eval().requires_grad_(False)
        with torch.no_grad():
            hidden = caption_states(te, tokens)
            hidden_empty = te(empty[None]).last_hidden_state[0]
        params = list(unet.parameters())
        groups = [dict(params=params, mult=1.0)]
    else:
        params = list(te.parameters()) + list(unet.parameters())
        groups = [dict(params=list(te.parameters()), mult=a.text_lr_mult), dict(params=list(unet.parameters()), mult=1.0)]
    opt = torch.optim.AdamW(groups, lr=a.unet_lr, betas=(0.9, 0.999), weight_decay=0.01, fused=True)
    ema = EMA(params, a.ema)
    ac = alphas_cumprod()
    bs = a.unet_batch
    ranks = a.ranks
    weights = None
    if a.unet_small_weight > 0:
        weights = object_weights(D["scenes"][:len(lat_mean)], lat_mean.shape[-1], a.unet_small_weight)
        log(f"unet: loss weight 1 + {a.unet_small_weight} on small objects' latent cells "
            f"({float((weights > 1).float().mean()):.1%} of all cells)")
    if ranks > 1:
        shared = dict(lat_mean=lat_mean, lat_std=lat_std, sf=sf, hidden=hidden, hidden_empty=hidden_empty,
                      weights=weights)
        procs, store = start_ranks(a, work, unet, shared)
        torch.set_num_threads(1)
    deadline = budget.deadline("unet") - a.unet_reserve

    def with_ranks(collective, step):
        return run_collective(collective, step, procs, store, a, a.ranks, "unet")

    start = last = time.time()
    step, hist, pending = 0, [], []
    while stage_running(start, deadline, step, a.unet_steps):
        frac = progress(start, deadline, step, a.unet_steps)
        lr = cosine_lr(a.unet_lr, step, 200, frac, floor=0.1)
        for pg in opt.param_groups:
            pg["lr"] = lr * pg["mult"]
        if ranks > 1:
            ranks = with_ranks(lambda: lead_step(lr), step)
        zt, t, noise, abar, cond, cells = unet_batch(a, ac, g, bs // ranks, lat_mean, lat_std, sf, hidden,
                                                     hidden_empty, tokens, empty, weights)
        h = cond if frozen else te(cond).last_hidden_state
        loss, mse = unet_loss(a, fwd, zt, t, noise, abar, h, cells)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if ranks > 1:
            # On failure this step keeps rank 0's own gradient.
            ranks = with_ranks(lambda: average_grads(params, ranks), step)
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema.update()
        step += 1
        # kept on the device until a log line needs them: a .item() per step would wait for the GPU every step
        pending.append(torch.stack([loss.detach(), mse.detach().mean(), gn.detach()]))
        if time.time() - last > a.log_every:
            last = time.time()
            hist += torch.stack(pending).tolist()
            pending.clear()
            m = np.mean(hist[-100:], 0)
            log(f"unet step {step} ({step * bs / (time.time() - start):.1f} samples/s, lr {lr:.2e}) "
                f"loss {m[0]:.4f} mse {m[1]:.4f} gradnorm {m[2]:.2f}")
    if ranks > 1:
        stop_ranks(procs, store, ok=True)
        torch.set_num_threads(a.threads)
    if pending:
        hist += torch.stack(pending).tolist()
    log(f"unet: {step} steps x {bs} = {step * bs} samples ({step * bs / len(tokens):.1f} epochs) in {time.time() - start:.0f}s")

    te.eval().requires_grad_(False)
    unet.eval().requires_grad_(False)
    ema.copy_to(params)  # ship the EMA weights
    torch.save(dict(te=te.state_dict(), unet=unet.state_dict()), work / "unet_stage.pt")
    info = dict(steps=step, batch=bs, samples=step * bs, ranks=a.ranks,
                final_loss=dict(zip(["loss", "mse", "gradnorm"], np.mean(hist[-100:], 0).round(5).tolist())) if hist else None)
    budget.end("unet")
    return te, unet, info


# --------------------------------------------------------------------------------------------------
# stage 3: LCM distillation (diffusers examples/consistency_distillation/train_lcm_distill_sd_wds.py)


def guidance_scale_embedding(w, dim):
    """diffusers' get_guidance_scale_embedding (LatentConsistencyModelPipeline / StableDiffusionPipeline)."""
    w = w * 1000.0
    half = dim // 2
    emb = math.log(10000.0) / (half - 1)
    emb = torch.exp(torch.arange(half, dtype=torch.float32) * -emb)
    emb = w.float()[:, None] * emb[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
    if dim % 2 == 1:
        emb = F.pad(emb, (0, 1))
    return emb


def boundary_scalings(t, sigma_data=0.5, timestep_scaling=10.0):
    st = timestep_scaling * t.float()
    c_skip = sigma_data**2 / (st**2 + sigma_data**2)
    c_out = st / (st**2 + sigma_data**2) ** 0.5
    return c_skip.view(-1, 1, 1, 1), c_out.view(-1, 1, 1, 1)


class LcmSolver:
    """What every LCM distillation step shares: the teacher's schedule, the DDIM solver's skip of k = 1000 /
    `--lcm-ddim-steps` timesteps (origin steps 19, 39, ..., 999 as LCMScheduler's) and the empty caption's
    hidden states for the teacher's unconditional branch."""

    def __init__(self, a, uncond):
        self.ac = alphas_cumprod()
        self.k = 1000 // a.lcm_ddim_steps
        self.ddim_t = torch.arange(1, a.lcm_ddim_steps + 1) * self.k - 1
        self.ac_prev = torch.cat([self.ac[:1], self.ac[self.ddim_t[:-1]]])
        self.uncond = uncond

    def x0_from_eps(self, eps, t, x):
        ab = self.ac[t].view(-1, 1, 1, 1)
        return (x - (1 - ab).sqrt() * eps) / ab.sqrt()


def lcm_loss(a, S, g, bs, lat_mean, lat_std, sf, condition, student, teacher, target):
    """The pseudo-Huber consistency loss of one batch of `bs` (diffusers' train_lcm_distill_sd_wds.py): the
    student's boundary-scaled x0 at t against the EMA target's at the teacher's guided DDIM step t -> t - k.
    `condition(idx)` gives the sampled captions' hidden states."""
    idx = torch.randint(0, len(lat_mean), (bs,), generator=g)
    z = (lat_mean[idx] + lat_std[idx] * torch.randn(bs, *lat_mean.shape[1:], generator=g)) * sf
    h = condition(idx)
    noise = training_noise(z.shape, g, a.offset_noise)
    index = torch.randint(0, a.lcm_ddim_steps, (bs,), generator=g)
    t_start = S.ddim_t[index]
    t_prev = (t_start - S.k).clamp_min(0)
    cs_s, co_s = boundary_scalings(t_start)
    cs_p, co_p = boundary_scalings(t_prev)
    ab = S.ac[t_start].view(-1, 1, 1, 1)
    zt = ab.sqrt() * z + (1 - ab).sqrt() * noise
    w = (a.lcm_w_max - a.lcm_w_min) * torch.rand(bs, generator=g) + a.lcm_w_min
    w_emb = guidance_scale_embedding(w, a.lcm_cond_dim)
    w4 = w.view(-1, 1, 1, 1)

    eps_s = student(zt, t_start, h, timestep_cond=w_emb).sample
    model_pred = cs_s * zt + co_s * S.x0_from_eps(eps_s, t_start, zt)
    with torch.no_grad():
        both = teacher(torch.cat([zt, zt]), torch.cat([t_start, t_start]),
                       torch.cat([h, S.uncond.expand(bs, -1, -1)])).sample
        eps_c, eps_u = both.chunk(2)
        x0_c, x0_u = S.x0_from_eps(eps_c, t_start, zt), S.x0_from_eps(eps_u, t_start, zt)
        x0 = x0_c + w4 * (x0_c - x0_u)
        eps = eps_c + w4 * (eps_c - eps_u)
        abp = S.ac_prev[index].view(-1, 1, 1, 1)
        x_prev = abp.sqrt() * x0 + (1 - abp).sqrt() * eps  # DDIM solver step t_start -> t_prev
        eps_t = target(x_prev, t_prev, h, timestep_cond=w_emb).sample
        tgt = cs_p * x_prev + co_p * S.x0_from_eps(eps_t, t_prev, x_prev)
    return (torch.sqrt((model_pred - tgt).pow(2) + a.huber_c**2) - a.huber_c).mean()


def lcm_models(a, teacher_state, student_state=None):
    """(student, teacher, EMA target, optimiser) of LCM distillation. Without `student_state` the student is
    the teacher plus a zeroed guidance projection, so it starts as the teacher."""
    teacher = use_attention(make_unet(a, a.text_hidden), a)
    teacher.load_state_dict(teacher_state)
    teacher.eval().requires_grad_(False)
    student = use_attention(make_unet(a, a.text_hidden, time_cond_proj_dim=a.lcm_cond_dim), a)
    if student_state is None:
        missing, unexpected = student.load_state_dict(teacher_state, strict=False)
        assert not unexpected and all("cond_proj" in k for k in missing), (missing, unexpected)
        with torch.no_grad():
            student.time_embedding.cond_proj.weight.zero_()
    else:
        student.load_state_dict(student_state)
    student.train()
    target = copy.deepcopy(student).eval().requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=a.lcm_lr, betas=(0.9, 0.999), weight_decay=0.0, fused=True)
    return student, teacher, target, opt


def lcm_update(a, student, target, opt, loss, reduce=None):
    """Backward, `reduce` (the gradient all-reduce of data-parallel ranks), clipping, the optimiser step and the
    EMA target's update; the gradient norm. Every rank runs it, so the replicas (student, target) stay identical."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if reduce is not None:
        reduce()
    gn = torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    opt.step()
    with torch.no_grad():
        torch._foreach_lerp_(list(target.parameters()), [p.detach() for p in student.parameters()], 1 - a.lcm_ema)
    return gn


def lcm_rank(rank, ranks, a, store, state, shared):
    """A data-parallel helper rank of the LCM stage (`--lcm-ranks`), as unet_rank is of the UNet stage: a
    replica of student, teacher and target on one thread that distils its share of each batch."""
    join_ranks(rank, ranks, store)
    torch.manual_seed(a.seed + 2)
    student, teacher, target, opt = lcm_models(a, state["teacher"], state["student"])
    S = LcmSolver(a, shared["uncond"])
    hidden = shared["hidden"]
    params = list(student.parameters())
    g = torch.Generator().manual_seed(a.seed + 2 + 7919 * rank)

    def step():
        loss = lcm_loss(a, S, g, a.lcm_batch // ranks, shared["lat_mean"], shared["lat_std"], shared["sf"],
                        lambda idx: hidden[idx], student, teacher, target)
        lcm_update(a, student, target, opt, loss, lambda: average_grads(params, ranks))

    follow_rank0(opt, step)


def unet_from(a, budget):
    """`--unet-from PATH`: a trained text encoder and UNet instead of the text and unet stages, for experiments on
    LCM distillation alone. PATH is an earlier run's directory (the fp32 EMA UNet its UNet stage saved in
    work/unet_stage.pt) or a diffusers model folder (its text_encoder/ and unet/, e.g. the shipped models/builtin,
    fp16 weights widened to fp32). Its data, VAE (`--vae-from`) and model arguments must be the ones it was trained
    with: the latents it learnt are encoded again here."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    budget.begin("unet")
    root = Path(a.unet_from)
    if (root / "model_index.json").is_file():
        path = root
        state = dict(te=CLIPTextModel.from_pretrained(root / "text_encoder").float().state_dict(),
                     unet=UNet2DConditionModel.from_pretrained(root / "unet").float().state_dict())
    elif (root / "work" / "unet_stage.pt").is_file():
        path = root / "work" / "unet_stage.pt"
        state = torch.load(path, map_location="cpu", weights_only=True)
    else:
        sys.exit(f"--unet-from: {root} is neither a run directory whose UNet stage finished (work/unet_stage.pt) "
                 "nor a diffusers model folder (model_index.json)")
    te = CLIPTextModel(text_config(a.text_hidden, a.text_layers, a.text_heads))
    unet = make_unet(a, a.text_hidden)
    try:
        te.load_state_dict(state["te"])
        unet.load_state_dict(state["unet"])
    except RuntimeError as e:
        sys.exit(f"--unet-from {path}: its text encoder or UNet is not the one these arguments describe "
                 f"(--text-*, --unet-* must be the ones it was trained with): {e}")
    te.eval().requires_grad_(False)
    unet.eval().requires_grad_(False)
    log(f"unet: loaded the text encoder and UNet of {path}")
    budget.end("unet")
    return te, unet, dict(loaded_from=str(path))


def stage_lcm(a, budget, D, te, teacher, lat_mean, lat_std, sf, work):
    budget.begin("lcm")
    torch.manual_seed(a.seed + 2)
    g = torch.Generator().manual_seed(a.seed + 2)
    student, teacher, target, opt = lcm_models(a, teacher.state_dict())
    tokens, empty = D["tokens"], D["empty"]
    with torch.no_grad():
        uncond = te(empty[None]).last_hidden_state
    S = LcmSolver(a, uncond)
    bs, ranks = a.lcm_batch, a.lcm_ranks
    if ranks > 1:
        # The helpers share the captions' hidden states (computed once) instead of each running the encoder.
        with torch.no_grad():
            hidden = caption_states(te, tokens)

        def condition(idx):
            return hidden[idx]

        shared = dict(lat_mean=lat_mean, lat_std=lat_std, sf=sf, hidden=hidden, uncond=uncond)
        procs, store = start_ranks(a, work, dict(student=student, teacher=teacher), shared, fn=lcm_rank, ranks=ranks)
        torch.set_num_threads(1)
    else:
        def condition(idx):
            with torch.no_grad():
                return te(tokens[idx]).last_hidden_state

    params = list(student.parameters())

    def reduce():
        """The all-reduce of rank 0; on failure the step keeps its own gradient and the stage goes on alone."""
        nonlocal ranks
        ranks = run_collective(lambda: average_grads(params, ranks), step, procs, store, a, ranks, "lcm")

    deadline = budget.deadline("lcm") - a.lcm_reserve
    start = last = time.time()
    step, hist = 0, []
    while stage_running(start, deadline, step, a.lcm_steps):
        frac = progress(start, deadline, step, a.lcm_steps)
        lr = cosine_lr(a.lcm_lr, step, 50, frac, floor=0.2)
        for pg in opt.param_groups:
            pg["lr"] = lr
        if ranks > 1:
            ranks = run_collective(lambda: lead_step(lr), step, procs, store, a, ranks, "lcm")
        loss = lcm_loss(a, S, g, bs // ranks, lat_mean, lat_std, sf, condition, student, teacher, target)
        gn = lcm_update(a, student, target, opt, loss, reduce if ranks > 1 else None)
        step += 1
        hist.append([loss.item(), gn.item()])
        if time.time() - last > a.log_every:
            last = time.time()
            m = np.mean(hist[-100:], 0)
            log(f"lcm step {step} ({step * bs / (time.time() - start):.1f} samples/s, lr {lr:.2e}) "
                f"huber {m[0]:.5f} gradnorm {m[1]:.3f}")
    if ranks > 1:
        stop_ranks(procs, store, ok=True)
        torch.set_num_threads(a.threads)
    log(f"lcm: {step} steps x {bs} = {step * bs} samples in {time.time() - start:.0f}s")
    student.eval().requires_grad_(False)
    torch.save(dict(student=student.state_dict(), target=target.state_dict()), work / "lcm_stage.pt")
    info = dict(steps=step, batch=bs, samples=step * bs, ranks=a.lcm_ranks,
                final_loss=dict(zip(["huber", "gradnorm"], np.mean(hist[-100:], 0).round(6).tolist())) if hist else None)
    budget.end("lcm")
    return student, target, info


# --------------------------------------------------------------------------------------------------
# export


def write_sampling_defaults(unet_dir, guidance, steps, strength):
    """The settings `brume generate` and `brume edit` use for this UNet when the command line gives
    none (unet/sampling_defaults.json; diffusers ignores the file)."""
    (unet_dir / "sampling_defaults.json").write_text(json.dumps(
        {"guidance_scale": guidance, "num_inference_steps": steps, "strength": strength}, indent=2) + "\n")


def write_pipeline(dst, te, tok, unet, vae, a, unet_lcm=None):
    """fp16 diffusers folder at dst (must not exist): SD1 pipeline with DDIM, the CLIP tokenizer copied
    from the SD1.5 fixture, and optionally unet_lcm/ + scheduler_lcm/; from the arguments `a`, each
    UNet's sampling_defaults.json (--default-guidance / --ddim-steps / --default-strength, --lcm-guidance / 4 steps
    / --lcm-strength)."""
    pipe = make_pipe(copy.deepcopy(te).half().cpu(), tok, copy.deepcopy(unet).half().cpu(),
                     copy.deepcopy(vae).half().cpu(), ddim_scheduler())
    pipe.save_pretrained(dst, safe_serialization=True)
    shutil.rmtree(dst / "tokenizer")
    shutil.copytree(TOKENIZER_SRC, dst / "tokenizer")
    write_sampling_defaults(dst / "unet", a.default_guidance, a.ddim_steps, a.default_strength)
    if unet_lcm is not None:
        copy.deepcopy(unet_lcm).half().cpu().save_pretrained(dst / "unet_lcm", safe_serialization=True)
        lcm_scheduler().save_pretrained(dst / "scheduler_lcm")
        write_sampling_defaults(dst / "unet_lcm", a.lcm_guidance, 4, a.lcm_strength)
    for p in dst.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)  # save_pretrained leaves 0600 weight files


def weights_mb(d):
    return sum(p.stat().st_size for p in d.rglob("*.safetensors")) / 1e6


def atomic_replace(tmp, dst):
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.rename(dst, old)
    os.rename(tmp, dst)
    if old is not None:
        shutil.rmtree(old)


def verify(dst, D, a, lcm):
    """Load the written folder with diffusers (as a user would) and generate."""
    from diffusers import LCMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    res = {}
    pipe = StableDiffusionPipeline.from_pretrained(dst, dtype=torch.float32, safety_checker=None,
                                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    prompt = D["heldout"][0]["caption"]
    img = pipe(prompt, num_inference_steps=a.ddim_steps, guidance_scale=a.guidance,
               generator=torch.Generator().manual_seed(0), height=a.size, width=a.size).images[0]
    arr = np.asarray(img)
    assert arr.shape == (a.size, a.size, 3) and np.isfinite(arr).all()
    img.save(Path(a.out) / "samples" / "verify_ddim.png")
    res["ddim"] = dict(prompt=prompt, pixel_std=float(arr.std()))
    if lcm:
        unet = UNet2DConditionModel.from_pretrained(dst, subfolder="unet_lcm", dtype=torch.float32)
        sched = LCMScheduler.from_pretrained(dst, subfolder="scheduler_lcm")
        lpipe = StableDiffusionPipeline.from_pretrained(dst, unet=unet, scheduler=sched, dtype=torch.float32,
                                                        safety_checker=None, requires_safety_checker=False)
        lpipe.set_progress_bar_config(disable=True)
        img = lpipe(prompt, num_inference_steps=4, guidance_scale=a.lcm_guidance,
                    generator=torch.Generator().manual_seed(0), height=a.size, width=a.size).images[0]
        arr = np.asarray(img)
        assert arr.shape == (a.size, a.size, 3) and np.isfinite(arr).all()
        img.save(Path(a.out) / "samples" / "verify_lcm.png")
        res["lcm"] = dict(prompt=prompt, pixel_std=float(arr.std()))
    log(f"verified {dst}: StableDiffusionPipeline.from_pretrained loads it and generates "
        f"{'(DDIM and LCM)' if lcm else '(DDIM)'}")
    return res


# --------------------------------------------------------------------------------------------------


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="run directory: model/, stage2/, samples/, work/ go here")
    p.add_argument("--data", default="/tmp/builtin-train/data", help="dataset cache (reused across runs)")
    p.add_argument("--budget-minutes", type=float, default=55.0, help="total wall-clock budget, all stages")
    p.add_argument("--shares", default=DEFAULT_SHARES, help="relative stage time shares")
    p.add_argument("--world-bin", default=None, help="brume-world binary (built with cargo if not given)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stop-after", choices=["data", "vae", "unet"],
                   help="end after this stage, saving what it trained (data: the rendered cache; unet: OUT/stage2/)")
    p.add_argument("--device", default="cpu",
                   help="torch device for the training stages (cuda: a GPU; up to --stop-after unet, one rank)")
    p.add_argument("--vae-from", default=None, help="a trained diffusers AutoencoderKL folder instead of the vae stage")
    p.add_argument("--unet-from", default=None,
                   help="an earlier run directory or a diffusers model folder whose text encoder and UNet replace the text and "
                        "unet stages (LCM experiments)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true",
                   help="bf16 autocast for the VAE and UNet training passes (LCM distillation stays fp32: its Huber c is 1e-3)")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--count", type=int, default=24000, help="training images")
    p.add_argument("--data-seed", type=int, default=0, help="dataset stream seed (shard i uses data_seed+i)")
    p.add_argument("--data-shards", type=int, default=2, help="parallel brume-world processes")
    p.add_argument("--omit-size", type=float, default=0.2,
                   help="probability that a caption leaves an object's size out (the picture still has one; "
                        "pictures do not depend on it, so a cached --data directory stays valid)")
    p.add_argument("--omit-position", type=float, default=0.25,
                   help="probability that a one-object caption leaves the position out")
    p.add_argument("--heldout", type=int, default=200, help="held-out prompts rendered for evaluation")
    p.add_argument("--psnr-images", type=int, default=100)
    p.add_argument("--judge-images", type=int, default=32)
    p.add_argument("--log-every", type=float, default=30.0, help="seconds between log lines")
    p.add_argument("--min-encoded", type=int, default=6000, help="encode at least this many images even past the encode deadline")
    p.add_argument("--vae-reserve", type=float, default=20.0, help="seconds kept at the end of the vae share for its evaluation")
    p.add_argument("--unet-reserve", type=float, default=75.0, help="seconds kept at the end of the unet share for sampling, judging and the stage2/ checkpoint")
    p.add_argument("--lcm-reserve", type=float, default=45.0, help="seconds kept at the end of the lcm share for its evaluations")
    # VAE
    p.add_argument("--vae-channels", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64, 64])
    p.add_argument("--vae-groups", type=int, default=4)
    p.add_argument("--vae-lr", type=float, default=1e-3)
    p.add_argument("--vae-batch", type=int, default=16)
    p.add_argument("--vae-crop", type=int, default=64)
    p.add_argument("--vae-kl", type=float, default=1e-6, help="KL weight per latent element (vs per-pixel L1+L2)")
    p.add_argument("--vae-logvar-init", type=float, default=-6.0)
    p.add_argument("--vae-edge", type=float, default=0.5, help="weight of the L1 loss on image gradients (edges)")
    p.add_argument("--vae-full-frac", type=float, default=0.25, help="last fraction of the vae stage trained on whole images")
    p.add_argument("--vae-steps", type=int, default=0, help="fixed step count instead of the time share")
    p.add_argument("--vae-hard-weight", type=float, default=0.0,
                   help="weight of the mean squared error of the worst --vae-hard-frac of 8x8 patches, added in the "
                        "whole-image phase (0: off, runs <= 10; see tools/train/tune_decoder.py)")
    p.add_argument("--vae-hard-frac", type=float, default=0.05)
    p.add_argument("--vae-small-weight", type=float, default=0.0,
                   help="extra weight of the VAE's L1/L2 loss on small objects' pixels (from the scene geometry)")
    # text encoder + UNet
    p.add_argument("--text-hidden", type=int, default=64)
    p.add_argument("--text-layers", type=int, default=3)
    p.add_argument("--text-heads", type=int, default=4)
    p.add_argument("--text-lr", type=float, default=2e-3, help="text encoder pre-training learning rate")
    p.add_argument("--text-batch", type=int, default=128)
    p.add_argument("--text-steps", type=int, default=0)
    p.add_argument("--text-noun-weight", type=float, default=0.0,
                   help="weight of the per-object heads on each shape-word token (0: end-of-text heads only, runs <= 9)")
    p.add_argument("--text-lr-mult", type=float, default=0.0,
                   help="text encoder learning rate during the UNet stage, relative to --unet-lr (0: frozen, outputs cached)")
    p.add_argument("--unet-channels", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64, 128])
    p.add_argument("--unet-layers", type=int, default=1)
    p.add_argument("--unet-heads", type=int, default=4,
                   help="attention heads per transformer (run 7 used 1: head dim = channels; 4 heads of dim 8-32 spend 40 %% of a CPU step in attention)")
    p.add_argument("--unet-groups", type=int, default=8)
    p.add_argument("--attention", choices=["sdpa", "math", "math32"], default="sdpa",
                   help="UNet attention in training: PyTorch's fused SDPA or plain matmul+softmax (math: 1.36x faster "
                        "steps on 2 cores, run 9; math32: the same with scores and softmax in fp32 under --bf16)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the UNet's training forward (run 9: 1.4x on top of --attention math, ~70 s to compile)")
    p.add_argument("--unet-lr", type=float, default=5e-4)
    p.add_argument("--unet-batch", type=int, default=32)
    p.add_argument("--ranks", type=int, default=1,
                   help="data-parallel processes of one thread each for the UNet stage (needs a frozen text encoder, "
                        "--text-lr-mult 0, and a batch they divide); 1: one process of --threads threads, runs <= 10")
    p.add_argument("--unet-steps", type=int, default=0)
    p.add_argument("--cfg-dropout", type=float, default=0.1)
    p.add_argument("--unet-small-weight", type=float, default=0.0,
                   help="extra UNet loss weight on the latent cells of small objects (from the scene geometry)")
    p.add_argument("--offset-noise", type=float, default=0.2,
                   help="per-channel constant noise added in UNet and LCM training (0: plain noise); see training_noise")
    p.add_argument("--min-snr", type=float, default=0.0,
                   help="min-SNR-gamma loss weighting (0: plain epsilon MSE, as SD was trained; gamma 5 left run 2's backgrounds mottled)")
    p.add_argument("--ema", type=float, default=0.998)
    p.add_argument("--ddim-steps", type=int, default=25)
    p.add_argument("--guidance", type=float, default=5.0, help="guidance_scale of the script's own DDIM evaluation")
    p.add_argument("--default-guidance", type=float, default=3.5,
                   help="guidance_scale written to unet/sampling_defaults.json, what brume generate uses by default "
                        "(3.5: chosen for run 13 on held-out prompts 200-599, see README.md, 'Default guidance')")
    p.add_argument("--default-strength", type=float, default=0.6,
                   help="img2img strength written to unet/sampling_defaults.json (brume edit's default)")
    # LCM
    p.add_argument("--lcm-strength", type=float, default=0.75,
                   help="img2img strength written to unet_lcm/sampling_defaults.json: 3 of 4 steps, from timestep 759; "
                        "0.6 runs 2 from 499 and recolours a third fewer objects (README.md, 'Edits')")
    p.add_argument("--lcm-cond-dim", type=int, default=32)
    p.add_argument("--lcm-lr", type=float, default=2e-4)
    p.add_argument("--lcm-batch", type=int, default=32)
    p.add_argument("--lcm-ranks", type=int, default=1,
                   help="data-parallel processes of one thread for LCM distillation (as --ranks for the UNet)")
    p.add_argument("--lcm-steps", type=int, default=0)
    p.add_argument("--lcm-ddim-steps", type=int, default=50)
    p.add_argument("--lcm-w-min", type=float, default=1.5,
                   help="w = guidance_scale - 1; [1.5, 3.5] around the default guidance 3.5 is what ships (run 13's "
                        "first distillation used [2, 8] and did not respond to its embedded scale: README.md, 'LCM at the new scale')")
    p.add_argument("--lcm-w-max", type=float, default=3.5)
    p.add_argument("--lcm-ema", type=float, default=0.95)
    p.add_argument("--huber-c", type=float, default=0.001)
    p.add_argument("--lcm-guidance", type=float, default=3.5,
                   help="guidance_scale used to evaluate the LCM UNet and written to unet_lcm/sampling_defaults.json")
    a = p.parse_args()
    if a.ranks < 1:
        p.error("--ranks must be at least 1")
    if a.device != "cpu" and (a.ranks > 1 or a.stop_after not in ("data", "vae", "unet")):
        p.error(f"--device {a.device} covers the stages up to the UNet's with one rank: it needs --ranks 1 and --stop-after unet")
    if a.ranks > 1 and a.text_lr_mult != 0:
        p.error("--ranks > 1 shares the frozen text encoder's cached outputs: it needs --text-lr-mult 0")
    if a.unet_batch % a.ranks:
        p.error(f"--unet-batch {a.unet_batch} does not split evenly over --ranks {a.ranks}")
    if a.lcm_ranks < 1 or a.lcm_batch % a.lcm_ranks:
        p.error(f"--lcm-batch {a.lcm_batch} does not split evenly over --lcm-ranks {a.lcm_ranks}")
    return a


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    out = Path(a.out)
    work = out / "work"
    for d in (out, work, out / "samples"):
        d.mkdir(parents=True, exist_ok=True)
    budget = Budget(a.budget_minutes, a.shares)
    import diffusers
    import transformers

    versions = dict(python=sys.version.split()[0], torch=torch.__version__, diffusers=diffusers.__version__,
                    transformers=transformers.__version__, numpy=np.__version__)
    log(f"train_builtin: out {out}, budget {a.budget_minutes} min, shares {a.shares}, threads {a.threads}, {versions}")
    info = dict(args=vars(a), versions=versions)

    D = stage_data(a, budget)
    if a.stop_after == "data":
        log(f"done: {a.data} (--stop-after data)")
        return
    D["size"] = a.size
    vae, info["vae"] = stage_vae(a, budget, D, work)
    if a.stop_after == "vae":
        tmp = out / f".vae.tmp-{os.getpid()}"
        vae.save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps({**info, "stage": "vae", "timing_s": budget.timing}, indent=1))
        atomic_replace(tmp, out / "vae")
        log(f"done: {out / 'vae'} (--stop-after vae)")
        return
    lat_mean, lat_std, sf = stage_encode(a, budget, D, vae, work)
    info["scaling_factor"] = sf
    if a.unet_from:
        te, unet, info["unet"] = unet_from(a, budget)
        student, target, info["lcm"] = stage_lcm(a, budget, D, te, unet, lat_mean, lat_std, sf, work)
        return finish(a, budget, D, out, work, info, te, unet, vae, student, target)
    te, info["text"] = stage_text(a, budget, D)
    te, unet, info["unet"] = stage_unet(a, budget, D, lat_mean, lat_std, sf, work, te)

    # stage-2 evaluation and checkpoint (inside the unet share's reserve)
    t = time.time()
    pipe = make_pipe(te, D["tokenizer"], unet, vae, ddim_scheduler())
    info["unet"]["eval"], im = evaluate(pipe, D, work, "ddim", a.ddim_steps, a.guidance, a)
    grid(im[:32], out / "samples" / "stage2_ddim.png")
    tmp = out / f".stage2.tmp-{os.getpid()}"
    write_pipeline(tmp, te, D["tokenizer"], unet, vae, a)
    (tmp / "training.json").write_text(json.dumps({**info, "stage": "unet", "timing_s": budget.timing}, indent=1))
    atomic_replace(tmp, out / "stage2")
    log(f"checkpoint: {out / 'stage2'} ({weights_mb(out / 'stage2'):.1f} MB of weights) in {time.time() - t:.1f}s")
    if a.stop_after == "unet":
        log(f"done: {out / 'stage2'} (--stop-after unet); stage times {budget.timing}")
        return

    student, target, info["lcm"] = stage_lcm(a, budget, D, te, unet, lat_mean, lat_std, sf, work)
    finish(a, budget, D, out, work, info, te, unet, vae, student, target)


def finish(a, budget, D, out, work, info, te, unet, vae, student, target):
    """Evaluates the LCM student and target, keeps the better, and writes, verifies and publishes the model."""
    evals = {}
    for name, m in (("student", student), ("target", target)):
        lp = make_pipe(te, D["tokenizer"], m, vae, lcm_scheduler())
        for steps in (4, 1):
            r, im = evaluate(lp, D, work, f"lcm_{name}_{steps}", steps, a.lcm_guidance, a)
            evals[f"{name}_{steps}"] = r
            if steps == 4:
                grid(im[:32], out / "samples" / f"lcm_{name}_4step.png")
    pick = "target" if evals["target_4"]["score"] >= evals["student_4"]["score"] else "student"
    unet_lcm = target if pick == "target" else student
    info["lcm"]["eval"], info["lcm"]["exported"] = evals, pick
    log(f"lcm: exporting the {pick} UNet")

    budget.begin("export")
    tmp = out / f".model.tmp-{os.getpid()}"
    write_pipeline(tmp, te, D["tokenizer"], unet, vae, a, unet_lcm=unet_lcm)
    info["verify"] = verify(tmp, D, a, lcm=True)
    info["weights_mb"] = round(weights_mb(tmp), 2)
    info["component_mb"] = {d.name: round(weights_mb(d), 2) for d in sorted(tmp.iterdir()) if d.is_dir()}
    budget.end("export")
    info["timing_s"] = budget.timing
    info["total_s"] = round(time.time() - T0, 1)
    (tmp / "training.json").write_text(json.dumps(info, indent=1))
    atomic_replace(tmp, out / "model")
    log(f"done: {out / 'model'} ({info['weights_mb']:.1f} MB of fp16 weights: {info['component_mb']}); "
        f"total {info['total_s']:.0f}s of {budget.total:.0f}s budget; stage times {budget.timing}")


if __name__ == "__main__":
    main()
