"""The fleet: worker records, the registry of live workers and their load, DP rank accounting, the circuit breaker, and active health checks."""
