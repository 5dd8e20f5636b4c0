# Sanitizer builds for scripts/test --sanitize. Sourced by scripts/test.

# shardkit_sanitizer_env address|thread: sets shardkit_sanitizer_flags (compile and link flags) and exports the
# runtime options. Every report stops the test that made it (halt_on_error), so a finding is a failed test,
# never a line lost in a passing test's log.
shardkit_sanitizer_env() {
  local root
  root=$(pwd)
  case "$1" in
    address)
      # UBSan rides along: -fno-sanitize-recover makes each undefined-behaviour report fatal. GCC 12 turns a
      # pointer's comparison with null inside a consteval function into a non-constant expression when the null
      # or nonnull-attribute checks are on (settings.hpp's `declared` fails to compile), so those three are off;
      # a null dereference is still a SEGV that ASan reports with its stack.
      shardkit_sanitizer_flags="-fsanitize=address,undefined -fno-sanitize=null,nonnull-attribute,returns-nonnull-attribute -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
      # detect_leaks: LeakSanitizer at exit; it cannot run under ptrace (a debugger, strace), then pass
      # ASAN_OPTIONS=detect_leaks=0. detect_stack_use_after_return stays off: the coroutine frames and Asio's
      # handlers make it slow, and heap use-after-free is what matters here.
      export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:strict_string_checks=1:check_initialization_order=1:detect_odr_violation=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
      export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
      export LSAN_OPTIONS="suppressions=$root/scripts/lib/lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
      ;;
    thread)
      shardkit_sanitizer_flags="-fsanitize=thread -fno-omit-frame-pointer"
      export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$root/scripts/lib/tsan.supp${TSAN_OPTIONS:+:$TSAN_OPTIONS}"
      ;;
  esac
}

# shardkit_build_selected_tests BUILD [ctest args...]: with a ctest filter among the arguments, builds only the
# binaries the selected tests run (a test named after a target, or whose command or arguments name one); otherwise,
# or when a selected test installs the project (the package tests), everything.
shardkit_build_selected_tests() {
  local build=$1
  shift
  local filtered=0 a
  for a in "$@"; do
    case "$a" in -L|-R|-E|-LE|--label-regex|--tests-regex|--exclude-regex|--label-exclude|-L*|-R*|-E*) filtered=1 ;; esac
  done
  if ((!filtered)); then
    cmake --build "$build" -j "$(nproc)"
    return
  fi
  local targets
  targets=$(ninja -C "$build" -t targets all | sed -n 's/^\([A-Za-z0-9_.+-]*\): \(phony\|CXX_EXECUTABLE_LINKER\).*/\1/p' | sort -u)
  local wanted
  wanted=$(ctest --test-dir "$build" -N --show-only=json-v1 "$@" | python3 -c '
import json, os, sys
targets = set(sys.argv[1].split())
out = set()
for t in json.load(sys.stdin).get("tests", []):
    # A package test installs the project first: that needs every installed target.
    if any("run_consumer.cmake" in w or "run_pkgconfig.sh" in w for w in t.get("command") or []):
        print("all")
        sys.exit(0)
    # Before a binary exists ctest lists no command for it; add_test names it after its target.
    words = [t["name"]] + list(t.get("command") or [])
    for p in t.get("properties", []):
        if p.get("name") in ("ENVIRONMENT", "REQUIRED_FILES"):
            words += [v.split("=", 1)[-1] for v in p.get("value", [])]
    for w in words:
        b = os.path.basename(w)
        if b in targets:
            out.add(b)
print(" ".join(sorted(out)))
' "$targets")
  if [[ -z "$wanted" ]]; then
    echo "scripts/test: the filter selects no test binary to build" >&2
    return
  fi
  # shellcheck disable=SC2086
  cmake --build "$build" -j "$(nproc)" --target $wanted
}
