#!/bin/sh
# Installs the peers of `brume bench speed` and `brume bench kernels` (PyTorch + diffusers,
# ONNX Runtime, OpenVINO, stable-diffusion.cpp, all pinned) into a virtual environment, and prints
# the --python to pass. stable-diffusion.cpp is built for this CPU, with the C/C++ compiler here.
# Usage: tools/bench/setup.sh [VENV]   (default: .venv-bench in the source tree)
set -eu
here=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:-$here/.venv-bench}
python3 -m venv "$venv"
"$venv/bin/pip" install -q -r "$here/tools/requirements.txt" -r "$here/tools/bench/requirements.txt"
"$venv/bin/pip" install -q -r "$here/tools/bench/requirements-sdcpp.txt" ||
    echo "stable-diffusion.cpp did not build (see above); bench speed will list sdcpp-* as skipped" >&2
echo "peers installed; run: brume bench speed --python $venv/bin/python"
