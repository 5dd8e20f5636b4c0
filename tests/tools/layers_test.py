#!/usr/bin/env python3
"""Every header under include/shardkit/<layer>/ includes shardkit headers of its own layer and of the layers below
it only (docs/design.md, "Layers"): data flows down, and no two layers include each other.

    layers_test.py SOURCE_DIR

Prints each include that goes up or sideways (file, line, the layer it reaches) and exits 1 when there is one.
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
# Known exceptions, each with the reason it is still here (issue 31, item 1 moves these adapters beside the concept
# they model, over a cuda/ layer).
EXCEPTIONS = {
    ("backends/nccl/cuda_gather_device.hpp", "fsdp"),
    ("backends/nccl/cuda_checkpoint_device.hpp", "ckpt"),
}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]shardkit/([a-z_]+)/')


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
            for number, line in enumerate(header.read_text(encoding="utf-8").splitlines(), 1):
                m = INCLUDE.match(line)
                if not m or m.group(1) == layer or m.group(1) in MAY_INCLUDE[layer]:
                    continue
                if (rel, m.group(1)) in EXCEPTIONS:
                    continue
                problems.append(f"include/shardkit/{rel}:{number}: {layer}/ includes {m.group(1)}/, "
                                f"which is not below it ({line.strip()})")
    for p in problems:
        print(p)
    print(f"layers: {len(layers)} folders checked, {len(problems)} includes against the layer order")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
