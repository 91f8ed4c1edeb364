"""What a plan leaves behind and reads back: the plan as bytes between ranks (`plan_codec.py`),
runnable plan files and plan-once (`plan_once.py`), sharded checkpoints (`checkpoint.py`)."""
