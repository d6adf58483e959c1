"""The console script's entry point. It stays this small, and imports typer, rich and the commands
(main.py) only inside `main`, so that an interrupt that arrives while they load still ends in one
line."""

from . import interrupts


def main() -> None:
    import signal
    import sys

    def terminate(signum, frame):  # SIGINT and SIGTERM alike: a KeyboardInterrupt, remembered
        interrupts.interrupted = True
        raise KeyboardInterrupt

    try:
        # both raise KeyboardInterrupt, as Python's own SIGINT handler does, and are remembered: an
        # interrupt that lands inside an import can leave a C extension half loaded, and whatever
        # imports it next fails with an ImportError that is not the command's fault
        signal.signal(signal.SIGINT, terminate)
        signal.signal(signal.SIGTERM, terminate)
        from .main import app

        app()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except SystemExit as e:
        # typer ends a KeyboardInterrupt that reaches it (one that lands while it parses the
        # arguments, before a command's own handling) in exit status 130 with nothing said: say it
        if e.code == 130 and interrupts.interrupted and not interrupts.reported:
            sys.stderr.write("interrupted\n")
        raise
    finally:  # the command is over: a SIGTERM while the interpreter shuts down (which gives its
        # handler back to the default, death by the signal) must not replace the exit status
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
