"""`python -m tgi_compat.api.cli.api_server`: LightLLM's entry point and flags, TGI's server.

    python -m tgi_compat.api.cli.api_server --model_dir /data/llama --max_total_token_num 120000 \\
        --tp 1 --port 8080 --long_truncation_mode head --token_healing_mode

The flags are mapped onto the launcher's ServerConfig (tgi_compat/api/cli/lightllm_args.py) and the very
same server starts (`tgi_compat.api.server.serve`): same routes, same wire format, same engine.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from tgi_compat.api.cli.launcher import unimplemented_options
from tgi_compat.api.cli.lightllm_args import LightLLMArgsError, parse_config
from tgi_compat.api.observability.logging_setup import configure_logging

logger = logging.getLogger("tgi_compat.api_server")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, unbuilt, print_env = parse_config(argv)
    except LightLLMArgsError as error:
        configure_logging(False)
        logger.error("%s", error)
        return 1
    configure_logging(config.json_output)
    if print_env:
        logger.info("Runtime environment: python %s, %s", sys.version.split()[0], sys.platform)
    missing = unbuilt + unimplemented_options(config)
    if missing:
        logger.warning("These options are accepted but not implemented yet and have no effect: %s", "; ".join(missing))
    logger.info(
        "LightLLM flags mapped: KV slots=%s, batch_max_tokens=%s, max_input_tokens=%s, max_total_tokens=%s, "
        "running_max_req_size=%s",
        config.max_batch_total_tokens,
        config.max_batch_prefill_tokens,
        config.max_input_tokens,
        config.max_total_tokens,
        config.max_batch_size,
    )
    from tgi_compat.api.server.process import serve  # heavy imports only once the flags are valid

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
