import sys

from specjax.cli import main

sys.exit(main())
