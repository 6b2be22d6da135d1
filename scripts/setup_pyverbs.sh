#!/usr/bin/env bash
# Expose only Debian's pyverbs package (python3-pyverbs) to the venv, through a .pth file pointing at a folder
# that holds nothing but a link to it. Absent pyverbs is fine: RDMA tests then skip with the reason.
set -euo pipefail
python="$1"
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv_dir=$(dirname "$(dirname "$python")")
pkg=""
if command -v dpkg >/dev/null 2>&1 && dpkg -s python3-pyverbs >/dev/null 2>&1; then
  pkg=$(dpkg -L python3-pyverbs | grep -m1 '/pyverbs/__init__.py$' | xargs -r dirname || true)
fi
if [ -z "$pkg" ]; then
  echo "setup_pyverbs: python3-pyverbs not installed; RDMA transport unavailable (tests skip)"
  rm -f "$site/mooncaked-pyverbs.pth"
  exit 0
fi
only="$venv_dir/pyverbs-only"
mkdir -p "$only"
ln -sfn "$pkg" "$only/pyverbs"
echo "$(cd "$only" && pwd)" > "$site/mooncaked-pyverbs.pth"
echo "setup_pyverbs: linked $pkg"
