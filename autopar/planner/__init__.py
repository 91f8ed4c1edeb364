"""The planner: autopar chooses the degrees and strategies itself. `search.py` runs the search
over `search_space.py`; candidates are priced from one block's ledgers (`block_ledgers.py`,
`layout_pricer.py`, `layout_workers.py`) composed to the whole model (`composed_cost.py`,
`composed_memory.py`). `search_report.py` renders a search's answer and ranking; `search_file.py`
saves it (`autopar plan --auto --save`) for `autopar explain` to read without searching again."""
