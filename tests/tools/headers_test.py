#!/usr/bin/env python3
"""What every header under include/shardkit/ must hold, read as text:
1. it includes shardkit headers of its own layer and of the layers below it only (docs/design.md, "Layers"): data
   flows down, and no two layers include each other;
2. its comments name no commit: a header says what holds and why, and history (which commit fixed what) lives in
   docs/design.md and docs/benchmarks.md, where it does not drift from the code;
3. outside core/detail/ it starts no thread of its own (no std::thread or std::jthread object): every thread the
   library starts is started, stopped and joined through core/detail/worker_threads.hpp;
4. out-of-line bodies have one place, as in Asio: a face header X.hpp declares, its bodies are in impl/X.hpp (and
   impl/X_part.hpp) beside it, private machinery in detail/. No X_impl.hpp sibling, and an out-of-line
   `SHARDKIT_DECL ... Class::member(` body only under an impl/ folder;
5. private parts are in the layer's `detail` namespace (shardkit::<layer>::detail, core's shardkit::detail), a
   component's under a namespace inside it (transport::detail::tcp, comm::algorithms::detail::cross_memory), never
   a namespace of its own spelling (foo_detail); a header that is all private machinery (the first namespace it
   opens is a detail one) sits in a detail/ folder (transport/tcp/detail/, backends/gloo/detail/), so what a
   user includes is what is outside detail/.

    headers_test.py SOURCE_DIR

Prints each violation (file, line, what) and exits 1 when there is one.
"""
import pathlib
import re
import sys

# What each layer may include besides itself; docs/design.md's picture, read bottom-up.
MAY_INCLUDE = {
    "core": set(),
    "cuda": {"core"},
    "codec": {"core"},
    "rendezvous": {"core"},
    "storage": {"core"},
    "transport": {"rendezvous", "core"},
    "backends": {"comm", "transport", "rendezvous", "cuda", "core"},
    "comm": {"transport", "rendezvous", "core"},
    "fsdp": {"comm", "cuda", "core"},
    "ckpt": {"codec", "comm", "storage", "cuda", "core"},
    "data": {"codec", "storage", "core"},
    "bench": {"backends", "comm", "transport", "rendezvous", "core"},
    "impl": {"ckpt", "data", "fsdp", "comm", "backends", "transport", "storage", "rendezvous", "codec", "cuda", "core"},
}
# Known exceptions, each with the reason it is still here: (header relative to include/shardkit, layer reached).
EXCEPTIONS: set[tuple[str, str]] = set()
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]shardkit/([a-z_]+)/')
# A commit as a comment names it: 7 to 12 (abbreviated) or 40 hex digits with a letter and a digit, standing alone
# (not 0x..., not part of a longer word, number or checksum).
COMMENT = re.compile(r'//(.*)$')
# A thread object, not std::thread::id or std::thread::hardware_concurrency.
THREAD = re.compile(r'\bstd::(?:jthread|thread)\b(?!::)')
THREAD_OWNER = "core/detail/"
DETAIL_SPELLING = re.compile(r'^\s*namespace\s+(?:[\w:]*::)?(\w+_detail)\b')
# The first namespace a header opens: a private header (its first namespace is a detail one) lives in a detail/ folder.
FIRST_NAMESPACE = re.compile(r'^\s*namespace\s+([\w:]+)\s*\{')
OUT_OF_LINE = re.compile(r'^SHARDKIT_DECL [^(]*?\b[A-Za-z_]\w*(?:::~?[A-Za-z_]\w*)+\(')
COMMIT = re.compile(r'(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])(?:[0-9a-f]{40}|[0-9a-f]{7,12})(?![\w.])')


def main() -> int:
    root = pathlib.Path(sys.argv[1]) / "include" / "shardkit"
    problems = []
    layers = sorted(p.name for p in root.iterdir() if p.is_dir())
    for layer in layers:
        if layer not in MAY_INCLUDE:
            problems.append(f"include/shardkit/{layer}/: a layer this test does not know; add it to MAY_INCLUDE "
                            "and to docs/design.md's picture")
            continue
        for header in sorted((root / layer).rglob("*.hpp")):
            rel = header.relative_to(root).as_posix()
            if header.name.endswith("_impl.hpp"):
                problems.append(f"include/shardkit/{rel}: an X_impl.hpp sibling: bodies go to impl/ beside the face header")
            in_impl = "/impl/" in f"/{rel}"
            body_named = False  # one problem per header for its out-of-line bodies
            first_namespace = None
            for number, line in enumerate(header.read_text(encoding="utf-8").splitlines(), 1):
                comment = COMMENT.search(line)
                if comment and COMMIT.search(comment.group(1)):
                    problems.append(f"include/shardkit/{rel}:{number}: a comment names a commit "
                                    f"({COMMIT.search(comment.group(1)).group(0)}): history goes to docs/design.md")
                code = line[:comment.start()] if comment else line
                if not in_impl and not body_named and OUT_OF_LINE.match(code):
                    body_named = True
                    problems.append(f"include/shardkit/{rel}:{number}: an out-of-line body outside impl/ "
                                    f"({code.strip()[:60]}...): move it to impl/ beside its face header")
                if not rel.startswith(THREAD_OWNER) and THREAD.search(code):
                    problems.append(f"include/shardkit/{rel}:{number}: a thread of its own "
                                    f"({THREAD.search(code).group(0)}): start it through "
                                    "core/detail/worker_threads.hpp (owned_thread, worker_threads, run_on_threads)")
                opened = FIRST_NAMESPACE.match(code)
                if opened and first_namespace is None:
                    first_namespace = opened.group(1)
                    private = "detail" in first_namespace.split("::")
                    if private and "/detail/" not in f"/{rel}" and not in_impl:
                        problems.append(f"include/shardkit/{rel}:{number}: private machinery (namespace "
                                        f"{first_namespace}) outside a detail/ folder: move it to detail/ beside "
                                        "the face header that uses it")
                spelled = DETAIL_SPELLING.match(code)
                if spelled:
                    problems.append(f"include/shardkit/{rel}:{number}: namespace {spelled.group(1)}: private parts go "
                                    "to the layer's detail namespace (detail::<component>)")
                m = INCLUDE.match(line)
                if not m or m.group(1) == layer or m.group(1) in MAY_INCLUDE[layer]:
                    continue
                if (rel, m.group(1)) in EXCEPTIONS:
                    continue
                problems.append(f"include/shardkit/{rel}:{number}: {layer}/ includes {m.group(1)}/, "
                                f"which is not below it ({line.strip()})")
    for p in problems:
        print(p)
    print(f"headers: {len(layers)} layers checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
