"""The compiler: a model and a mesh in, a `Plan` out. In layer order: tracing and the compile context
(`trace.py`, `context.py`), sharding rules (`rules/`), the passes (`passes/`, one per file), the
strategies as data (`strategies/`), the ledgers read off the emitted program (`ledger/`), and on top
the driver (`plan.py`), the plan-time check (`check_rank_graphs.py`) and the plan document
(`plan_file.py`)."""
