import sys

from mtds.gpucheck.cli import main

if __name__ == "__main__":
    sys.exit(main())
