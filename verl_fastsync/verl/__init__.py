"""Everything that knows verl releases: the import hook, the per-release patches, the checkpoint engine."""
