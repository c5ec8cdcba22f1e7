#!/usr/bin/env bash
# Make .venv with trahiv and its pinned dependencies, from nothing. Re-running is a no-op unless the pins changed.
set -euo pipefail
cd "$(dirname "$0")/.."
# headless Chromium for the dashboard's browser test (tests/test_dashboard.py skips it where chromium is missing)
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
  else
    echo "setup: chromium is missing and we are not root (or have no apt-get): the dashboard's browser test will be" \
      "skipped; install Debian's chromium package to run it" >&2
  fi
fi
# nftables for the NAT tests (tests/test_nat.py: routers in network namespaces; root only, skipped otherwise)
if ! command -v nft >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nftables iproute2; } \
    || echo "setup: could not install nftables: tests/test_nat.py will be skipped" >&2
fi
stamp=.venv/.trahiv-setup
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"${PYTHON:-python3}" -m venv .venv
# uv installs (it downloads, unpacks and compiles in parallel: the whole set-up took 72 s against pip's 175 s, the
# same packages and versions); pip where uv cannot be installed or fails
uv=""
if .venv/bin/pip install --quiet --disable-pip-version-check uv==0.13.9; then
  uv=.venv/bin/uv
fi
# torch first and pinned: 2.13.0 is a CPU build on local disk (the folders in PIP_FIND_LINKS); an unpinned torch would
# pull a multi-GB CUDA build. Through uv where those folders are named (12 s against pip's 27 s), else pip
links=()
for link in ${PIP_FIND_LINKS:-}; do
  links+=(--find-links "$link")
done
if [ -z "$uv" ] || [ "${#links[@]}" -eq 0 ] \
  || ! "$uv" pip install --quiet --compile-bytecode --python .venv/bin/python "${links[@]}" torch==2.13.0; then
  .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
fi
# the rest through uv, pinned. --compile-bytecode, as pip does: without .pyc files every process compiled what it
# imported (PYTHONDONTWRITEBYTECODE is set here), 1.7 s more per `import trahiv.swarm`, and pytest took 1,328 s
# instead of 1,058-1,101
if [ -n "$uv" ] && "$uv" pip install --quiet --compile-bytecode --python .venv/bin/python -c constraints.txt -e ".[dev,trl]"; then
  :
else
  echo "setup: uv failed (above); installing with pip" >&2
  .venv/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev,trl]"
fi
echo "$want" > "$stamp"
