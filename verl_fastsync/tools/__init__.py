"""Tools for people: the CLI, doctor, bench and the synthetic models. No verl process imports this package."""
