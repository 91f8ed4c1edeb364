"""What a plan leaves behind and reads back: the plan as bytes between ranks (`plan_codec.py`),
runnable plan files and plan-once (`plan_once.py`), sharded checkpoints (`checkpoint.py`), and
their files on disk: staging, manifest, atomic commit, verification (`checkpoint_files.py`)."""
