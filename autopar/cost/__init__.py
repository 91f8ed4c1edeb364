"""The cost model: the cluster a plan runs on (`cluster.py`, measured by `calibration.py`), a
plan's communication priced on it (`comm_cost.py`) and its step time and peak memory
(`step_cost.py`), all read off the compiler's ledgers."""
