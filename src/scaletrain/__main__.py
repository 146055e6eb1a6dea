"""`python -m scaletrain ...`, which is what `torchrun ... -m scaletrain train` runs on each rank."""

import sys

from scaletrain.cli import main

sys.exit(main())
