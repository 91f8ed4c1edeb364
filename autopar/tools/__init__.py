"""Tools for people, on top of everything: the `autopar` command line (`cli.py`), views of a plan
(`views/`), the communication gate and its pytest helper (`comm_gate.py`, `testing.py`), plan
diffs and the side-by-side compare modes. Nothing in the library imports them."""
