"""The ``clef-export`` entry point: the signal handlers first, before anything heavy is imported
(typer, rich, torch), so Ctrl-C is exit 130 from the first moment of the command; then the CLI."""

from __future__ import annotations


def main() -> None:
    from .interrupts import install

    install()
    from .cli import main as cli_main

    cli_main()
