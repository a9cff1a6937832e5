from sim.kv.events import EventLog
from sim.kv.manager import KVManager
from sim.kv.pool import BlockPool, PoolIntegrityError
from sim.kv.prefix import PrefixMatch

__all__ = ["BlockPool", "EventLog", "KVManager", "PoolIntegrityError", "PrefixMatch"]
