"""The rank loop, which knows no library: join a world, hand each case to its adapter, report, fail fast."""
