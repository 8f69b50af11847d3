"""Engine integrations. Each module here is the only place its engine is imported."""
