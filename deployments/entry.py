"""The ``ditserve`` console script's entry point.

It imports nothing but the standard library before :func:`deployments.cli.main`'s module, so
a Ctrl-C (or SIGTERM) while Python imports the CLI's dependencies (pydantic, yaml, Ray's schema:
about 0.2 s) ends it as one later does: one ``interrupted`` line on stderr and exit 130, not a
traceback of whatever module was being imported."""

from __future__ import annotations

import signal
import sys


def main() -> int:
    """Run ``ditserve`` (:func:`deployments.cli.main` on ``sys.argv``); exit status 130 (128 +
    SIGINT, as a shell reports Ctrl-C) when interrupted before the CLI's own handling starts."""

    def interrupt(*_) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)  # the CLI sets its own once imported
    try:
        from deployments.cli import main as cli_main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    try:
        return cli_main()
    except KeyboardInterrupt:  # between the import and the command's own handling (argparse)
        print("interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
