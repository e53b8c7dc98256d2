# The system libraries a program linking the Rust staticlib libtboost.a needs, in the order
# `rustc --print native-static-libs` gives them (x86_64/aarch64 Linux, glibc). This is the
# only copy of the list: tboostConfig.cmake, the source tree's CMakeLists.txt and tboost.pc
# use it, and scripts/test-embedding.sh fails when rustc's list differs.
set(TBOOST_NATIVE_STATIC_LIBS dl gcc_s util rt pthread m dl c)
