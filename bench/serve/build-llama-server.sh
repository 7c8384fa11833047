#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, the peer `npm run bench:serve` measures against, on a machine
# that reaches only the npm registry and Debian's archive: the `node-llama-cpp` npm package carries
# the llama.cpp source it builds from as a git bundle (llama/gitRelease.bundle), which is read here,
# not run. Needs git, cmake and a C++ compiler (`apt-get install -y cmake g++`).
#
#   bash bench/serve/build-llama-server.sh [out-dir]    # default: .cache/llama.cpp
#   LLAMA_SERVER=.cache/llama.cpp/build/bin/llama-server npm run bench:serve
#
# NODE_LLAMA_CPP_VERSION picks the package (and so the llama.cpp commit); 3.22.1 carries commit
# de3ff81 (ggml 0.25.1), the build of docs/benchmarks.md's stop 41 figures. Built for this CPU
# (GGML_NATIVE), as llama.cpp's own instructions build it.
set -euo pipefail

version="${NODE_LLAMA_CPP_VERSION:-3.22.1}"
out="$(realpath -m "${1:-.cache/llama.cpp}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

mkdir -p "$(dirname "$out")"
(cd "$work" && npm pack --silent "node-llama-cpp@$version" > /dev/null)
tar -xzf "$work"/node-llama-cpp-*.tgz -C "$work" package/llama/gitRelease.bundle
rm -rf "$out"
git -c advice.detachedHead=false clone --quiet "$work/package/llama/gitRelease.bundle" "$out"
# Compiler output goes to a log; its end is shown if a step fails.
step() {
  local log="$1"
  shift
  "$@" > "$log" 2>&1 || { tail -n 40 "$log" >&2; echo "failed: $* (whole log: $log)" >&2; exit 1; }
}
step "$out/cmake.log" cmake -S "$out" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
step "$out/build.log" cmake --build "$out/build" --target llama-server -j "$(nproc)"
"$out/build/bin/llama-server" --version 2>&1 | grep -E '^version'
echo "LLAMA_SERVER=$out/build/bin/llama-server"
