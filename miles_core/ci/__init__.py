"""CI as a concern: test registration, suites, sharding, runner and workflow generation."""
