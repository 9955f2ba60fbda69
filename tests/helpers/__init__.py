"""What several test files share (tests/ is on sys.path through its conftest.py): reference implementations,
small checkpoints, inputs, and the functions spawned ranks run."""
