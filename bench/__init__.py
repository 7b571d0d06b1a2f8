"""Side-by-side benchmark: our router, the Rust gateway (smg) and direct calls, against one
fake fleet, in interleaved rounds. `python -m bench --help` describes the run.
"""
