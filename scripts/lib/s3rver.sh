# The S3 server of the `s3` tests and of scripts/s3-bench: s3rver from npm, pinned, on loopback, behind a front
# that verifies every request's SigV4 signature as S3 does (tests/s3/sigv4_front.py, botocore's signer; s3rver
# verifies none). Sourced.
#
#   shardkit_s3rver_start <work dir>   installs s3rver@$SHARDKIT_S3RVER_VERSION under <work dir>/s3rver-<version>
#                                      (once; npm registry), starts it with the bucket shardkit-test on 127.0.0.1
#                                      and the front before it, and exports AWS_ENDPOINT_URL (the front),
#                                      AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, SHARDKIT_TEST_S3_BUCKET,
#                                      SHARDKIT_TEST_S3RVER_DATA and SHARDKIT_TEST_S3RVER_URL (s3rver itself,
#                                      unverified: for benchmarks that measure the server, not the front)
#   shardkit_s3rver_stop               stops both (callers trap it on EXIT)
#   shardkit_s3rver_install <work dir> installs s3rver only, prints its module directory (scripts/governor-lab)
#
# Without node/npm, the registry or /usr/bin/python3 with botocore (python3-botocore) it says so and returns 0:
# the s3 suites then skip with that reason.
SHARDKIT_S3RVER_VERSION=3.7.1
SHARDKIT_S3RVER_PID=""
SHARDKIT_S3_FRONT_PID=""

# _shardkit_wait_port_file FILE PID: waits up to 10 s for FILE to be written while PID lives.
_shardkit_wait_port_file() {
  local i
  for i in $(seq 1 100); do
    [ -s "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  [ -s "$1" ]
}

# shardkit_s3rver_install <work dir>: installs s3rver@$SHARDKIT_S3RVER_VERSION under <work dir> once (npm registry)
# and prints the directory to pass to tests/s3/s3rver_server.js; returns 1 (having said why) when it cannot.
shardkit_s3rver_install() {
  local modules="$1/s3rver-$SHARDKIT_S3RVER_VERSION"
  if [ ! -f "$modules/node_modules/s3rver/package.json" ]; then
    echo "shardkit: installing s3rver@$SHARDKIT_S3RVER_VERSION into $modules" >&2
    if ! npm install --prefix "$modules" --no-audit --no-fund --loglevel=error "s3rver@$SHARDKIT_S3RVER_VERSION" >/dev/null; then
      echo "shardkit: npm install s3rver failed; the s3 tests will skip" >&2
      return 1
    fi
  fi
  echo "$modules/node_modules/s3rver"
}

shardkit_s3rver_start() {
  local work
  work=$(mkdir -p "$1" && cd "$1" && pwd)
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "shardkit: node/npm not found; the s3 tests will skip" >&2
    return 0
  fi
  if ! /usr/bin/python3 -c 'import botocore' 2>/dev/null; then
    echo "shardkit: /usr/bin/python3 has no botocore (python3-botocore); the s3 tests will skip" >&2
    return 0
  fi
  local modules
  modules=$(shardkit_s3rver_install "$work") || return 0
  local data="$work/s3rver-data" port_file="$work/s3rver.port" front_port_file="$work/s3-front.port"
  rm -rf "$data" "$port_file" "$front_port_file"
  mkdir -p "$data"
  node --openssl-legacy-provider "$root/tests/s3/s3rver_server.js" "$modules" "$data" "$port_file" \
    shardkit-test >"$work/s3rver.log" 2>&1 &
  SHARDKIT_S3RVER_PID=$!
  if ! _shardkit_wait_port_file "$port_file" "$SHARDKIT_S3RVER_PID"; then
    echo "shardkit: s3rver did not start (see $work/s3rver.log); the s3 tests will skip" >&2
    shardkit_s3rver_stop
    return 0
  fi
  /usr/bin/python3 "$root/tests/s3/sigv4_front.py" --upstream "$(cat "$port_file")" --port-file "$front_port_file" \
    --region us-east-1 --key S3RVER:S3RVER >"$work/s3-front.log" 2>&1 &
  SHARDKIT_S3_FRONT_PID=$!
  if ! _shardkit_wait_port_file "$front_port_file" "$SHARDKIT_S3_FRONT_PID"; then
    echo "shardkit: the signature-verifying front did not start (see $work/s3-front.log); the s3 tests will skip" >&2
    shardkit_s3rver_stop
    return 0
  fi
  export AWS_ENDPOINT_URL="http://127.0.0.1:$(cat "$front_port_file")"
  export SHARDKIT_TEST_S3RVER_URL="http://127.0.0.1:$(cat "$port_file")"
  export AWS_ACCESS_KEY_ID=S3RVER AWS_SECRET_ACCESS_KEY=S3RVER AWS_REGION=us-east-1
  export SHARDKIT_TEST_S3_BUCKET=shardkit-test SHARDKIT_TEST_S3RVER_DATA="$data"
  echo "shardkit: s3rver $SHARDKIT_S3RVER_VERSION at $SHARDKIT_TEST_S3RVER_URL (pid $SHARDKIT_S3RVER_PID)," \
    "verifying SigV4 in front at $AWS_ENDPOINT_URL (pid $SHARDKIT_S3_FRONT_PID)" >&2
}

shardkit_s3rver_stop() {
  if [ -n "$SHARDKIT_S3_FRONT_PID" ]; then
    kill "$SHARDKIT_S3_FRONT_PID" 2>/dev/null || true
    wait "$SHARDKIT_S3_FRONT_PID" 2>/dev/null || true
    SHARDKIT_S3_FRONT_PID=""
  fi
  if [ -n "$SHARDKIT_S3RVER_PID" ]; then
    kill "$SHARDKIT_S3RVER_PID" 2>/dev/null || true
    wait "$SHARDKIT_S3RVER_PID" 2>/dev/null || true
    SHARDKIT_S3RVER_PID=""
  fi
}
