"""A child for tests/test_child_process.py: says where it runs, echoes, exits as told."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    print(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "env": os.environ.get("ECHO_ENV")}))
    sys.stdout.flush()
    print("to stderr", file=sys.stderr)
    for line in sys.stdin:
        if line.strip() == "raise":
            raise RuntimeError("asked to fail")
        print(line.strip().upper(), flush=True)
    sys.exit(spec.get("exit", 0))
