"""`python -m accel ...` is the same as the `accel` command."""

from accel_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
