#!/usr/bin/env bash
# Wheels for a GPU machine that has Python 3.12, PyTorch with CUDA 13 and transformers' usual dependencies but not
# trahiv's others, and no package index (the lent GPU machines of trahiv's development: see README, "GPU checks").
# Writes .gpu/whl (git-ignored through .git/info/exclude); scripts/gpu_check.sh installs them there.
# bitsandbytes' wheel is cut to its CPU and CUDA 13.0 libraries (43 MB -> 4 MB): transfers to the machine are limited.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
mkdir -p .gpu/whl
platforms=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
# trahiv's dependencies (pinned as in pyproject.toml) that such a machine lacks, with theirs (the CLI needs the web ones)
packages=(hivemind==1.1.12 transformers==5.23.0 peft==0.21.2 bitsandbytes==0.50.2 huggingface-hub==2.4.0
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 base58==2.1.1
  blake3==1.0.11 cffi==2.1.1 pycparser==3.12 configargparse==1.9.0 cryptography==50.0.2 grpcio-tools==1.85.1
  httpcore2==2.16.2 httpx2==2.16.2 mmh3==5.3.1 morphys==1.0 netaddr==1.3.0 prefetch-generator==1.0.3 py-cid==0.5.0
  py-multibase==2.0.0 py-multicodec==1.0.0 py-multihash==3.0.0 python-baseconv==1.2.2 truststore==0.10.5
  varint==1.0.2 fastapi==0.163.2 starlette==1.10.0 uvicorn==0.54.0 sqlalchemy==2.1.9 opentelemetry-api==1.45.2)
for package in "${packages[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .gpu/whl "$package" > /dev/null 2>&1 \
    || python3 -m pip wheel -q --no-deps -w .gpu/whl "$package" > /dev/null  # pure-Python sdists
done
bnb=$(ls .gpu/whl/bitsandbytes-*.whl)
tmp=$(mktemp -d)
(cd "$tmp" && unzip -q "$OLDPWD/$bnb" && find bitsandbytes -name 'libbitsandbytes_*.so' \
  ! -name '*_cpu.so' ! -name '*_cuda130.so' -delete \
  && grep -v -E 'libbitsandbytes_.*\.so' bitsandbytes-*.dist-info/RECORD > RECORD.new \
  && grep -E 'libbitsandbytes_(cpu|cuda130)\.so' bitsandbytes-*.dist-info/RECORD >> RECORD.new \
  && mv RECORD.new bitsandbytes-*.dist-info/RECORD && rm "$OLDPWD/$bnb" && zip -q -r "$OLDPWD/$bnb" .)
rm -rf "$tmp"
du -sh .gpu/whl
