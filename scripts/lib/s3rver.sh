# The S3 server of the `s3` tests and of scripts/s3-bench: s3rver from npm, pinned, on loopback. Sourced.
#
#   shardkit_s3rver_start <work dir>   installs s3rver@$SHARDKIT_S3RVER_VERSION under <work dir>/s3rver-<version>
#                                      (once; npm registry), starts it with the bucket shardkit-test on 127.0.0.1,
#                                      and exports AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
#                                      AWS_REGION, SHARDKIT_TEST_S3_BUCKET and SHARDKIT_TEST_S3RVER_DATA
#   shardkit_s3rver_stop               stops it (callers trap it on EXIT)
#
# Without node/npm or the registry it says so and returns 0: the s3 suites then skip with that reason.
SHARDKIT_S3RVER_VERSION=3.7.1
SHARDKIT_S3RVER_PID=""

shardkit_s3rver_start() {
  local work
  work=$(mkdir -p "$1" && cd "$1" && pwd)
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "shardkit: node/npm not found; the s3 tests will skip" >&2
    return 0
  fi
  local modules="$work/s3rver-$SHARDKIT_S3RVER_VERSION"
  if [ ! -f "$modules/node_modules/s3rver/package.json" ]; then
    echo "shardkit: installing s3rver@$SHARDKIT_S3RVER_VERSION into $modules" >&2
    if ! npm install --prefix "$modules" --no-audit --no-fund --loglevel=error "s3rver@$SHARDKIT_S3RVER_VERSION" >/dev/null; then
      echo "shardkit: npm install s3rver failed; the s3 tests will skip" >&2
      return 0
    fi
  fi
  local data="$work/s3rver-data" port_file="$work/s3rver.port"
  rm -rf "$data" "$port_file"
  mkdir -p "$data"
  node --openssl-legacy-provider "$root/tests/s3/s3rver_server.js" "$modules/node_modules/s3rver" "$data" "$port_file" \
    shardkit-test >"$work/s3rver.log" 2>&1 &
  SHARDKIT_S3RVER_PID=$!
  local i
  for i in $(seq 1 100); do
    [ -s "$port_file" ] && break
    kill -0 "$SHARDKIT_S3RVER_PID" 2>/dev/null || break
    sleep 0.1
  done
  if [ ! -s "$port_file" ]; then
    echo "shardkit: s3rver did not start (see $work/s3rver.log); the s3 tests will skip" >&2
    shardkit_s3rver_stop
    return 0
  fi
  export AWS_ENDPOINT_URL="http://127.0.0.1:$(cat "$port_file")"
  export AWS_ACCESS_KEY_ID=S3RVER AWS_SECRET_ACCESS_KEY=S3RVER AWS_REGION=us-east-1
  export SHARDKIT_TEST_S3_BUCKET=shardkit-test SHARDKIT_TEST_S3RVER_DATA="$data"
  echo "shardkit: s3rver $SHARDKIT_S3RVER_VERSION at $AWS_ENDPOINT_URL (pid $SHARDKIT_S3RVER_PID)" >&2
}

shardkit_s3rver_stop() {
  if [ -n "$SHARDKIT_S3RVER_PID" ]; then
    kill "$SHARDKIT_S3RVER_PID" 2>/dev/null || true
    wait "$SHARDKIT_S3RVER_PID" 2>/dev/null || true
    SHARDKIT_S3RVER_PID=""
  fi
}
