import sys

from mtds.cluster.cli import main

sys.exit(main())
