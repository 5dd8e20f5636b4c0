#!/usr/bin/env bash
# scripts/gpu-check's own logic, without a GPU:
# 1. pack and run a bundle of stand-in binaries (one passes, one fails, one skips itself, one is missing, one
#    outlives its time limit): the table says each, the exit status is 1, the logs and summary.md are written;
#    pack builds the suites and, where the build has them, their model twins (a stand-in cmake records it);
# 2. pack --list names the CUDA runtime among the bundled libraries and leaves glibc's and NCCL's out;
# 3. run --model --quick on this build's model twins (nccl_model_test, ...: one model device): every step that
#    has a twin passes (the trainer's --device cuda on its host twin too), the others are marked as not in the dry
#    run, exit status 0.
#   gpu_check_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1
build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# 1. Stand-ins: shell scripts in a fake build tree.
fake="$work/build"
mkdir -p "$fake/tests/nccl" "$fake/tools"
echo "CMAKE_BUILD_TYPE:STRING=Release" >"$fake/CMakeCache.txt"
stand_in() { printf '#!/usr/bin/env bash\n%s\n' "$2" >"$fake/$1"; chmod +x "$fake/$1"; }
stand_in tests/nccl/nccl_pinned_memory_test 'echo "[doctest] Status: SUCCESS!"'
stand_in tests/nccl/ckpt_cuda_test 'echo "[cuda] skipped: no usable CUDA device"; exit 0'
stand_in tests/nccl/nccl_test 'echo "args: $*"; [ -n "${SHARDKIT_TEST_STAGED_RANKS:-}" ] && exit 3; exit 0'
stand_in tools/shardkit-bench 'sleep 30'
stand_in tools/shardkit-run 'exit 0'
# fsdp_nccl_test is missing on purpose; an installed copy elsewhere in the tree (the package test's) is not the one.
mkdir -p "$fake/tests/package/find/prefix/bin"
stand_in tests/package/find/prefix/bin/shardkit-bench 'exit 0'
stand_in tests/package/find/prefix/bin/fsdp_nccl_test 'exit 0'
bash "$src/scripts/gpu-check" pack --build-dir "$fake" --out "$work/bundle.tar.xz" --no-build >"$work/pack.txt" 2>&1 ||
  { cat "$work/pack.txt"; fail "pack of stand-ins"; }
grep -q "fsdp_nccl_test: not built" "$work/pack.txt" || fail "pack did not say what is missing"
status=0
GPU_CHECK_STEP_LIMIT_S=2 bash "$src/scripts/gpu-check" run --bundle "$work/bundle.tar.xz" --out-dir "$work/out" >"$work/run.txt" 2>&1 || status=$?
[ "$status" -eq 1 ] || { cat "$work/run.txt"; fail "run exited $status, not 1 (failures)"; }
row() { grep "^| $1 |" "$work/out/summary.md" || fail "no row for $1"; }
row pinned_memory | grep -q "| passed |" || fail "pinned_memory: $(row pinned_memory)"
row ckpt_cuda | grep -q "| skipped: \[cuda\] skipped: no usable CUDA device |" || fail "ckpt_cuda: $(row ckpt_cuda)"
row nccl_1_rank | grep -q "| passed |" || fail "nccl_1_rank: $(row nccl_1_rank)"
grep -q -- "-tce=\*cuda-staged\*" "$work/out/nccl_1_rank.log" || fail "nccl_1_rank did not leave out the staged cases"
row fsdp_nccl | grep -q "| missing (not built) |" || fail "fsdp_nccl: $(row fsdp_nccl)"
row staged_4_ranks | grep -q "| \*\*failed\*\* (exit 3) |" || fail "staged_4_ranks: $(row staged_4_ranks)"
row bench_nccl | grep -q "| \*\*timed out\*\* after 2 s |" || fail "bench_nccl (tools/'s, not the installed copy): $(row bench_nccl)"
grep -q "^| step | result | seconds | binary | what it checks |" "$work/run.txt" || fail "no table printed"

# 1b. What pack builds: the suites, and their model twins where the build has them, which run --model on that build
#     dir needs (the trainer's host twin stopped coming with the trainer in b6e1986). A stand-in cmake lists the
#     build's targets (FAKE_TARGETS) and records what it is asked to build.
mkdir -p "$work/fakebin"
cat >"$work/fakebin/cmake" <<'EOF'
#!/usr/bin/env bash
if [[ " $* " == *" --target help "* ]]; then printf '%s: phony\n' $FAKE_TARGETS; exit 0; fi
echo "$*" >>"$FAKE_CMAKE_LOG"
EOF
chmod +x "$work/fakebin/cmake"
built() {  # built LOG TARGETS...: pack's build with the stand-in cmake, on a build that has TARGETS
  local log=$1
  shift
  PATH="$work/fakebin:$PATH" FAKE_TARGETS="$*" FAKE_CMAKE_LOG="$log" \
    bash "$src/scripts/gpu-check" pack --build-dir "$fake" --out "$work/built.tar.xz" >"$work/built.txt" 2>&1 ||
    { cat "$work/built.txt"; fail "pack with a stand-in cmake"; }
  [ -s "$log" ] || fail "pack asked the stand-in cmake to build nothing"
}
built "$work/with-model.txt" nccl_test nccl_model_test fsdp_nccl_test ckpt_cuda_test ckpt_cuda_model_test \
  shardkit-bench shardkit_bench_model shardkit-run trainer trainer_cuda_model
for t in nccl_test trainer nccl_model_test ckpt_cuda_model_test shardkit_bench_model trainer_cuda_model; do
  grep -qE "(^| )$t( |$)" "$work/with-model.txt" || fail "pack did not build $t: $(cat "$work/with-model.txt")"
done
! grep -qE "(^| )fsdp_nccl_model_test( |$)" "$work/with-model.txt" || fail "pack built a twin the build does not have"
built "$work/without-model.txt" nccl_test trainer shardkit-bench shardkit-run
! grep -q "_model" "$work/without-model.txt" || fail "pack built a twin without the model: $(cat "$work/without-model.txt")"

# 2. What a real bundle would carry.
bash "$src/scripts/gpu-check" pack --build-dir "$build" --list >"$work/list.txt" 2>&1 || { cat "$work/list.txt"; fail "pack --list"; }
grep -q "lib/libcudart" "$work/list.txt" || fail "the CUDA runtime is not bundled"
! grep -qE "lib/(libc\.so|libnccl|libcuda\.so)" "$work/list.txt" || fail "glibc, NCCL or the driver would be bundled"

# 3. The dry run on the model twins.
status=0
bash "$src/scripts/gpu-check" run --build-dir "$build" --model --quick --out-dir "$work/dry" >"$work/dry.txt" 2>&1 || status=$?
[ "$status" -eq 0 ] || { cat "$work/dry.txt"; fail "the dry run exited $status"; }
row() { grep "^| $1 |" "$work/dry/summary.md" || fail "no row for $1"; }
row pinned_memory | grep -q "not in the dry run" || fail "pinned_memory: $(row pinned_memory)"
for step in ckpt_cuda nccl_1_rank fsdp_nccl staged_4_ranks bench_nccl bench_staged_4 staged_latency trainer_cuda; do
  row "$step" | grep -q "| passed |" || { cat "$work/dry.txt"; fail "$step: $(row "$step")"; }
done
echo "gpu-check: stand-in bundle, pack --list and the model dry run behave"
