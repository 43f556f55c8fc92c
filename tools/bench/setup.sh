#!/bin/sh
# Installs the peers of `brume bench speed` and `brume bench kernels` (PyTorch + diffusers,
# ONNX Runtime, OpenVINO, all pinned) into a virtual environment, and prints the --python to pass.
# Usage: tools/bench/setup.sh [VENV]   (default: .venv-bench in the source tree)
set -eu
here=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:-$here/.venv-bench}
python3 -m venv "$venv"
"$venv/bin/pip" install -q -r "$here/tools/requirements.txt" -r "$here/tools/bench/requirements.txt"
echo "peers installed; run: brume bench speed --python $venv/bin/python"
