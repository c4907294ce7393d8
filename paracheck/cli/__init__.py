"""The command line: `common` (the leaf every command shares), one module per command."""
