#!/usr/bin/env bash
# What the emulated Hexagon DSP needs (compiler/testing/emulated_hexagon.py): Debian's clang with its lld and llvm
# tools to build freestanding Hexagon programs (Debian 12: version 15, Debian 13: 19; any of 15-19 installed is
# used), and a qemu-hexagon of QEMU 8 or later (CPU models v68+; Debian 12's QEMU 7.2 knows only v67). On Debian 12 that is Debian 13's `qemu-user` package: downloaded with a private apt state whose only
# source is trixie (the system's sources, lists and packages stay untouched; nothing is installed from trixie),
# and only its statically linked qemu-hexagon is kept, in build/hexagon-qemu/. Quick when already there.
set -euo pipefail
cd "$(dirname "$0")/.."
llvm_ready() {
  for v in 19 18 17 16 15; do
    if command -v clang-$v && command -v ld.lld-$v && command -v llvm-objdump-$v && command -v llvm-nm-$v; then
      return 0
    fi
  done >/dev/null
  return 1
}
if ! llvm_ready; then
  apt-get update -qq
  for v in 19 15; do  # Debian 13's, Debian 12's
    if apt-cache show lld-$v >/dev/null 2>&1; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-$v lld-$v llvm-$v >/dev/null
      break
    fi
  done
  llvm_ready || { echo "fetch_qemu_hexagon.sh: apt has neither clang/lld/llvm 19 nor 15" >&2; exit 2; }
fi
# `-cpu help` exits 1 after listing the models.
has_v69() { { "$1" -cpu help 2>/dev/null || true; } | grep -x ' *v69' >/dev/null; }
kept=build/hexagon-qemu/qemu-hexagon
if [ -x "$kept" ] && has_v69 "$kept"; then exit 0; fi
for own in qemu-hexagon qemu-hexagon-static; do  # Debian 13's qemu-user or qemu-user-static
  if command -v $own >/dev/null && has_v69 "$(command -v $own)"; then exit 0; fi
done
work=build/hexagon-qemu.tmp
rm -rf "$work" && mkdir -p "$work/lists/partial" "$work/archives/partial"
echo "deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
  > "$work/sources.list"
apt_options=(-qq -o Dir::Etc::SourceList="$PWD/$work/sources.list" -o Dir::Etc::SourceParts=/nonexistent
             -o Dir::State::status=/dev/null -o Dir::State::Lists="$PWD/$work/lists" -o Dir::Cache="$PWD/$work"
             -o Dir::Cache::archives="$PWD/$work/archives" -o APT::Sandbox::User=root)
(apt-get "${apt_options[@]}" update && cd "$work" && apt-get "${apt_options[@]}" download qemu-user) || {
  echo "fetch_qemu_hexagon.sh: could not download Debian 13's qemu-user from deb.debian.org; check the network" \
       "and rerun" >&2; exit 2; }
dpkg -x "$work"/qemu-user_*.deb "$work/deb"
has_v69 "$work/deb/usr/bin/qemu-hexagon" || {
  echo "fetch_qemu_hexagon.sh: the downloaded qemu-hexagon has no CPU model v69" >&2; exit 2; }
mkdir -p "$(dirname "$kept")" && mv "$work/deb/usr/bin/qemu-hexagon" "$kept"
rm -rf "$work"
