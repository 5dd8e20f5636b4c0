#!/usr/bin/env python3
"""Every ```cpp block of README.md and docs/*.md compiles (ctest doc_examples, label package).

A block is one of:
  - a whole program or file: no annotation; compiled as it is, in a translation unit of its own;
  - a fragment: an HTML comment on the line before the fence (invisible when rendered) gives its context,
        <!-- doc-example: prelude=NAME scope=function|namespace requires=s3,nccl -->
    prelude=NAME is tests/tools/doc_examples/NAME.hpp: #include lines, then the declarations the fragment assumes
    (its variables, as extern, and the user's functions, with the right types). scope=function (the default) puts
    the fragment in a function body, scope=namespace at namespace scope. The block's own #include lines go to the
    top of the file. The fragments of one doc share one translation unit, each in a namespace of its own;
  - checked elsewhere: <!-- doc-example: verbatim=PATH --> says the block is the file PATH, compiled and run by its
    own target; this test checks only that the block is PATH's text.
requires=A,B (any kind) skips the block, saying why, when the build has no shardkit::A target.
A block with no annotation that is not a whole program fails like any other: a new block cannot escape.

#line directives map every diagnostic to the doc's line (or the prelude's), so a failure reads
"docs/fsdp.md:24:3: error: ...", followed by a FAIL line naming the doc and the block's fence line.

Blocks are only parsed (-fsyntax-only, SHARDKIT_SEPARATE_COMPILATION: the transports' bodies are declarations),
so the test costs a few seconds of CPU, not a build.

usage: doc_examples.py --source-dir SRC --work-dir DIR --flags-file FILE --backends tcp,gloo,... --have tcp,...
                       CXX [DOC...]
"""
import argparse
import concurrent.futures
import pathlib
import re
import shlex
import subprocess
import sys
import time

FENCE_OPEN = re.compile(r"^\s*```cpp\s*$")
FENCE_CLOSE = re.compile(r"^\s*```\s*$")
ANNOTATION = re.compile(r"^\s*<!--\s*doc-example:(.*?)-->\s*$")
INCLUDE = re.compile(r"^\s*#\s*include\b")
KEYS = {"prelude", "scope", "verbatim", "requires"}
PRELUDE_DIR = "tests/tools/doc_examples"


class Block:
    def __init__(self, doc, fence, close, lines, options):
        self.doc = doc          # path relative to the source dir, as diagnostics name it
        self.fence = fence      # 1-based line of the ```cpp fence
        self.close = close      # 1-based line of the closing fence
        self.lines = lines      # the code, without the fences
        self.options = options  # the annotation's key=value pairs

    @property
    def where(self):
        return f"{self.doc}:{self.fence}"


def parse_annotation(text, where):
    options = {}
    for word in text.split():
        key, eq, value = word.partition("=")
        if key not in KEYS or not eq or not value:
            raise ValueError(f"{where}: doc-example annotation: '{word}' is not one of "
                             f"{', '.join(sorted(k + '=...' for k in KEYS))}")
        options[key] = value
    if not options:
        raise ValueError(f"{where}: empty doc-example annotation")
    if options.get("scope", "function") not in ("function", "namespace"):
        raise ValueError(f"{where}: scope= is function or namespace, not {options['scope']}")
    if "verbatim" in options and len(options) > 1 + ("requires" in options):
        raise ValueError(f"{where}: verbatim= takes no prelude= or scope=")
    return options


def parse_doc(src, rel):
    lines = (src / rel).read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not FENCE_OPEN.match(lines[i]):
            i += 1
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        annotation = ANNOTATION.match(lines[j]) if j >= 0 else None
        options = parse_annotation(annotation.group(1), f"{rel}:{j + 1}") if annotation else {}
        k = i + 1
        while k < len(lines) and not FENCE_CLOSE.match(lines[k]):
            k += 1
        if k == len(lines):
            raise ValueError(f"{rel}:{i + 1}: ```cpp block is never closed")
        blocks.append(Block(rel, i + 1, k + 1, lines[i + 1:k], options))
        i = k + 1
    return blocks


def c_string(path):
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'


def whole_file_unit(block):
    """A whole program: as it is, its lines numbered as in the doc."""
    return [f"#line {block.fence + 1} {c_string(block.doc)}", *block.lines, ""]


def split_includes(lines):
    """(#include lines with their 1-based numbers, the lines with those blanked so numbering stays)."""
    includes = [(n, line) for n, line in enumerate(lines, 1) if INCLUDE.match(line)]
    rest = ["" if INCLUDE.match(line) else line for line in lines]
    return includes, rest


def fragments_unit(src, blocks):
    """The fragments of one doc in one translation unit: every #include first, then each fragment in its own
    namespace (its prelude's declarations, then its code in a function body or at namespace scope)."""
    head, body = [], []
    for b in blocks:
        includes, code = split_includes(b.lines)
        head += [f"#line {b.fence + n} {c_string(b.doc)}\n{line}" for n, line in includes]
        name = b.options.get("prelude")
        prelude = []
        if name:
            path = f"{PRELUDE_DIR}/{name}.hpp"
            if not (src / path).is_file():
                raise ValueError(f"{b.where}: prelude={name}: {path} does not exist")
            includes, prelude = split_includes((src / path).read_text(encoding="utf-8").splitlines())
            head += [f"#line {n} {c_string(path)}\n{line}" for n, line in includes]
        body.append(f"namespace doc_example_line_{b.fence} {{")
        if name:
            body += [f"#line 1 {c_string(path)}", *prelude]
        if b.options.get("scope", "function") == "function":
            body.append("[[maybe_unused]] void example() {")
        body += [f"#line {b.fence + 1} {c_string(b.doc)}", *code]
        if b.options.get("scope", "function") == "function":
            body.append("}")
        body.append("}")
    return head + body + [""]


def compile_unit(cxx, flags, src, path):
    cmd = [cxx, *flags, "-fsyntax-only", "-x", "c++", str(path)]
    run = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
    return run.returncode, run.stdout + run.stderr, cmd


def blame(blocks, output):
    """The blocks whose lines a compiler's output names (an error, or a 'required from here')."""
    named = set()
    for doc, line in re.findall(r"(?m)^([\w./-]+\.md):(\d+):\d+:", output):  # not "included from DOC:LINE"
        for b in blocks:
            if b.doc == doc and b.fence < int(line) < b.close:
                named.add(b)
    return sorted(named, key=lambda b: b.fence)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source-dir", required=True, type=pathlib.Path)
    ap.add_argument("--work-dir", required=True, type=pathlib.Path)
    ap.add_argument("--flags-file", required=True, type=pathlib.Path,
                    help="compiler arguments, one a line (the include dirs, defines and options of the targets)")
    ap.add_argument("--backends", required=True, help="the optional shardkit targets requires= may name")
    ap.add_argument("--have", default="", help="those this build has, comma-separated")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("cxx")
    ap.add_argument("docs", nargs="*", help="docs to check (relative to --source-dir); default README.md docs/*.md")
    args = ap.parse_args()

    src = args.source_dir.resolve()
    have = {t for t in args.have.split(",") if t}
    backends = {t for t in args.backends.split(",") if t}
    flags = [f for f in args.flags_file.read_text().splitlines() if f.strip()]
    docs = args.docs or ["README.md"] + sorted(str(p.relative_to(src)) for p in (src / "docs").glob("*.md"))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    for old in args.work_dir.glob("*.cpp"):
        old.unlink()

    failed, units, counts = [], [], {"compiled": 0, "verbatim": 0, "skipped": 0}
    for rel in docs:
        try:
            blocks = parse_doc(src, rel)
        except ValueError as e:
            failed.append(f"FAIL: {e}")
            continue
        fragments = []
        for b in blocks:
            required = set(b.options.get("requires", "").split(",")) - {""}
            missing = sorted(required - have)
            if required - backends:  # a misspelt target would skip the block in every build
                failed.append(f"FAIL: {b.where}: requires={b.options['requires']}: not among {args.backends}")
            elif missing:
                print(f"skip: {b.where}: needs shardkit::{', shardkit::'.join(missing)}, not in this build")
                counts["skipped"] += 1
            elif "verbatim" in b.options:
                path = src / b.options["verbatim"]
                if not path.is_file():
                    failed.append(f"FAIL: {b.where}: verbatim={b.options['verbatim']} does not exist")
                elif path.read_text(encoding="utf-8").splitlines() != b.lines:
                    failed.append(f"FAIL: {b.where}: the block is not {b.options['verbatim']} (verbatim=)")
                else:
                    print(f"ok: {b.where}: is {b.options['verbatim']}, compiled by its own target")
                    counts["verbatim"] += 1
            elif b.options:
                fragments.append(b)
            else:
                stem = re.sub(r"\W", "_", rel.removesuffix(".md"))
                units.append((args.work_dir / f"{stem}_line_{b.fence}.cpp", [b], whole_file_unit(b)))
        if fragments:
            try:
                text = fragments_unit(src, fragments)
            except ValueError as e:
                failed.append(f"FAIL: {e}")
                continue
            stem = re.sub(r"\W", "_", rel.removesuffix(".md"))
            units.append((args.work_dir / f"{stem}_fragments.cpp", fragments, text))

    for path, _, text in units:
        path.write_text("// Generated by tests/tools/doc_examples.py from the docs' ```cpp blocks: edit the doc.\n"
                        + "\n".join(text))

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda u: compile_unit(args.cxx, flags, src, u[0]), units))
    for (path, blocks, _), (rc, output, cmd) in zip(units, results):
        if rc == 0:
            for b in blocks:
                how = (f"prelude {b.options['prelude']}, " if "prelude" in b.options else "") + \
                    (f"{b.options.get('scope', 'function')} scope" if b.options else "whole file")
                print(f"ok: {b.where}: compiles ({how})")
            counts["compiled"] += len(blocks)
            continue
        print(output, end="")
        print(f"  (in {path}; command: {shlex.join(cmd)})")
        guilty = blame(blocks, output)
        for b in guilty:
            failed.append(f"FAIL: {b.where}: this ```cpp block does not compile (errors above)")
        if not guilty:
            failed.append(f"FAIL: {', '.join(b.where for b in blocks)}: {path.name} does not compile outside the "
                          "blocks' lines (a prelude? errors above)")
    elapsed = time.monotonic() - start

    for line in failed:
        print(line)
    print(f"{'FAILED' if failed else 'OK'}: {len(docs)} docs; blocks: {counts['compiled']} compiled in "
          f"{len(units)} translation units ({elapsed:.1f} s), {counts['verbatim']} checked verbatim, "
          f"{counts['skipped']} skipped; {len(failed)} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
