#!/usr/bin/env bash
# A stand-in for python:3.11-slim-bookworm where no image registry is reachable (docker/README.md,
# "Without a registry"): Debian bookworm from the apt mirror this machine uses (debootstrap), with
# this machine's own Python 3.11 (bookworm's python3 is 3.11.2; some pinned packages need 3.11.5+)
# in /usr/local, as in the python:3.11-slim images. Needs root, debootstrap, and docker or podman.
#   docker/base-image.sh [IMAGE]        default IMAGE: localhost/elastic-ops-base:bookworm
set -euo pipefail
IMAGE=${1:-localhost/elastic-ops-base:bookworm}
ENGINE=${ENGINE:-$(command -v podman || command -v docker)}
PYTHON=${BASE_PYTHON:-python3.11}
MIRROR=${DEBIAN_MIRROR:-$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
  /etc/apt/sources.list.d/ 2>/dev/null | grep -oE 'https?://[^ ]+' | head -1 || true)}
: "${MIRROR:?no Debian mirror in /etc/apt/sources*: set DEBIAN_MIRROR}"
PREFIX=$("$PYTHON" -c 'import sys; print(sys.base_prefix)')
VERSION=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$VERSION" = 3.11 ] || { echo "base-image.sh: $PYTHON is Python $VERSION; Python 3.11 is needed" >&2; exit 2; }

ROOT=$(mktemp -d /var/tmp/elastic-ops-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
echo "base-image.sh: debootstrap bookworm from $MIRROR"
debootstrap --variant=minbase \
  --include=ca-certificates,libssl3,libsqlite3-0,libffi8,libbz2-1.0,liblzma5,zlib1g,libreadline8,libncursesw6,libuuid1,libexpat1,libgdbm6 \
  bookworm "$ROOT/fs" "$MIRROR" >"$ROOT/debootstrap.log" 2>&1 || { tail -20 "$ROOT/debootstrap.log"; exit 1; }
echo "base-image.sh: Python from $PREFIX into /usr/local"
mkdir -p "$ROOT/fs/usr/local/bin" "$ROOT/fs/usr/local/lib"
cp -a "$PREFIX/bin/python$VERSION" "$ROOT/fs/usr/local/bin/"
cp -a "$PREFIX"/lib/libpython"$VERSION"*.so* "$ROOT/fs/usr/local/lib/" 2>/dev/null || true
tar -C "$PREFIX/lib" --exclude="python$VERSION/site-packages/*" --exclude="python$VERSION/test" \
  --exclude='__pycache__' -c "python$VERSION" | tar -C "$ROOT/fs/usr/local/lib" -x
ln -sf "python$VERSION" "$ROOT/fs/usr/local/bin/python3"
ln -sf "python$VERSION" "$ROOT/fs/usr/local/bin/python"
chroot "$ROOT/fs" /sbin/ldconfig
chroot "$ROOT/fs" /usr/local/bin/python3 -c 'import ssl, sqlite3, ctypes, lzma, bz2, zlib, uuid, venv, ensurepip'
rm -rf "$ROOT/fs/var/cache/apt/archives/"*.deb "$ROOT/fs/var/lib/apt/lists/"*
tar -C "$ROOT/fs" -c . | "$ENGINE" import - "$IMAGE" >/dev/null
echo "base-image.sh: $IMAGE (Debian bookworm, Python $("$ROOT/fs/usr/local/bin/python3" -V 2>&1 || true))"
