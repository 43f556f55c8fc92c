#!/bin/bash
# GPU experiment (2026-12-04, tools/train/README.md "Width or samples"): three UNet-stage variants of the built-in model trained side by side on one GPU, same data and VAE.
#
# Runs on a lent GPU machine from the repository root, with .gpu/ (ignored; carried) holding: whl/ (diffusers 0.42.1 and
# importlib_metadata 8.7.0 wheels, which that machine lacks), brume-world (built here: cargo build --release -p brume-world),
# vae/ (a trained AutoencoderKL folder: run 10's). $OUT is the folder whose files come back.
set -u
T=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, diffusers, transformers; print(torch.__version__, diffusers.__version__, transformers.__version__, torch.cuda.is_available())"
W=$PWD/.gpu/brume-world; chmod +x $W
python3 tools/train/train_builtin.py --out /tmp/prep --data /tmp/data --count 30000 --world-bin $W --threads 16 \
  --stop-after data --omit-size 0 --omit-position 0 > $OUT/prep.log 2>&1 || { tail -20 $OUT/prep.log; exit 1; }
echo "prep done at $(( $(date +%s) - T ))s"
C="--data /tmp/data --count 30000 --world-bin $W --threads 3 --device cuda --stop-after unet --vae-from .gpu/vae
   --min-encoded 30000 --bf16 --attention math32 --unet-heads 1 --omit-size 0 --omit-position 0 --text-steps 600
   --text-noun-weight 1 --unet-lr 1e-3 --min-snr 0 --offset-noise 0.2 --judge-images 200 --log-every 20
   --budget-minutes 6.8 --shares data=35,vae=10,encode=20,text=35,unet=308 --unet-reserve 50"
run() { name=$1; shift; timeout 470 python3 tools/train/train_builtin.py --out /tmp/exp/$name $C "$@" > $OUT/$name.log 2>&1; echo "$name rc $? at $(( $(date +%s) - T ))s"; }
run big --unet-batch 512 &
run wide --unet-batch 512 --unet-channels 48,96,192 &
run b128 --unet-batch 128 &
sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
wait
for n in big b128; do tar -C /tmp/exp/$n -cf $OUT/$n.tar --exclude=tokenizer stage2 samples; done
tar -C /tmp/exp/wide -cf $OUT/wide_rest.tar --exclude=tokenizer --exclude='*.safetensors' stage2 samples
tar -C /tmp/exp/wide -rf $OUT/wide_rest.tar stage2/text_encoder stage2/vae
cp /tmp/exp/wide/stage2/unet/diffusion_pytorch_model.safetensors $OUT/wide_unet.safetensors
ls -la $OUT; grep -h "eval ddim\|unet: .* steps x\|text: .* steps" $OUT/*.log
echo "all done at $(( $(date +%s) - T ))s"
