"""Imported by the forkserver the suite's ranks fork from (:func:`lab.testing.use_pools`): every mtds and
lab module, as a pooled rank imports them before its reset state is taken, so that a pool's start or
restart forks ranks that already hold them instead of importing them in each rank. Then gc.freeze(): the
forked ranks' full collections skip these ~1M objects, which live as long as the rank
(``lab.testing.pool`` freezes again once its reset state is taken)."""
import gc

from lab.testing.pool import _import_everything

_import_everything()
gc.collect()
gc.freeze()
