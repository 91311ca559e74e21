#!/usr/bin/env bash
# Unpacks Debian's PCRE2 (headers and the static libpcre2-8.a, built position-independent)
# into .deps/pcre2, where CMake looks first: for machines without network or without
# libpcre2-dev, such as the GPU machine, which gets the folder copied along with the tree.
#
#   scripts/fetch_pcre2.sh        # needs apt-get (a Debian or Ubuntu machine with network)
set -euo pipefail
cd "$(dirname "$0")/.."

destination=.deps/pcre2
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
(cd "$download" && apt-get download libpcre2-dev libpcre2-8-0)
rm -rf "$destination"
mkdir -p "$destination"
for package in "$download"/*.deb; do
  dpkg -x "$package" "$destination"
done
find "$destination" -name libpcre2-8.a -print -quit | grep -q . ||
  { echo "fetch_pcre2.sh: the packages held no libpcre2-8.a" >&2; exit 1; }
echo "PCRE2 unpacked into $destination"
