#!/bin/sh
# Seeds each target's corpus from the repository and runs every fuzz target for
# SECONDS (default 600) one after another, at the lowest priority. Needs
# cargo-fuzz (`cargo install cargo-fuzz`) and a nightly toolchain.
#   fuzz/run.sh [SECONDS] [TARGET...]
set -eu
cd "$(dirname "$0")"
secs=${1:-600}
[ $# -gt 0 ] && shift
targets=${*:-"safetensors_header configs png_metadata recipe mask"}
root=..
mkdir -p corpus/safetensors_header corpus/configs corpus/png_metadata corpus/recipe corpus/mask
# safetensors: the built-in model's headers (first 64 KiB of each file).
for f in $root/models/builtin/*/*.safetensors; do
  head -c 65536 "$f" > "corpus/safetensors_header/$(echo "${f#../}" | tr / _)"
done
# configs: every JSON config of the built-in model (first byte: the step count).
for f in $root/models/builtin/*/*.json; do
  { printf '\004'; cat "$f"; } > "corpus/configs/$(echo "${f#../}" | tr / _)"
done
# PNG metadata and masks: pictures in the repository (brume's own carry recipes).
for f in $(find $root/models/builtin/samples $root/fixtures -name '*.png' -size -200k 2>/dev/null | head -20); do
  cp "$f" "corpus/png_metadata/$(echo "${f#../}" | tr / _)"
  cp "$f" "corpus/mask/$(echo "${f#../}" | tr / _)"
done
# Recipes: the JSON chunk of brume's pictures (BRUME=path/to/brume writes one).
if [ -x "${BRUME:-}" ]; then
  [ -f corpus/png_metadata/brume.png ] || "$BRUME" generate "a small red circle above a large blue square" --steps 1 --out corpus/png_metadata/brume.png
  cp corpus/png_metadata/brume.png corpus/mask/brume.png
  for f in corpus/png_metadata/*; do
    "$BRUME" info --json "$f" > "corpus/recipe/$(basename "$f").json" 2>/dev/null || rm -f "corpus/recipe/$(basename "$f").json"
  done
fi
printf '{"brume_version":"0.1.0","mode":"txt2img","prompt":"a","negative_prompt":null,"steps":4,"sampler":"ddim","guidance_scale":3.5,"seed":0,"rng":"brume","width":128,"height":128,"batch":1,"eta":0.0,"clip_skip":0,"model_name":"builtin","model_path":"x","model_hash":"0","strength":null,"image":null,"mask":null,"extend":null,"feather":null}' > corpus/recipe/minimal.json
# Build once, then run the binaries directly (no rebuild between targets).
nice -n 19 cargo +nightly fuzz build -s none -O
bin=${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/release
mkdir -p artifacts
for t in $targets; do
  echo "== $t for ${secs}s"
  mkdir -p "artifacts/$t"
  nice -n 19 "$bin/$t" "corpus/$t" -artifact_prefix="artifacts/$t/" \
    -max_total_time="$secs" -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 2>&1 | tail -n 25
done
