"""`python -m specdecode.cli`: the `specdecode` command, as `train --nproc` starts it again under
torchrun and the comparisons start a server."""

import sys

from specdecode.cli import main

sys.exit(main())
