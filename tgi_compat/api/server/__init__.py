"""The API process: app assembly, shared state, lifecycle, shutdown, health, auth, permits, warm-up."""
