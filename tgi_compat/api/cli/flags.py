"""The vocabulary of the launchers' flags: a TGI flag's declaration (`Flag`: its name, environment variable and
value type) and the value parsers TGI's clap parser has (its falsey spellings, true|false, comma lists,
choices), shared by the TGI launcher and the LightLLM and AIAK argument sets that translate onto it."""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FALSEY = {"n", "no", "f", "false", "off", "0", ""}


def bool_env(value: str) -> bool:
    # clap's FalseyValueParser: a handful of spellings mean false, anything else true.
    return value.strip().lower() not in FALSEY


def true_false(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"invalid value '{value}' (possible values: true, false)")
    return lowered == "true"


def cuda_graph_sizes(value: str) -> list[int]:
    sizes = [int(part) for part in value.split(",") if part.strip()]
    return [] if sizes == [0] else sizes


def int_list(value: str) -> list[int]:
    return [int(part) for part in value.split(",") if part.strip()]


def choice(*choices: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in choices:
            raise argparse.ArgumentTypeError(f"invalid value '{value}' (possible values: {', '.join(choices)})")
        return value

    return parse


@dataclass(frozen=True)
class Flag:
    name: str  # long flag without dashes, e.g. "max-total-tokens"
    help: str
    type: Callable[[str], Any] | None = None  # None: value-less presence flag
    default: Any = None
    short: str | None = None
    repeatable: bool = False

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return self.dest.upper()


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
