"""Guards: a rank that stops making progress (watchdog), replicas that drift apart (weights)."""

from scaletrain.guards.watchdog import Watchdog
from scaletrain.guards.weights import ReplicaCheck

__all__ = ["ReplicaCheck", "Watchdog"]
