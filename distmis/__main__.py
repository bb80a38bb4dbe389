import sys

try:
    from distmis.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the command is still being imported
    print("interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
