"""The launcher side (torch-free): the run protocol, starting and watching worlds, attribution."""
