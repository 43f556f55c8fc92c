#!/usr/bin/env bash
# Runs brume's tests built for aarch64 Linux under qemu user emulation, on an x86-64
# Debian host: the NEON kernels (kernels/simd/neon.rs) and the fused attention that
# aarch64 runs are checked for their values here. Emulation says nothing of speed.
#
#   tools/aarch64/test.sh                 # the kernel tests (~10 minutes on 2 cores, build included)
#   tools/aarch64/test.sh -p brume        # any `cargo test` arguments instead
#
# Installs, once: qemu-user, the aarch64 cross linker and libc (apt), and the Rust
# target (rustup). BRUME_AARCH64_NO_INSTALL=1 skips that step.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ "${BRUME_AARCH64_NO_INSTALL:-0}" != 1 ]; then
    if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
        sudo=""
        [ "$(id -u)" = 0 ] || sudo=sudo
        $sudo apt-get install -y -q qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross
    fi
    rustup target add aarch64-unknown-linux-gnu
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"

if [ $# -eq 0 ]; then
    set -- -p brume --test kernels_attention --test kernels_conv --test kernels_geglu \
        --test kernels_group_norm --test kernels_switch --lib
fi
exec cargo test --release --target aarch64-unknown-linux-gnu "$@"
