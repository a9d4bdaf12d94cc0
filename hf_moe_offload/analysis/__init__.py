"""Offline analysis of recorded routing: `belady` (eviction policies and Belady's optimum on a recorded trace)."""

from .belady import RoutingRecorder, SimResult, compare, simulate

__all__ = ["RoutingRecorder", "SimResult", "compare", "simulate"]
