# Bundles of prebuilt binaries for a bare host (scripts/gpu-check, scripts/host-bench): where a binary lies in a build
# dir, which of its shared libraries go with it, and the xz'd tarball the device machine takes (64 MiB in all, carry
# included, so a bundle is refused above 60 MiB). Sourced.
#
#   shardkit_find_binary DIR NAME SUBDIR...    prints DIR/SUBDIR/NAME for the first SUBDIR holding it executable
#   shardkit_bundle_libs BIN [SKIP]            prints the paths of the shared libraries BIN loads (ldd: its own and
#                                              theirs) but glibc's and those whose soname matches a glob of SKIP
#                                              ("libcuda.so*|libnvidia*": the host's own)
#   shardkit_bundle_add BIN DEST LIST [SKIP]   copies BIN to DEST/bin and its libraries to DEST/lib (each once),
#                                              saying each; LIST=1 says them only (empty files stand in for the libs)
#   shardkit_bundle_write STAGE NAME OUT       writes STAGE/NAME to OUT (tar, xz), says its size, returns 1 above 60 MiB
# shellcheck shell=bash

# glibc's libraries: the host's own loader must match them, so they are never bundled.
shardkit_bundle_glibc='libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libutil.so*|libresolv.so*|libanl.so*|libnss_*'

shardkit_find_binary() {
  local dir=$1 name=$2 d
  shift 2
  for d in "$@"; do
    [ -f "$dir/$d/$name" ] && [ -x "$dir/$d/$name" ] && { echo "$dir/$d/$name"; return 0; }
  done
  return 1
}

shardkit_bundle_libs() {
  local bin=$1 soname path glob skip globs=()
  IFS='|' read -r -a globs <<<"$shardkit_bundle_glibc${2:+|$2}"
  ldd "$bin" 2>/dev/null | awk '/=> \// {print $1 " " $3}' | while read -r soname path; do
    skip=0
    for glob in "${globs[@]}"; do
      # shellcheck disable=SC2053
      [[ $soname == $glob ]] && { skip=1; break; }
    done
    [ "$skip" = 1 ] || echo "$path"
  done
}

shardkit_bundle_add() {
  local bin=$1 dest=$2 list=$3 skip=${4:-} lib name
  mkdir -p "$dest/bin" "$dest/lib"
  echo "   bin/$(basename "$bin")"
  [ "$list" = 1 ] || cp -L "$bin" "$dest/bin/" || return 1
  for lib in $(shardkit_bundle_libs "$bin" "$skip"); do
    name=$(basename "$lib")
    [ -e "$dest/lib/$name" ] && continue
    echo "   lib/$name  ($lib)"
    if [ "$list" = 1 ]; then touch "$dest/lib/$name"; else cp -L "$lib" "$dest/lib/$name" || return 1; fi
  done
}

shardkit_bundle_write() {
  local stage=$1 name=$2 out=$3 bytes
  mkdir -p "$(dirname "$out")" || return 1
  tar -C "$stage" -cf - "$name" | xz -T"${JOBS:-2}" -6 >"$out" || { echo "   could not write $out" >&2; return 1; }
  bytes=$(stat -c %s "$out")
  echo "== $out: $((bytes / 1048576)) MiB ($bytes bytes), commit $(cat "$stage/$name/COMMIT" 2>/dev/null), $(cat "$stage/$name/BUILD_TYPE" 2>/dev/null) build"
  [ "$bytes" -le $((60 * 1048576)) ] ||
    { echo "   $out is $((bytes / 1048576)) MiB, over 60 MiB: the device machine takes 64 MiB in all" >&2; return 1; }
}

# Where a GPU host keeps what a bundle never carries: NCCL (unless packed with --with-nccl) and cuBLAS (over 500 MB
# with cublasLt; the trainer's --device cuda opens it at run time): the CUDA install, the distribution's libraries,
# or pip's nvidia-* wheels. Sets shardkit_gpu_ld (the bundle's lib dir $1 first, then those folders; ':'-joined) and
# shardkit_gpu_cublas (the folder cuBLAS was found in, or empty).
shardkit_gpu_host_libs() {
  local d ld=$1
  shardkit_gpu_cublas=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu /usr/local/nccl/lib; do
    [ -e "$d/libnccl.so.2" ] && ld="$ld:$d"
  done
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
    [ -z "$shardkit_gpu_cublas" ] && compgen -G "$d/libcublas.so.[0-9]*" >/dev/null && { shardkit_gpu_cublas=$d; ld="$ld:$d"; }
  done
  for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
    [ -e "$d/nvidia/nccl/lib/libnccl.so.2" ] && ld="$ld:$d/nvidia/nccl/lib"
    [ -z "$shardkit_gpu_cublas" ] && compgen -G "$d/nvidia/cublas/lib/libcublas.so.[0-9]*" >/dev/null &&
      { shardkit_gpu_cublas=$d/nvidia/cublas/lib; ld="$ld:$shardkit_gpu_cublas"; }
  done
  shardkit_gpu_ld=${ld#:}
}
