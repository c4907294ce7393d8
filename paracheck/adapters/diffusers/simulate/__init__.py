"""`topology --simulate`: a layout's ranks on meta in one process."""
