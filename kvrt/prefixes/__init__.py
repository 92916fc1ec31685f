"""Token-prefix indexes shared by every tier that keeps KV by the tokens it holds.

:class:`PrefixTree` finds, in one walk down a radix tree, what a prompt can resume from;
:class:`Eviction` says what leaves first (least recently used, pins never, lower priority
before higher). The engine's host tier, the snapshot cache and the engine's device slots
index their entries with them, so "the longest cached prefix" means one thing and costs
one walk everywhere.
"""

from kvrt.prefixes.eviction import Eviction
from kvrt.prefixes.tree import PrefixTree, TokenIds, common_prefix

__all__ = ["Eviction", "PrefixTree", "TokenIds", "common_prefix"]
