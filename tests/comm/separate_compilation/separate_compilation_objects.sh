#!/usr/bin/env bash
# The point of SHARDKIT_SEPARATE_COMPILATION: the user's translation unit compiles no transport or store server,
# shardkit_src.cpp's does. Usage: separate_compilation_objects.sh OBJECT... (the test's and shardkit_src's)
set -euo pipefail
user= src=
for o in "$@"; do
  case $(basename "$o") in
    shardkit_src*) src=$o ;;
    *) user=$o ;;
  esac
done
[[ -n $user && -n $src ]] || { echo "FAIL: expected the test's object and shardkit_src's, got: $*"; exit 1; }
defined() { nm -C --defined-only "$1" | grep -cE "$2" || true; }
pattern='shardkit::transport::shm_transport::connect|shardkit::comm::init_process_group|shardkit::rendezvous::tcp_store_server::'
in_user=$(defined "$user" "$pattern")
in_src=$(defined "$src" "$pattern")
echo "symbols matching '$pattern': user object $in_user, src object $in_src"
if [[ $in_user -ne 0 ]]; then
  nm -C --defined-only "$user" | grep -E "$pattern" | head -5
  echo "FAIL: the user's object compiled code that belongs in shardkit_src.cpp"; exit 1
fi
if [[ $in_src -eq 0 ]]; then echo "FAIL: shardkit_src.cpp compiled none of it"; exit 1; fi
echo ok
