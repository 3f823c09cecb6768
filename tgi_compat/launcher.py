"""`python -m tgi_compat.launcher`: the TGI launcher under its earlier module name (the code is
tgi_compat.api.cli.launcher; the `text-generation-launcher` script points there)."""

import sys

from tgi_compat.api.cli.launcher import main

if __name__ == "__main__":
    sys.exit(main())
