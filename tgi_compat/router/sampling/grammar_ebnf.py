"""Rewrite xgrammar's EBNF so that bounded repetitions fill their token masks fast.

A JSON schema's `maxLength` string (and a regex's `x{1,8}`, an array's `maxItems`) becomes

    root_prop_0 ::= "\\"" chars{0, 16} "\\""

which xgrammar unrolls into nested `rest_k ::= "" | chars rest_k+1` rules. Each of them may end
empty, so every token that closes the string (`abc"`, `",`) leaves the rule it starts in: its
mask cannot be precomputed, and the matcher replays those tokens through its parser at every step
inside the string (up to milliseconds per row on a 50k-150k vocabulary; xgrammar issue #852).

Folding the closing literal into the chain makes each rule end with it:

    chars_fold0_0 ::= "\\"" | chars chars_fold0_1     (i >= lo: the literal may close here)
    ...
    chars_fold0_16 ::= "\\""                          (i == hi: only the literal is left)

and rules before the lower bound are `chars next` alone. The language is the same by construction
(X{lo,hi} L = X^i L for lo <= i <= hi), and tokens that stay inside the string or close it are now
decided within one rule, so their masks are cached: the fill cost inside such strings drops by one
to two orders of magnitude (BENCHMARKS.md, grammar section). Only repetitions with an upper bound
up to MAX_FOLDED_REPEAT are folded (one rule per count); longer ones keep xgrammar's own form.
"""

from __future__ import annotations

import re

MAX_FOLDED_REPEAT = 128  # xgrammar unrolls up to this bound too (kUnzipThreshold), so the rule count is alike

_IDENTIFIER_CHARS = r"[A-Za-z0-9_.\-]"
_LITERAL = r'"(?:\\.|[^"\\])*"'
# Scanned left to right: literals and character classes are copied whole (a `{` or `"` inside them is
# text), and a rule reference with a bounded repetition followed by a plain literal (no postfix operator
# of its own) is the shape to fold.
_SCAN = re.compile(
    rf"""
    (?P<literal>{_LITERAL})
  | (?P<char_class>\[(?:\\.|[^\]\\])*\])
  | (?<!{_IDENTIFIER_CHARS})(?P<name>[A-Za-z_]{_IDENTIFIER_CHARS}*)\{{(?P<lo>\d+),\s*(?P<hi>\d+)\}}
        \s+(?P<close>{_LITERAL})(?![*+?{{])
  | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)
_RULE_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\-]*)\s*::=", re.MULTILINE)


def fold_bounded_repetitions(ebnf: str, max_repeat: int = MAX_FOLDED_REPEAT) -> str:
    """`ebnf` with every `rule{lo, hi} "literal"` (hi <= max_repeat) replaced by a chain of rules
    that ends in the literal; the grammar accepts exactly the same strings."""
    taken = set(_RULE_NAME.findall(ebnf))
    chains: dict[tuple[str, int, int, str], str] = {}
    new_rules: list[str] = []

    def chain(name: str, lo: int, hi: int, close: str) -> str:
        key = (name, lo, hi, close)
        if key not in chains:
            number = 0
            while f"{name}_fold{number}_0" in taken:
                number += 1
            base = f"{name}_fold{number}"
            taken.update(f"{base}_{i}" for i in range(hi + 1))
            for i in range(hi):
                step = f"{name} {base}_{i + 1}"
                new_rules.append(f"{base}_{i} ::= {step if i < lo else f'{close} | {step}'}")
            new_rules.append(f"{base}_{hi} ::= {close}")
            chains[key] = f"{base}_0"
        return chains[key]

    parts = []
    for match in _SCAN.finditer(ebnf):
        if match["name"] is not None and (hi := int(match["hi"])) <= max_repeat and int(match["lo"]) <= hi:
            parts.append(chain(match["name"], int(match["lo"]), hi, match["close"]))
        else:
            parts.append(match[0])
    if not new_rules:
        return ebnf
    return "".join(parts).rstrip("\n") + "\n" + "\n".join(new_rules) + "\n"
