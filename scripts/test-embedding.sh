#!/usr/bin/env bash
# The C ABI end to end, run after `cargo test`. Needs (Debian 12; scripts/setup.sh installs them):
#   apt-get install -y cmake g++ libgtest-dev golang-go libjna-java pkg-config valgrind
#   cargo install --locked cbindgen --version 0.29.4
# and the shared test data next to the checkout (../shared) or in $TBOOST_SHARED.
#
# Checks, in order (the first failure stops the run with a message saying what broke):
#   tools, header drift (cbindgen), header as C99 and C++17, release library + its
#   native-static-libs list, docs/embedding.md excerpts = the examples and README.md's C
#   example compiles, CMake build + ctest
#   (gtest suite, C99 consumer, C++ example), install layout + SONAME + pkg-config,
#   find_package consumer outside the tree (static and shared), add_subdirectory consumer,
#   AddressSanitizer build + ctest, valgrind on the C++ example, the C++ example under
#   mpirun -np 2 (comm mpi: its tokens on a golden case and on the demo model, and a killed
#   follower), Go and Java hosts giving
#   the C++ host's tokens.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CBINDGEN_VERSION=0.29.4
SHARED=${TBOOST_SHARED:-$ROOT/../shared}
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
WORK=$TARGET_DIR/embedding
SCRATCH=$(mktemp -d /tmp/tboost-embedding.XXXXXX)
GOLDEN=$SHARED/testdata/golden/llama_gqa
JNA_JAR=/usr/share/java/jna.jar
JOBS=$(nproc 2>/dev/null || echo 2)
export TBOOST_SHARED=$SHARED CARGO_TARGET_DIR=$TARGET_DIR
trap 'chmod -R u+w "$SCRATCH" 2>/dev/null; rm -rf "$SCRATCH"' EXIT

passed=0
CURRENT=""
step() {
  CURRENT=$1
  echo
  echo "==== [$((passed + 1))] $1"
}
ok() {
  passed=$((passed + 1))
  echo "---- ok: $CURRENT"
}
die() {
  echo >&2
  echo "test-embedding: FAILED at \"$CURRENT\": $*" >&2
  echo "embedding: $passed passed, 1 failed"
  exit 1
}
trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR

# The `request k: ...` lines every host prints, in order.
request_lines() { grep '^request ' "$1" | sort -t: -k1,1V || true; }

step "tools"
for tool in cmake gcc g++ pkg-config go javac java valgrind readelf cargo mpirun timeout; do
  command -v "$tool" >/dev/null ||
    die "$tool is missing: run scripts/setup.sh (apt-get install -y cmake g++ libgtest-dev golang-go libjna-java pkg-config valgrind openmpi-bin)"
done
[ -f "$JNA_JAR" ] || die "$JNA_JAR is missing: apt-get install -y libjna-java"
[ -f /usr/include/gtest/gtest.h ] || die "gtest is missing: apt-get install -y libgtest-dev"
command -v cbindgen >/dev/null || die "cbindgen is missing: cargo install --locked cbindgen --version $CBINDGEN_VERSION"
have=$(cbindgen --version | awk '{print $2}')
[ "$have" = "$CBINDGEN_VERSION" ] ||
  die "cbindgen $have found, $CBINDGEN_VERSION required: cargo install --locked cbindgen --version $CBINDGEN_VERSION"
[ -d "$GOLDEN" ] || die "golden models not found at $GOLDEN: put \`shared\` next to the repository or set TBOOST_SHARED"
mkdir -p "$WORK"
ok

step "header drift: include/tboost.h is cbindgen's output"
(cd "$ROOT" && cbindgen --quiet --config crates/capi/cbindgen.toml --crate tboost-capi --output "$SCRATCH/tboost.h")
diff -u "$ROOT/include/tboost.h" "$SCRATCH/tboost.h" ||
  die "include/tboost.h differs from what cbindgen $CBINDGEN_VERSION generates from crates/capi: regenerate it with
  cbindgen --config crates/capi/cbindgen.toml --crate tboost-capi --output include/tboost.h   (and commit it)"
ok

step "header compiles as C99 and C++17 with -Wall -Wextra -Werror -pedantic"
gcc -std=c99 -Wall -Wextra -Werror -pedantic -fsyntax-only -x c "$ROOT/include/tboost.h" ||
  die "tboost.h does not compile as C99"
g++ -std=c++17 -Wall -Wextra -Werror -pedantic -fsyntax-only -x c++ "$ROOT/include/tboost.h" ||
  die "tboost.h does not compile as C++17"
ok

step "release library; its native-static-libs equal cmake/tboostNativeLibs.cmake"
# The same cargo invocation as CMakeLists.txt's tboost_cargo target (so neither rebuilds the
# other's output); cargo replays rustc's note on a no-op build.
(cd "$ROOT" && cargo rustc --release --lib -p tboost-capi --features fault-injection -- --print native-static-libs) 2>&1 | tee "$SCRATCH/cargo.log" | tail -n 3
rustc_libs=$(sed -n 's/.*note: native-static-libs: //p' "$SCRATCH/cargo.log" | tail -n 1)
[ -n "$rustc_libs" ] || die "cargo printed no native-static-libs line (see above)"
listed=$(sed -n 's/^set(TBOOST_NATIVE_STATIC_LIBS \(.*\))$/\1/p' "$ROOT/cmake/tboostNativeLibs.cmake" | sed 's/\([^ ]*\)/-l\1/g')
[ "$rustc_libs" = "$listed" ] ||
  die "rustc says a static link needs \"$rustc_libs\" but cmake/tboostNativeLibs.cmake lists \"$listed\": update the list"
echo "native-static-libs: $rustc_libs"
ok

step "docs/embedding.md (and docs/tensor-parallel.md) quote the tested examples verbatim; README.md's C example compiles"
python3 - "$ROOT" "$SCRATCH/readme_example.c" <<'PY' || die "a code block in docs/embedding.md differs from the example it quotes (copy it in again), or README.md's C example is missing"
import re, sys
root, c_out = sys.argv[1:3]
doc = open(f"{root}/docs/embedding.md").read()
# A fenced block and the line before it: `<!-- excerpt: PATH -->` there claims the block is a
# verbatim excerpt of PATH.
blocks = re.findall(r"^([^\n]*)\n```(\w+)\n(.*?)^```$", doc, flags=re.S | re.M)
ok = True
quoted = set()
for before, lang, body in blocks:
    m = re.fullmatch(r"<!-- excerpt: (\S+) -->", before.strip())
    if m:
        if body not in open(f"{root}/{m.group(1)}").read():
            ok = False
            print(f"a {lang} block is not a verbatim excerpt of {m.group(1)}:\n{body}")
        quoted.add(lang)
    elif lang in ("c", "cpp", "go", "java"):
        ok = False
        print(f"a {lang} block without an <!-- excerpt: PATH --> line before it:\n{body}")
for lang in ("cpp", "go", "java"):
    if lang not in quoted:
        ok = False
        print(f"no {lang} excerpt in docs/embedding.md")
consumers = open(f"{root}/scripts/test-embedding.sh").read()
for body in (b for _, l, b in blocks if l == "cmake"):
    for line in body.splitlines():
        stmt = line.split("#")[0].strip()
        if stmt.startswith(("find_package", "target_link_libraries")) and stmt not in consumers:
            ok = False
            print(f"cmake line not exercised by a consumer build: {stmt}")
readme_c = re.findall(r"^```c\n(.*?)^```$", open(f"{root}/README.md").read(), flags=re.S | re.M)
if len(readme_c) != 1:
    ok = False
    print(f"README.md has {len(readme_c)} ```c blocks, expected the one embedding example")
else:
    open(c_out, "w").write(readme_c[0])
# Other pages quote the examples too; their marked blocks must be verbatim as well.
for page in ("docs/tensor-parallel.md",):
    for before, lang, body in re.findall(r"^([^\n]*)\n```(\w+)\n(.*?)^```$", open(f"{root}/{page}").read(), flags=re.S | re.M):
        m = re.fullmatch(r"<!-- excerpt: (\S+) -->", before.strip())
        if m and body not in open(f"{root}/{m.group(1)}").read():
            ok = False
            print(f"a {lang} block of {page} is not a verbatim excerpt of {m.group(1)}:\n{body}")
print(f"{len(blocks)} blocks in docs/embedding.md, excerpts checked: {', '.join(sorted(quoted))}")
sys.exit(0 if ok else 1)
PY
gcc -std=c99 -Wall -Werror -I"$ROOT/include" -c "$SCRATCH/readme_example.c" -o "$SCRATCH/readme_example.o" ||
  die "README.md's C example does not compile against include/tboost.h"
ok

step "CMake build of the tree and ctest (gtest suite, C99 consumer, C++ example)"
cmake -S "$ROOT" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DTBOOST_CARGO_TARGET_DIR="$TARGET_DIR" -DTBOOST_FAULT_INJECTION=ON \
  -DTBOOST_SHARED="$SHARED" >"$SCRATCH/configure.log" || { cat "$SCRATCH/configure.log"; die "cmake configure failed"; }
cmake --build "$WORK/build" -j "$JOBS" || die "the CMake build failed"
(cd "$WORK/build" && ctest --output-on-failure -j "$JOBS") 2>&1 | tee "$SCRATCH/ctest.log" ||
  die "ctest failed (output above)"
! grep -q "(Skipped)" "$SCRATCH/ctest.log" || die "ctest skipped tests (listed above); this suite runs every one"
"$WORK/build/examples/cpp/tboost_example" "$GOLDEN" 4 2 12 >"$SCRATCH/cpp.out" || die "the C++ example failed"
request_lines "$SCRATCH/cpp.out" >"$SCRATCH/cpp.txt"
[ "$(wc -l <"$SCRATCH/cpp.txt")" -eq 8 ] || die "the C++ example printed $(wc -l <"$SCRATCH/cpp.txt") request lines, not 8"
ok

step "install layout, SONAME and pkg-config"
PREFIX=$WORK/prefix
rm -rf "$PREFIX"
cmake --install "$WORK/build" --prefix "$PREFIX" >/dev/null || die "cmake --install failed"
version=$(sed -n 's/^#define TBOOST_VERSION_STRING "\(.*\)"$/\1/p' "$ROOT/include/tboost.h")
abi=$(sed -n 's/^#define TBOOST_ABI_VERSION \([0-9]*\)$/\1/p' "$ROOT/include/tboost.h")
for f in include/tboost.h lib/libtboost.a "lib/libtboost.so.$version" "lib/libtboost.so.$abi" lib/libtboost.so \
  lib/cmake/tboost/tboostConfig.cmake lib/cmake/tboost/tboostConfigVersion.cmake \
  lib/cmake/tboost/tboostNativeLibs.cmake lib/pkgconfig/tboost.pc; do
  [ -e "$PREFIX/$f" ] || die "the install prefix lacks $f"
done
soname=$(readelf -d "$PREFIX/lib/libtboost.so.$version" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ "$soname" = "libtboost.so.$abi" ] || die "libtboost.so's SONAME is \"$soname\", expected libtboost.so.$abi"
export PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig
[ "$(pkg-config --modversion tboost)" = "$version" ] || die "pkg-config reports another version"
cflags=$(pkg-config --cflags tboost)
[[ "$cflags" == *"-I$PREFIX/lib/pkgconfig/../../include"* ]] || die "pkg-config --cflags tboost gives \"$cflags\""
libs=$(pkg-config --static --libs tboost)
[[ "$libs" == *"$rustc_libs"* ]] || die "pkg-config --static --libs tboost gives \"$libs\", without $rustc_libs"
ok

step "find_package consumer outside the tree (tboost::tboost, then tboost::tboost_shared)"
app=$SCRATCH/find-package
mkdir -p "$app"
cp "$ROOT/examples/cpp/main.cpp" "$app/"
cat >"$app/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.16)
project(app CXX)
find_package(tboost CONFIG REQUIRED)
add_executable(app main.cpp)
target_link_libraries(app PRIVATE tboost::tboost)
EOF
cmake -S "$app" -B "$app/build" -DCMAKE_PREFIX_PATH="$PREFIX" >/dev/null || die "find_package(tboost) failed"
cmake --build "$app/build" >/dev/null || die "the find_package consumer does not build"
"$app/build/app" "$GOLDEN" 4 2 12 >"$SCRATCH/find.out" || die "the find_package consumer failed to run"
request_lines "$SCRATCH/find.out" | diff -u "$SCRATCH/cpp.txt" - || die "the installed static library gives other tokens"
sed -i 's/tboost::tboost)/tboost::tboost_shared)/' "$app/CMakeLists.txt"
rm -rf "$app/build"
cmake -S "$app" -B "$app/build" -DCMAKE_PREFIX_PATH="$PREFIX" >/dev/null && cmake --build "$app/build" >/dev/null ||
  die "the tboost::tboost_shared consumer does not build"
needed=$(readelf -d "$app/build/app")
[[ "$needed" == *"Shared library: [libtboost.so.$abi]"* ]] || die "the app does not link libtboost.so.$abi"
"$app/build/app" "$GOLDEN" 4 2 12 >"$SCRATCH/shared.out" || die "the shared-library consumer failed to run"
request_lines "$SCRATCH/shared.out" | diff -u "$SCRATCH/cpp.txt" - || die "the installed shared library gives other tokens"
# The version file rejects an incompatible request.
sed -i 's/find_package(tboost CONFIG REQUIRED)/find_package(tboost 99.0 CONFIG REQUIRED)/' "$app/CMakeLists.txt"
if cmake -S "$app" -B "$SCRATCH/find-99" -DCMAKE_PREFIX_PATH="$PREFIX" >/dev/null 2>&1; then
  die "find_package(tboost 99.0) succeeded against version $version"
fi
ok

step "add_subdirectory consumer (builds with cargo)"
sub=$SCRATCH/add-subdirectory
mkdir -p "$sub"
cp "$ROOT/examples/cpp/main.cpp" "$sub/"
cat >"$sub/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.16)
project(app CXX)
add_subdirectory("$ROOT" tboost)
add_executable(app main.cpp)
target_link_libraries(app PRIVATE tboost::tboost)
EOF
cmake -S "$sub" -B "$sub/build" -DTBOOST_CARGO_TARGET_DIR="$TARGET_DIR" >/dev/null || die "add_subdirectory configure failed"
cmake --build "$sub/build" -j "$JOBS" >/dev/null || die "the add_subdirectory consumer does not build"
[ ! -e "$sub/build/tboost/tests" ] || die "add_subdirectory built tboost's tests (TBOOST_BUILD_TESTS must default to OFF)"
"$sub/build/app" "$GOLDEN" 4 2 12 >"$SCRATCH/sub.out" || die "the add_subdirectory consumer failed to run"
request_lines "$SCRATCH/sub.out" | diff -u "$SCRATCH/cpp.txt" - || die "the add_subdirectory build gives other tokens"
ok

step "AddressSanitizer: gtest suite, C consumer and C++ example (leaks, invalid accesses)"
cmake -S "$ROOT" -B "$WORK/build-asan" -DCMAKE_BUILD_TYPE=Debug -DTBOOST_SANITIZE=address -DTBOOST_FAULT_INJECTION=ON \
  -DTBOOST_CARGO_TARGET_DIR="$TARGET_DIR" -DTBOOST_SHARED="$SHARED" >/dev/null || die "ASan configure failed"
cmake --build "$WORK/build-asan" -j "$JOBS" >/dev/null || die "the ASan build failed"
symbols=$(nm "$WORK/build-asan/crates/capi/tests/cpp/tboost_gtest")
[[ "$symbols" == *__asan_init* ]] || die "the ASan build is not instrumented"
(cd "$WORK/build-asan" && ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 ctest --output-on-failure -j "$JOBS") ||
  die "ctest under AddressSanitizer failed (report above)"
ok

step "valgrind: the C++ example (covers the Rust side, which ASan does not instrument)"
valgrind --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite,indirect --show-possibly-lost=no -q \
  "$WORK/build/examples/cpp/tboost_example" "$GOLDEN" 4 2 12 >"$SCRATCH/vg.out" 2>"$SCRATCH/vg.err" ||
  { cat "$SCRATCH/vg.err"; die "valgrind found errors in the C++ example"; }
request_lines "$SCRATCH/vg.out" | diff -u "$SCRATCH/cpp.txt" - || die "the example gives other tokens under valgrind"
ok

step "the C++ host under mpirun -np 2 (comm mpi) gives its tokens alone (golden case, demo model); a killed follower fails the requests, naming it"
# Root and containers: as crates/cli/tests/tp.rs runs mpirun. `timeout` is the hard limit.
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -x TBOOST_COMM=mpi -x OMPI_MCA_btl_vader_single_copy_mechanism=none)
export OMPI_MCA_btl_vader_single_copy_mechanism=none
EXAMPLE=$WORK/build/examples/cpp/tboost_example
timeout -k 5 300 "${MPIRUN[@]}" -np 2 "$EXAMPLE" "$GOLDEN" 4 2 12 >"$SCRATCH/mpi.out" 2>"$SCRATCH/mpi.err" ||
  { cat "$SCRATCH/mpi.out" "$SCRATCH/mpi.err"; die "the C++ example under mpirun -np 2 failed (status $?)"; }
grep -q '^tensor parallel: rank 0 of 2$' "$SCRATCH/mpi.out" && grep -q '^tensor parallel: rank 1 of 2$' "$SCRATCH/mpi.out" ||
  { cat "$SCRATCH/mpi.out"; die "the two processes did not form a group of 2 ranks"; }
request_lines "$SCRATCH/mpi.out" | diff -u "$SCRATCH/cpp.txt" - ||
  die "rank 0 of mpirun -np 2 gives other tokens than the C++ host alone (tp = 1)"
# The demo model (a real GGUF: Q4_K_M, 24 layers, 151,936-token vocabulary) the same way.
# Exact precision: under `fast` a row-parallel shard whose k is not whole K-quant blocks runs
# in f32, so tp = 2's logits are not tp = 1's (docs/tensor-parallel.md).
DEMO_MODEL=${TBOOST_DEMO_MODEL:-$("$ROOT/scripts/fetch-demo-model.sh")}
TBOOST_PRECISION=exact timeout -k 5 300 "$EXAMPLE" "$DEMO_MODEL" 4 2 12 >"$SCRATCH/demo1.out" 2>"$SCRATCH/demo1.err" ||
  { cat "$SCRATCH/demo1.err"; die "the C++ example on the demo model failed"; }
request_lines "$SCRATCH/demo1.out" >"$SCRATCH/demo1.txt"
[ "$(wc -l <"$SCRATCH/demo1.txt")" -eq 8 ] || { cat "$SCRATCH/demo1.out"; die "the demo model's C++ run printed no 8 request lines"; }
timeout -k 5 300 "${MPIRUN[@]}" -x TBOOST_PRECISION=exact -np 2 "$EXAMPLE" "$DEMO_MODEL" 4 2 12 \
  >"$SCRATCH/demo2.out" 2>"$SCRATCH/demo2.err" ||
  { cat "$SCRATCH/demo2.out" "$SCRATCH/demo2.err"; die "the C++ example on the demo model under mpirun -np 2 failed (status $?)"; }
grep -q '^tensor parallel: rank 1 of 2$' "$SCRATCH/demo2.out" || { cat "$SCRATCH/demo2.out"; die "the demo model's run formed no group of 2"; }
request_lines "$SCRATCH/demo2.out" | diff -u "$SCRATCH/demo1.txt" - ||
  die "rank 0 of mpirun -np 2 gives other tokens on the demo model than the C++ host alone (tp = 1)"
echo "demo model: mpirun -np 2 gives the 8 requests' tokens of one process"
# A follower killed while the leader decodes. mpirun must keep the leader alive to report
# (orte_abort_on_non_zero_status 0); the leader's collectives time out after 3 s, its
# requests end with an error naming rank 1, and tboost_comm_finalize ends the job. Two
# requests of 2000 tokens (beyond the model's 512 trained positions, which the engine
# warns about) decode for a second or more, so the kill comes while they run.
timeout -k 5 120 "${MPIRUN[@]}" -x TBOOST_COMM_TIMEOUT_MS=3000 --mca orte_abort_on_non_zero_status 0 -np 2 \
  "$EXAMPLE" "$GOLDEN" 2 1 2000 >"$SCRATCH/kill.out" 2>"$SCRATCH/kill.err" &
launcher=$!
follower=""
for _ in $(seq 1200); do  # up to 60 s for the ranks to start and the leader to decode
  if grep -q '^  \[request [0-9]*\] token' "$SCRATCH/kill.out" 2>/dev/null; then
    for mpirun_pid in $(pgrep -P "$launcher" || true); do
      for pid in $(pgrep -P "$mpirun_pid" || true); do
        tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1' && follower=$pid
      done
    done
    break
  fi
  sleep 0.05
done
[ -n "$follower" ] || { kill -TERM "$launcher" 2>/dev/null; wait "$launcher" || true; cat "$SCRATCH/kill.out" "$SCRATCH/kill.err"; die "the leader decoded nothing, or rank 1's process was not found"; }
kill -KILL "$follower"
killed=$(date +%s%N)
status=0
wait "$launcher" || status=$?
took_ms=$((($(date +%s%N) - killed) / 1000000))
# 124: `timeout` ended it. (mpirun's own status is the killed rank's, 137.)
[ "$status" -ne 124 ] && [ "$took_ms" -lt 100000 ] ||
  { cat "$SCRATCH/kill.out" "$SCRATCH/kill.err"; die "mpirun still ran after the follower was killed (ended by timeout)"; }
[ "$status" -ne 0 ] || die "mpirun succeeded although a rank was killed"
grep -q '^request [0-9]*:.* (error)$' "$SCRATCH/kill.out" ||
  { cat "$SCRATCH/kill.out" "$SCRATCH/kill.err"; die "no request of the leader ended with an error"; }
! grep -q '^request [0-9]*:.* (length)$' "$SCRATCH/kill.out" ||
  { cat "$SCRATCH/kill.out"; die "a request finished although the follower was killed while it decoded"; }
grep -Eq '^  request [0-9]+ failed: .*(all_reduce|all_gather|broadcast): rank 1 did not complete' "$SCRATCH/kill.out" ||
  { cat "$SCRATCH/kill.out" "$SCRATCH/kill.err"; die "the failed requests do not name rank 1"; }
[ "$took_ms" -lt 20000 ] || die "the job ended $took_ms ms after the follower was killed (collective timeout 3 s)"
grep '^  request [0-9]* failed' "$SCRATCH/kill.out" | head -n 1
echo "follower killed; mpirun ended $took_ms ms later with status $status"
ok

# The Go and Java hosts also chat with the demo model: its template, stop strings, top
# alternatives and timings through the C ABI.
CHAT_MODEL=$DEMO_MODEL
check_chat() { # OUTPUT HOST
  grep -q '^chat prompt: .*<|im_start|>user.*<|im_start|>assistant' "$1" &&
    grep -q '^chat stops: \[.*"<|im_end|>".*\]$' "$1" &&
    grep -Eq "^chat tokens: [0-9]+ ids, as the rendered text's$" "$1" &&
    grep -Eq '^chat reply: .+ \((eos|length)\)$' "$1" &&
    grep -Eq '^chat first-token alternatives: [0-9]+ \(-?[0-9.]+\), [0-9]+ \(-?[0-9.]+\), [0-9]+ \(-?[0-9.]+\)$' "$1" &&
    grep -Eq '^chat timings: prompt [1-9][0-9]* tokens, queued [0-9.]+ ms, first token [0-9.]+ ms, total [0-9.]+ ms$' "$1" &&
    grep -Eq '^chat json: \{.*\} \(valid: name ".*", [0-3] args\)$' "$1" ||
    { grep '^chat' "$1"; die "the $2 host's chat (template, stops, alternatives, timings, JSON schema) is not as expected"; }
  grep -E '^chat (reply|json)' "$1"
}

step "Go (cgo) host gives the C++ host's tokens, and chats with the demo model"
# A fresh build cache: Go 1.19's cache does not notice that pkg-config's -L path changed.
export GOCACHE=$SCRATCH/gocache GOPATH=$SCRATCH/gopath GOFLAGS=-buildvcs=false GOPROXY=off
(cd "$ROOT/examples/go" && go vet . && go build -o "$SCRATCH/tboost-go" .) || die "the Go example does not build"
LD_LIBRARY_PATH=$PREFIX/lib "$SCRATCH/tboost-go" "$GOLDEN" 4 2 12 "$CHAT_MODEL" >"$SCRATCH/go.out" || die "the Go example failed"
request_lines "$SCRATCH/go.out" | diff -u "$SCRATCH/cpp.txt" - || die "Go's tokens differ from the C++ host's"
check_chat "$SCRATCH/go.out" Go
ok

step "Java (JNA) host gives the C++ host's tokens, and chats with the demo model"
javac -Xlint:all -Werror -cp "$JNA_JAR" -d "$SCRATCH/java" "$ROOT/examples/java/TBoostExample.java" ||
  die "the Java example does not compile"
java -cp "$SCRATCH/java:$JNA_JAR" -Djna.library.path="$PREFIX/lib" TBoostExample "$GOLDEN" 4 2 12 "$CHAT_MODEL" \
  >"$SCRATCH/java.out" || die "the Java example failed"
request_lines "$SCRATCH/java.out" | diff -u "$SCRATCH/cpp.txt" - || die "Java's tokens differ from the C++ host's"
check_chat "$SCRATCH/java.out" Java
ok

echo
echo "C++, Go and Java hosts agree on $(wc -l <"$SCRATCH/cpp.txt") requests."
echo "embedding: $passed passed, 0 failed"
