#!/usr/bin/env bash
# Builds a local stand-in for python:3.11-slim when no registry is reachable: Debian bookworm from debootstrap
# (its python3 is 3.11), with python and pip where the official image has them (/usr/local/bin), imported as
# an image.  Usage: docker/standin-base.sh TAG [WORKDIR]
set -euo pipefail
tag=${1:?usage: standin-base.sh TAG [WORKDIR]}
work=${2:-build/standin}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
root="$work/rootfs"
rm -rf "$root" && mkdir -p "$work"
echo "standin: debootstrap bookworm from $mirror into $root"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" \
  > "$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log"; exit 1; }
# What the official image offers: `python` on PATH, UTF-8 locale; nothing cached.
ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
ln -sf /usr/bin/python3 "$root/usr/local/bin/python3"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
       "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  --message "posenc stand-in for python:3.11-slim (debootstrap bookworm)" - "$tag"
rm -rf "$root"
echo "standin: imported $tag"
