#!/usr/bin/env bash
# A Debian bullseye sysroot (glibc 2.31, GCC 10) for `make wheel-compat`: the wheel built against it needs
# GLIBC <= 2.31 and GLIBCXX <= 3.4.28 at most, so auditwheel tags it manylinux_2_31 or older (manylinux_2_27 as
# measured: docs/release.md).
#
#   release/sysroot.sh DIR     (root; debootstrap installed: apt-get install debootstrap)
#
# bullseye is the oldest Debian release deb.debian.org still serves (buster, glibc 2.28, moved to archive.debian.org).
# Only the compiler runs from DIR (its gcc-10 driver and cc1plus; ar, ranlib and ld are the host's), on the host,
# with --sysroot=DIR: CMake, the host's Python 3.11 headers and .venv's torch headers and libraries are used as they
# are; no chroot is entered.
# Absolute symbolic links inside the sysroot are made relative, or the linker would follow /lib64/ld-linux-x86-64.so.2
# out of it to the host's loader. Idempotent: an existing DIR with g++-10 is kept.
set -euo pipefail
DIR=${1:?usage: release/sysroot.sh DIR}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if [[ -x "$DIR/usr/bin/g++-10" ]]; then
  echo "[sysroot] $DIR already holds bullseye's g++-10"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "error: debootstrap not found (apt-get install debootstrap)" >&2; exit 1; }
[[ $(id -u) == 0 ]] || { echo "error: debootstrap needs root" >&2; exit 1; }
t0=$SECONDS
echo "[sysroot] debootstrap bullseye (minbase + g++) into $DIR from $MIRROR ..."
debootstrap --variant=minbase --include=g++,libc6-dev bullseye "$DIR" "$MIRROR"
python3 - "$DIR" <<'EOF'
import os, sys
root = sys.argv[1]
n = 0
for d in ("lib", "lib64", "usr/lib", "usr/lib64"):
    for dp, dn, fn in os.walk(os.path.join(root, d)):
        for f in fn + dn:
            p = os.path.join(dp, f)
            if os.path.islink(p) and os.readlink(p).startswith("/"):
                t = os.readlink(p)
                os.unlink(p)
                os.symlink(os.path.relpath(root + t, dp), p)
                n += 1
print(f"[sysroot] {n} absolute links made relative")
EOF
echo "[sysroot] done in $((SECONDS - t0))s: $("$DIR/usr/bin/g++-10" --version | head -1), $(basename "$DIR"/lib/x86_64-linux-gnu/libc-*.so)"
