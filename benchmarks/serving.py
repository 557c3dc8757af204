"""Serving benchmark against a running server: `python benchmarks/serving.py --target HOST:PORT`.

The same as `jaxserve bench serve`; see server/bench.py for what it measures.
"""

import argparse
import sys

from server.bench import add_args, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    sys.exit(main(parser.parse_args()))
