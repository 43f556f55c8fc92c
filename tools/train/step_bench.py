"""Times the built-in model's UNet training step under the training script's options.

Same UNet as `train_builtin.py --unet-heads 1` (channels 32/64/128, cross-attention 64), batch 64, bf16
autocast, fused AdamW, grad clipping; random latents and text states (the step's cost does not depend
on the data). Prints the median of 25 steps after 3 warm-up steps (compilation, with --compile).
Run the variants alternately on an otherwise idle machine and compare medians:

    for v in sdpa math "math --compile" "math32 --compile"; do /work/pyenv/bin/python tools/train/step_bench.py --attention $v; done
"""

import argparse
import time

import torch
from diffusers import UNet2DConditionModel
from train_builtin import use_attention


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--attention", choices=["sdpa", "math", "math32"], default="sdpa")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=25)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4,
        down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
        mid_block_type="UNetMidBlock2DCrossAttn", block_out_channels=[32, 64, 128], layers_per_block=1,
        attention_head_dim=1, cross_attention_dim=64, norm_num_groups=8)
    use_attention(unet, a)  # the training script's own choice, so this times what it trains with
    fwd = torch.compile(unet) if a.compile else unet
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4, fused=True)
    bs = a.batch

    def step():
        z = torch.randn(bs, 4, 16, 16)
        h = torch.randn(bs, 77, 64)
        t = torch.randint(0, 1000, (bs,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = fwd(z, t, h).sample.float()
        loss = (pred - z).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        opt.step()
        return loss.item()

    t0 = time.time()
    for _ in range(3):
        step()
    warm = time.time() - t0
    times = []
    for _ in range(a.steps):
        t0 = time.time()
        step()
        times.append(time.time() - t0)
    med = sorted(times)[len(times) // 2]
    print(f"attention {a.attention}{' + compile' if a.compile else ''}, batch {bs}: warm-up {warm:.1f}s, "
          f"median step {med:.3f}s, {bs / med:.1f} samples/s")


if __name__ == "__main__":
    main()
