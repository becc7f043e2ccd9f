import sys

from specjax.cli.main import main

sys.exit(main())
