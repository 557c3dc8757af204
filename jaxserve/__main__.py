"""The `jaxserve` command (and `python -m jaxserve`): restarts itself once so that its
malloc asks for huge pages (jaxserve/huge_pages.py), before the command line's imports,
then runs it (jaxserve/cli.py)."""

import sys

from jaxserve.huge_pages import restart_with_huge_pages


def main() -> int:
    restart_with_huge_pages()
    from jaxserve.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
