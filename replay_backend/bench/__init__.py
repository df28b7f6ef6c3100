"""The GPU benchmark: ``replay-backend bench``. It drives the reference model
through the backend and depends on both; nothing in the core imports it."""
