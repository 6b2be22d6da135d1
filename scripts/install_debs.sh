#!/usr/bin/env bash
# Debian packages for tests and benchmarks: redis-server (store benchmark), etcd-server (membership tests),
# python3-pyverbs (RDMA transport), prometheus (the dashboard test), gcc (the CPU MoE kernel, kernels/cpu_moe.c). Installed only when missing and when we may (root with apt-get).
set -uo pipefail
want=(redis-server etcd-server python3-pyverbs prometheus gcc)
missing=()
for p in "${want[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_debs: missing ${missing[*]} (need root and apt-get); dependent tests will skip"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null 2>&1 || true
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
  || echo "install_debs: could not install ${missing[*]}; dependent tests will skip"
# Debian's postinst may start the daemons; tests start their own on free ports.
for svc in redis-server etcd prometheus; do (service "$svc" stop >/dev/null 2>&1 || true); done
exit 0
