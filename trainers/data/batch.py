"""What a batch is: named NumPy arrays of this process's rows (the first axis)."""

import numpy as np

#: One batch: names -> arrays whose first axis is the batch axis.
Batch = dict[str, np.ndarray]
