"""Ledgers derived from the emitted program: communication per step (`comm.py`)."""
