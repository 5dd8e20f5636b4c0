#!/usr/bin/env bash
# The point of SHARDKIT_SEPARATE_COMPILATION: the user's translation unit compiles no transport, store server or
# out-of-line member of the classes whose bodies live in an impl/ header (sharded_model, checkpointer, loader);
# shardkit_src.cpp's does. Usage: separate_compilation_objects.sh OBJECT... IMPL_HEADER... (the test's object and
# shardkit_src's, or src/compiled.cpp's where the build has libshardkit, and the impl/ headers whose members to look for, with any part they include, e.g.
# fsdp/impl/sharded_model_passes.hpp). Every `SHARDKIT_DECL ... Class::member(` or `SHARDKIT_DECL ... function(`
# definition of an impl header is a pattern (under the header's first namespace, or one namespace inside it: detail,
# or storage's inline with_s3): a member added to one is checked without touching this script.
set -euo pipefail
user= src= members=()
for f in "$@"; do
  case $(basename "$f") in
    shardkit_src* | compiled.cpp.o) src=$f ;;
    *.hpp)
      ns=$(grep -m1 -oP '^namespace \K[A-Za-z_:]+(?= \{)' "$f")
      mapfile -t found < <(grep -oP '^SHARDKIT_DECL .*?\K\b[A-Za-z_]\w*(::~?[A-Za-z_]\w*)*(?=\()' "$f" | sort -u)
      [[ ${#found[@]} -gt 0 ]] || { echo "FAIL: no SHARDKIT_DECL member definitions in $f"; exit 1; }
      for m in "${found[@]}"; do members+=("$ns|$m"); done ;;
    *) user=$f ;;
  esac
done
[[ -n $user && -n $src ]] || { echo "FAIL: expected the test's object and shardkit_src's, got: $*"; exit 1; }
# Each object's symbols are read once (nm per member took tens of seconds), as the shardkit names they define up to
# their parameter list, each once: libshardkit's object (-O0, every inline body emitted) has 48,000 symbols, 29 MB
# demangled, and a grep of that per member took 4 minutes. Every pattern below names shardkit:: and ends at the '('.
defined_names() { nm -C --defined-only "$1" | sed -E 's/^[0-9a-f]* *[A-Za-z] //; s/\(.*$/(/' | grep -F 'shardkit::' | sort -u; }
user_syms=$(defined_names "$user") src_syms=$(defined_names "$src")
defined() { grep -cE "$2" <<<"$1" || true; }
check() {  # what, pattern: none of it in the user's object, some of it in shardkit_src's
  local in_user in_src
  in_user=$(defined "$user_syms" "$2")
  in_src=$(defined "$src_syms" "$2")
  echo "$1: user object $in_user, src object $in_src"
  if [[ $in_user -ne 0 ]]; then
    grep -E "$2" <<<"$user_syms" | head -5
    echo "FAIL: the user's object compiled code that belongs in shardkit_src.cpp"; exit 1
  fi
  if [[ $in_src -eq 0 ]]; then echo "FAIL: shardkit_src.cpp compiled none of $1"; exit 1; fi
}
check transports 'shardkit::transport::shm_transport::connect|shardkit::comm::init_process_group|shardkit::rendezvous::tcp_store_server::'
check sinks 'shardkit::storage::(s3_sink|posix_sink|memory_sink)::'
# Each member on its own: an inline body left in a header (or one the impl stops defining) is named.
# (A return type of std::string gives the name an ABI tag: full_state[abi:cxx11](int).)
for m in "${members[@]}"; do
  check "${m/|/::}" "(^| )${m%%|*}::([a-z_0-9]+::)?${m#*|}(\\[abi:[^]]+\\])*\\("
done
echo "ok: ${#members[@]} out-of-line members checked"
