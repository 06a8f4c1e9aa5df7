"""Imported by the forkserver the suite's ranks fork from (:func:`lab.testing.use_pools`): every mtds and
lab module, as a pooled rank imports them before its reset state is taken, so that a pool's start or
restart forks ranks that already hold them instead of importing them in each rank."""
from lab.testing.pool import _import_everything

_import_everything()
