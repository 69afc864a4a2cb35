"""The argument parser of every ``kvcache`` command (``replay``, ``transfer bench``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from _typeshed import SupportsWrite


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump), like every other error of the
    command, and a failed write of help or usage reaches ``kvcache.cli.main``, which reports
    it as for any other output (argparse drops it: ``--help`` into a full disk exited 0)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        stream = file or sys.stderr
        if message and stream is not None:
            stream.write(message)
