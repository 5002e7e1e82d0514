#!/usr/bin/env python3
"""Turns a text file into a token shard train_gpt --data reads (samples/tokens.hpp): the
byte-level tokenizer (each byte is one token id, vocabulary 256), uint16 ids (or uint32 with
--uint32), the header llm.c's .bin files use plus the vocabulary size in word 3.

usage: make_shard.py TEXT OUT.bin [--uint32]
"""
import struct
import sys


def main():
    args = [a for a in sys.argv[1:] if a != "--uint32"]
    if len(args) != 2:
        sys.stderr.write(__doc__)
        return 2
    wide = "--uint32" in sys.argv[1:]
    with open(args[0], "rb") as f:
        ids = f.read()
    if len(ids) >= 2**31:
        sys.stderr.write(f"make_shard.py: {args[0]} has {len(ids)} bytes; a shard holds fewer than 2^31 tokens\n")
        return 2
    magic, version, fmt = (20240801, 7, "<%dI") if wide else (20240520, 1, "<%dH")
    header = [magic, version, len(ids), 256] + [0] * 252
    with open(args[1], "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(fmt % len(ids), *ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
