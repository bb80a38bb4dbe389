import sys

try:
    from distmis.cli.main import run
except KeyboardInterrupt:  # Ctrl-C while the command is still being imported
    import os

    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)

run()
