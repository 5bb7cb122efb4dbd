"""pdserve's own CPU kernels, compiled from C++ on the machine that runs them (see native.py)."""
