"""What a prefix lookup found, handed from `KVManager.match` to `KVManager.admit`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    full: tuple[int, ...]  # cached full blocks matched, in order
    hashes: tuple[int, ...]
    partial_src: int = -1  # cached block whose first `partial_len` tokens match, or -1
    partial_len: int = 0
    # The partially matched block is taken as it is (the request overwrites its tail) rather
    # than copied into a fresh block.
    in_place: bool = False
