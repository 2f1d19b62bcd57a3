"""The test suite as one package: its subpackages (kernels, core, tools, ...) are then tests.kernels etc.,
not top-level names that shadow installed packages (transformers imports the PyPI package `kernels`)."""
