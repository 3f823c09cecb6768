"""`python -m tgi_compat.api_server`: the LightLLM-style entry point under its documented name
(the code is tgi_compat.api.cli.api_server)."""

import sys

from tgi_compat.api.cli.api_server import main

if __name__ == "__main__":
    sys.exit(main())
