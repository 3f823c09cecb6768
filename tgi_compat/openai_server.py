"""`python -m tgi_compat.openai_server`: the AIAK/vLLM-style entry point under a short name (the code is
tgi_compat.api.cli.openai_server; the `tgi-compat-serve` script points there)."""

import sys

from tgi_compat.api.cli.openai_server import main

if __name__ == "__main__":
    sys.exit(main())
