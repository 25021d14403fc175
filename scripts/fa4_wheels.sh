#!/usr/bin/env bash
# flash-attn-4 (the optional Hopper attention kernels of tree attention's varlen backend) for the GPU
# machine, which has no network.  Its CuTe DSL compiler library is a 92 MB wheel, over one device
# call's 64 MiB, so it travels xz-packed in two halves over two calls of a warm machine:
#
#   bash scripts/fa4_wheels.sh pack          # here: download the cp312 wheels, fill .fa4a/ and .fa4b/
#   # device call 1 (carry .fa4a):            bash scripts/fa4_wheels.sh stash
#   # device call 2 (carry .fa4b .whl), within the machine's warm time after call 1:
#   #                                          bash scripts/fa4_wheels.sh install
#   #                                          export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
#
# The second PYTHONPATH entry stands for the .pth file of nvidia-cutlass-dsl, which a --target
# install does not run.  Add /.fa4a/ and /.fa4b/ to .git/info/exclude once.  `install` also installs .whl/*.whl
# (megatron-core, fla-core) into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
FA4=4.0.0b36          # = megatron_harts.ops.key_paths.FA4_VERSION
CUTLASS=4.8.1
PARTS=/tmp/fa4parts
case "${1:-}" in
  pack)
    tmp=$(mktemp -d)
    plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    python3 -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${plat[@]}" -d "$tmp" "flash-attn-4==$FA4" "nvidia-cutlass-dsl==$CUTLASS" \
      "nvidia-cutlass-dsl-libs-base==$CUTLASS" "nvidia-cutlass-dsl-libs-core==$CUTLASS" \
      "nvidia-cutlass-dsl-libs-cu13==$CUTLASS" "apache-tvm-ffi<0.2" torch-c-dlpack-ext quack-kernels
    mkdir -p "$tmp/cu13" .fa4a .fa4b
    rm -f .fa4a/* .fa4b/*
    (cd "$tmp/cu13" && unzip -q ../nvidia_cutlass_dsl_libs_cu13-*.whl && tar cf - . | xz -9 -T0 > ../cu13.tar.xz)
    split -b 31M -d "$tmp/cu13.tar.xz" "$tmp/cu13.part"
    mv "$tmp/cu13.part00" .fa4a/
    mv "$tmp/cu13.part01" .fa4b/
    find "$tmp" -maxdepth 1 -name '*.whl' ! -name 'nvidia_cutlass_dsl_libs_cu13-*' -exec mv {} .fa4b/ \;
    rm -rf "$tmp"
    du -sh .fa4a .fa4b ;;
  stash)
    mkdir -p "$PARTS"
    cp .fa4a/cu13.part* "$PARTS"/
    ls -la "$PARTS" ;;
  install)
    [[ -f "$PARTS/cu13.part00" ]] || { echo "fa4_wheels.sh install: $PARTS/cu13.part00 is missing (run stash in the call before)" >&2; exit 2; }
    mkdir -p /tmp/site
    # the wheels first: pip --upgrade --target replaces whole package folders, the cu13 libraries go into one
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .fa4b/*.whl .whl/*.whl
    cat "$PARTS"/cu13.part00 .fa4b/cu13.part* | xz -dc | tar xf - -C /tmp/site
    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python3 -c "import flash_attn.cute, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))" ;;
  *) echo "usage: $0 {pack|stash|install}" >&2; exit 2 ;;
esac
