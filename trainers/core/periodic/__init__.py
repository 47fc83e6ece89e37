"""A periodic mesh axis (local SGD, DiLoCo): its replicas, inner and sync programs (`axis`:
`Periodic`, and the params to evaluate of a periodic run, `outer_params`), and the programs it
adds after the steps that call for them (`sync`: `PeriodicPrograms`); an elastic axis's sync
over replica groups (`group_sync`: `ElasticSync`, around an `Exchange`; `local_arrays`: what
one process of a group holds of its arrays). Importable from here."""

from trainers.core.periodic.axis import BYTES_TAG, SYNC_TAG, Periodic, is_sync_tag, outer_params
from trainers.core.periodic.sync import AfterStep, PeriodicPrograms

__all__ = [
    "BYTES_TAG",
    "SYNC_TAG",
    "AfterStep",
    "Periodic",
    "PeriodicPrograms",
    "is_sync_tag",
    "outer_params",
]
