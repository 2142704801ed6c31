#!/usr/bin/env bash
# What bench/gpu_all.sh carries to the device, prepared HERE (where git and pip work; the device
# reaches no registry and gets the working tree without .git):
#
#   bash bench/gpu_prepare.sh                  # .anchor/ from HEAD, .whl/ for the device's Python 3.12
#   ANCHOR_REF=e6d36d1 bash bench/gpu_prepare.sh
#
# .anchor/  the build before, as `git archive ANCHOR_REF` (engine, gateway, web, bench, tests/support):
#           gpu_all.sh runs it beside this build. Its commit is in .anchor/REF.
# .whl/     the wheels the device image lacks for the gateway and the load tool: PyAV (most of
#           the ~36 MB), starlette, uvicorn, websockets (msgpack, h11, anyio, click are there);
#           gpu_all.sh installs them with `pip install --no-index --target`.
# Both are ignored by git; the device call names them in `carry`:
#   run(command="bash bench/gpu_all.sh", carry=[".whl", ".anchor"], timeout_s=600)
set -eu
cd "$(git rev-parse --show-toplevel)"
ANCHOR_REF=${ANCHOR_REF:-HEAD}
WHEELS=${WHEELS:-"av==19.0.2 starlette==1.10.0 uvicorn==0.55.0 websockets==17.4"}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}  # the device's python3 (gpu.txt of an earlier run says 3.12.3)

ref=$(git rev-parse --verify "$ANCHOR_REF^{commit}")
rm -rf .anchor
mkdir .anchor
git archive "$ref" engine gateway web bench tests/__init__.py tests/support pyproject.toml | tar -x -C .anchor
echo "$ref" >.anchor/REF
echo "anchor: $ref ($(du -sh .anchor | cut -f1)) in .anchor/"

mkdir -p .whl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl $WHEELS
echo "wheels ($(du -sh .whl | cut -f1)) in .whl/:"
ls .whl
