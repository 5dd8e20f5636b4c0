# Installs the Debian packages shardkit's build, tests and demo use, when any is missing. Sourced by scripts/*.
shardkit_apt_packages=(cmake ninja-build g++ pkg-config libboost-dev libgloo-dev libfabric-dev libfabric-bin
  doctest-dev libbenchmark-dev nlohmann-json3-dev libxxhash-dev libopenblas-dev iproute2 iperf3 procps
  libcurl4-openssl-dev s3cmd gnuplot-nox python3 python3-botocore)

shardkit_ensure_deps() {
  local missing=()
  for p in "${shardkit_apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "shardkit: installing ${missing[*]}" >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # node and npm run the s3 tests' server (s3rver, from the npm registry). Checked as commands, not packages:
  # a NodeSource nodejs already ships npm, and Debian's npm package would conflict with it.
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "shardkit: installing nodejs npm" >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
  fi
}
