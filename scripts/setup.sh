#!/usr/bin/env bash
# Installs what scripts/test.sh needs on a Debian 12 machine that has only the Rust toolchain.
# Idempotent: when everything is present it only checks (well under a second) and installs
# nothing; apt-get update runs only when a package is missing; sudo is used only when not root.
#
# Usage: scripts/setup.sh [--check]
#   --check   print what is missing and exit 1 if anything is; install nothing.
#
# To add a prerequisite, add one line to APT_PACKAGES or CARGO_TOOLS below: the package and
# how to tell that it is there (a probe), so that a machine that has it is left alone.
set -euo pipefail

# ---- Debian packages: "package|probe". A probe is
#        cmd:NAME      a command on PATH
#        file:PATH     a file that the package installs
#        run:COMMAND   a command that must succeed (quietly)
APT_PACKAGES=(
  # TLS roots for cargo (crates.io) and pip (PyPI).
  "ca-certificates|file:/etc/ssl/certs/ca-certificates.crt"
  # C ABI: CMake package, gtest suite under ctest, C/C++ consumers, AddressSanitizer.
  "cmake|cmd:cmake"
  "g++|cmd:g++"
  "make|cmd:make"
  "pkg-config|cmd:pkg-config"
  "libgtest-dev|file:/usr/include/gtest/gtest.h"
  "valgrind|cmd:valgrind"
  # Go and Java hosts.
  "golang-go|cmd:go"
  "openjdk-17-jdk-headless|cmd:javac"
  "libjna-java|file:/usr/share/java/jna.jar"
  # The demo model is fetched with pip; the embedding script checks README snippets in Python.
  "python3|cmd:python3"
  "python3-pip|run:python3 -m pip --version"
  # Ascend bindings: bindgen (the drift check of ascend-sys/src/raw.rs) needs libclang; gcc
  # (above) builds the CANN simulator.
  "libclang-dev|run:compgen -G '/usr/lib/llvm-*/lib/libclang.so'"
  "clang|cmd:clang"
  # Tensor parallelism over MPI (engine key comm=mpi): mpirun, and libmpi.so.40 that the
  # engine loads at run time.
  "openmpi-bin|cmd:mpirun"
  "libopenmpi-dev|run:ldconfig -p | grep -q libmpi.so.40"
  # More packages go here, one per line.
)

# ---- Cargo tools: "crate|version|binary". Installed with `cargo install --locked`; the probe
# is `binary --version` naming exactly this version.
CARGO_TOOLS=(
  "cbindgen|0.29.4|cbindgen"
  # The bindgen that generated ascend-sys/src/raw.rs (scripts/gen-ascend-bindings.sh checks the pin).
  "bindgen-cli|0.72.1|bindgen"
  # More tools go here.
)

# ---- rustup components: "component|probe" (test.sh runs `cargo fmt --check`).
RUST_COMPONENTS=(
  "rustfmt|run:cargo fmt --version"
)

CHECK_ONLY=0
case "${1:-}" in
  "") ;;
  --check) CHECK_ONLY=1 ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac

say() { echo "setup: $*" >&2; }
die() {
  echo "setup: error: $*" >&2
  exit 1
}

# Cargo installs into $CARGO_HOME/bin; make a tool installed by an earlier run visible.
export PATH="${CARGO_HOME:-${HOME:-$(echo ~)}/.cargo}/bin:$PATH"

command -v cargo >/dev/null 2>&1 || die "cargo is not on PATH: install Rust first (https://rustup.rs), then run this again"

probe() {
  local p=$1
  case "$p" in
    cmd:*) command -v "${p#cmd:}" >/dev/null 2>&1 ;;
    file:*) [ -e "${p#file:}" ] ;;
    run:*) bash -c "${p#run:}" >/dev/null 2>&1 ;;
    *) die "unknown probe '$p'" ;;
  esac
}

missing_apt=()
for entry in "${APT_PACKAGES[@]}"; do
  pkg=${entry%%|*}
  probe "${entry#*|}" || missing_apt+=("$pkg")
done

missing_cargo=()
for entry in "${CARGO_TOOLS[@]}"; do
  IFS='|' read -r crate version bin <<<"$entry"
  have=$("$bin" --version 2>/dev/null | awk '{print $2}' || true)
  [ "$have" = "$version" ] || missing_cargo+=("$crate|$version|$bin|${have:-none}")
done

missing_rust=()
for entry in "${RUST_COMPONENTS[@]}"; do
  probe "${entry#*|}" || missing_rust+=("${entry%%|*}")
done

if [ ${#missing_apt[@]} -eq 0 ] && [ ${#missing_cargo[@]} -eq 0 ] && [ ${#missing_rust[@]} -eq 0 ]; then
  [ "$CHECK_ONLY" = 1 ] && say "everything is present"
  exit 0
fi

if [ "$CHECK_ONLY" = 1 ]; then
  [ ${#missing_apt[@]} -eq 0 ] || say "missing Debian packages: ${missing_apt[*]}"
  for m in "${missing_cargo[@]}"; do
    IFS='|' read -r crate version bin have <<<"$m"
    say "missing cargo tool: $crate $version ($bin --version gives: $have)"
  done
  [ ${#missing_rust[@]} -eq 0 ] || say "missing rustup components: ${missing_rust[*]}"
  exit 1
fi

if [ ${#missing_apt[@]} -gt 0 ]; then
  SUDO=()
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "not root and no sudo: install ${missing_apt[*]} as root"
    SUDO=(sudo)
  fi
  command -v apt-get >/dev/null 2>&1 ||
    die "apt-get not found (tboost's setup targets Debian 12): install ${missing_apt[*]} by hand"
  say "installing Debian packages: ${missing_apt[*]}"
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing_apt[@]}"
fi

for m in "${missing_rust[@]}"; do
  command -v rustup >/dev/null 2>&1 || die "rustup is not on PATH: install the $m component of your toolchain by hand"
  say "adding the rustup component $m"
  rustup component add "$m"
done

for m in "${missing_cargo[@]}"; do
  IFS='|' read -r crate version bin have <<<"$m"
  say "installing $crate $version with cargo (found: $have)"
  cargo install --locked "$crate" --version "$version"
done

# Everything must be there now: a probe that still fails is a bug in this script's lists.
still=()
for entry in "${APT_PACKAGES[@]}"; do
  probe "${entry#*|}" || still+=("${entry%%|*}")
done
for entry in "${CARGO_TOOLS[@]}"; do
  IFS='|' read -r crate version bin <<<"$entry"
  [ "$("$bin" --version 2>/dev/null | awk '{print $2}' || true)" = "$version" ] || still+=("$crate")
done
for entry in "${RUST_COMPONENTS[@]}"; do
  probe "${entry#*|}" || still+=("${entry%%|*}")
done
[ ${#still[@]} -eq 0 ] || die "still missing after installing: ${still[*]}"
say "done"
