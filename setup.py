"""The package's one C extension; everything else is in pyproject.toml.

The block index's table (services/scheduler/_hashtable.c). Optional: where it cannot be
compiled (no C compiler or no Python headers) the install goes on without it and the
index keeps its hashes in dicts instead (services/scheduler/block_index.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("prefixmesh.services.scheduler._hashtable",
                             ["services/scheduler/_hashtable.c"], optional=True)])
