#!/usr/bin/env python3
"""One `mergekit-lite merge` in this process, with glibc's own allocator policy ("off": the engine's
`reuse_freed_memory` replaced by a no-op) or the engine's ("on"); run it under /usr/bin/time to compare page
faults and system time (benchmarks/RESULTS.md, allocator A/B).

    /usr/bin/time -v python benchmarks/allocator_ab.py off merge --method dare_ties --base B --model F1:1 ...
"""

import sys

import mergekit_lite.merge.engine as engine
from mergekit_lite.cli.main import main

if __name__ == "__main__":
    mode = sys.argv.pop(1)
    if mode not in ("on", "off"):
        sys.exit("usage: allocator_ab.py on|off merge ARGS...")
    if mode == "off":
        engine.reuse_freed_memory = lambda: False
    sys.argv[0] = "mergekit-lite"
    main()
