"""Routing policies: pure, synchronous choices among a leg's candidates, the routing keys they read, and the prefix tree behind cache-aware routing."""
