"""Tier 1: the sans-IO core, tested synchronously (no trio, no sockets, no clock)."""
