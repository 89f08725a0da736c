#!/usr/bin/env bash
# Installs etcd from Debian's etcd-server package; called by `make` when no etcd is on PATH.
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "etcd is not installed and this is not a Debian-like system: install etcd (v3.4 or newer) and put it on PATH" >&2
    exit 2
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi
echo "installing etcd (Debian package etcd-server)..."
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
command -v etcd >/dev/null
