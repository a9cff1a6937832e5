from sim.kv.events import EventLog
from sim.kv.manager import KVManager, PrefixMatch
from sim.kv.pool import BlockPool, PoolIntegrityError

__all__ = ["BlockPool", "EventLog", "KVManager", "PoolIntegrityError", "PrefixMatch"]
