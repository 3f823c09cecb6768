"""`python -m tgi_compat.api.cli.openai_server` / `tgi-compat-serve MODEL`: AIAK's (vLLM-style) entry point
and server arguments, TGI's server.

    tgi-compat-serve /data/Meta-Llama-3-8B-Instruct --port 8000 -tp 1 --max-model-len 8192 \\
        --max-num-seqs 128 --gpu-memory-utilization 0.9 --enable-prefix-caching

The arguments are mapped onto the launcher's ServerConfig (tgi_compat/api/cli/aiak_args.py) and the very same
server starts (`tgi_compat.api.server.serve`): same routes, same wire format, same engine.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from tgi_compat.api.cli.aiak_args import AiakArgsError, parse_config
from tgi_compat.api.observability.logging_setup import configure_logging

logger = logging.getLogger("tgi_compat.openai_server")


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging(False)
    try:
        config = parse_config(argv)
    except AiakArgsError as error:
        logger.error("%s", error)
        return 1
    from tgi_compat.api.server.process import serve  # heavy imports only once the arguments are valid

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
