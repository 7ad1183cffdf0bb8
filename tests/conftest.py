"""Shared by every test folder. pytest (rootdir-relative "prepend" imports, no ``__init__.py`` files) puts the
folder of each conftest.py on ``sys.path``, so the helper modules in this folder (``compaction_helpers``) import
by name from any sub-folder, and a test folder's own helpers (``backends/backend_helpers.py``) from its tests."""

# ``--doctest-modules`` would import every conftest.py a second time as a module named ``conftest``, which two
# folders cannot share; conftest files hold fixtures, not doctests.
collect_ignore_glob = ["conftest.py", "*/conftest.py"]
