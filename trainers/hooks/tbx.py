"""The pieces of tensorboardX the TensorBoard logger writes with, imported without PyTorch.

tensorboardX's package ``__init__`` imports its ``SummaryWriter``, whose module imports PyTorch
whenever it is installed (only to accept ``torch.Tensor`` values, which xshard never passes),
and its record writer imports Google Cloud Storage when that is installed (only for ``gs://``
log dirs; a run's TensorBoard dir is a local folder, ``paths.tb_dir``). With the ``elastic``
extra (CPU torch) that was ~1.3 CPU-s of every run's start-up, in every process. Here both
are hidden from tensorboardX's import (``sys.modules[name] = None`` makes ``import name``
raise ``ImportError``, which tensorboardX catches), then shown again, so that code that needs
PyTorch (torchft, for elastic replica groups) imports it as before. Where either is already
imported, it stays as it is. Import tensorboardX's names from here, not from tensorboardX.
"""

from __future__ import annotations

import sys

#: What tensorboardX imports if installed and xshard never needs from it.
_HIDDEN = [name for name in ("torch", "google.cloud.storage") if name not in sys.modules]
for _name in _HIDDEN:
    sys.modules[_name] = None  # type: ignore[assignment]
try:
    from tensorboardX import summary
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.api_pb2 import (
        DataType,
        Experiment,
        HParamInfo,
        MetricInfo,
        MetricName,
        Status,
    )
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.plugin_hparams_pb2 import (
        HParamsPluginData,
        SessionEndInfo,
        SessionStartInfo,
    )
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboardX.record_writer import directory_check
finally:
    for _name in _HIDDEN:
        del sys.modules[_name]

__all__ = [
    "DataType",
    "Event",
    "EventsWriter",
    "Experiment",
    "HParamInfo",
    "HParamsPluginData",
    "MetricInfo",
    "MetricName",
    "SessionEndInfo",
    "SessionStartInfo",
    "Status",
    "Summary",
    "SummaryMetadata",
    "directory_check",
    "summary",
]
